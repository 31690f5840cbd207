"""Rotary position embeddings (Su et al. 2021, arXiv 2104.09864): the GPT-NeoX / Llama "rotate half" layout
(channel i pairs with i + d/2), or the interleaved one of the paper and GPT-J (2i with 2i + 1; Megatron-LM's
``--rotary-interleaved``)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1's frequency scaling (Megatron's ``--use-rope-scaling``; transformers' rope type "llama3"):
    wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``,
    shorter than ``original_max_position_embeddings / high_freq_factor`` kept, and the band between blended."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies ``[d/2]`` (transformers' ``_compute_llama3_parameters``, op for op)."""
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Angles ``position * base^(-2i/d)`` for the first ``d`` channels of every head (``d = rotary_dim``:
    ``kv_channels * rotary_percent``; the remaining channels are not rotated).

    forward(position_ids ``[b, s]``) -> ``[s, b, 1, d]`` fp32 angles, each frequency repeated for both halves
    (``interleaved``: for both channels of its pair, ``f0 f0 f1 f1 ...``).
    With ``seq_len_interpolation_factor`` positions are divided by it first (linear position interpolation);
    with ``rope_scaling`` the frequencies are Llama-3's scaled ones.
    """

    def __init__(self, rotary_dim: int, *, rotary_base: float = 10000.0,
                 seq_len_interpolation_factor: Optional[float] = None,
                 rope_scaling: Optional[Llama3RopeScaling] = None, interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        inv_freq = 1.0 / (rotary_base ** exponents)
        self.register_buffer("inv_freq", inv_freq if rope_scaling is None else rope_scaling.apply(inv_freq),
                             persistent=False)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        positions = position_ids.t().to(torch.float32)  # [s, b]
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions.unsqueeze(-1) * self.inv_freq  # [s, b, d/2]
        if self.interleaved:
            return torch.stack([freqs, freqs], dim=-1).flatten(-2).unsqueeze(2)  # [s, b, 1, d]: f0 f0 f1 f1 ...
        return torch.cat([freqs, freqs], dim=-1).unsqueeze(2)  # [s, b, 1, d]


def _rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:  # (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
        return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, angles: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotates the first ``r`` channels of ``x`` ``[s, b, heads, d]`` by ``angles`` ``[s, b, 1, r]``, ``r <= d``
    (computed in fp32, returned in x's dtype); channels ``r:`` pass through unchanged. ``interleaved``: the
    channel pairs are (2i, 2i + 1), with angles from ``RotaryEmbedding(interleaved=True)``."""
    rotary_dim = angles.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    x32 = rotated.float()
    out = (x32 * angles.cos() + _rotate_half(x32, interleaved) * angles.sin()).to(x.dtype)
    return out if passed.shape[-1] == 0 else torch.cat([out, passed], dim=-1)
