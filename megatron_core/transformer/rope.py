"""Rotary position embeddings (Su et al. 2021, arXiv 2104.09864), GPT-NeoX / Llama "rotate half" layout."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Angles ``position * base^(-2i/d)`` for the first ``d`` channels of every head (``d = rotary_dim``:
    ``kv_channels * rotary_percent``; the remaining channels are not rotated).

    forward(position_ids ``[b, s]``) -> ``[s, b, 1, d]`` fp32 angles, each frequency repeated for both halves.
    With ``seq_len_interpolation_factor`` positions are divided by it first (linear position interpolation).
    """

    def __init__(self, rotary_dim: int, *, rotary_base: float = 10000.0,
                 seq_len_interpolation_factor: Optional[float] = None) -> None:
        super().__init__()
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponents), persistent=False)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        positions = position_ids.t().to(torch.float32)  # [s, b]
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions.unsqueeze(-1) * self.inv_freq  # [s, b, d/2]
        return torch.cat([freqs, freqs], dim=-1).unsqueeze(2)  # [s, b, 1, d]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotates the first ``r`` channels of ``x`` ``[s, b, heads, d]`` by ``angles`` ``[s, b, 1, r]``, ``r <= d``
    (computed in fp32, returned in x's dtype); channels ``r:`` pass through unchanged."""
    rotary_dim = angles.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    x32 = rotated.float()
    out = (x32 * angles.cos() + _rotate_half(x32) * angles.sin()).to(x.dtype)
    return out if passed.shape[-1] == 0 else torch.cat([out, passed], dim=-1)
