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


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (Peng et al. 2023, arXiv 2309.00071; Megatron's ``--rope-type yarn``, transformers' rope type "yarn"):
    frequencies whose wavelength fits the original context more than ``beta_fast`` times are kept, fewer than
    ``beta_slow`` times divided by ``factor``, with a linear ramp between; cos and sin are multiplied by
    ``attention_factor``."""

    factor: float
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True

    @property
    def attention_factor(self) -> float:
        """``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` (1 when factor <= 1)."""
        from megatron_core.config_variants import yarn_get_mscale
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)

    def _correction_dim(self, rotations: float, dim: int, base: float) -> float:
        return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    def apply(self, inv_freq: torch.Tensor, *, dim: int, base: float) -> torch.Tensor:
        """The scaled inverse frequencies ``[dim/2]`` (transformers' ``_compute_yarn_parameters``, op for op)."""
        low = self._correction_dim(self.beta_fast, dim, base)
        high = self._correction_dim(self.beta_slow, dim, base)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation_share = 1 - ramp
        return inv_freq / self.factor * (1 - extrapolation_share) + inv_freq * extrapolation_share


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
                 rope_scaling: Optional[Llama3RopeScaling] = None, interleaved: bool = False,
                 yarn: Optional[YarnRopeScaling] = None) -> None:
        super().__init__()
        self.interleaved = interleaved
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        inv_freq = 1.0 / (rotary_base ** exponents)
        if rope_scaling is not None:
            inv_freq = rope_scaling.apply(inv_freq)
        if yarn is not None:
            inv_freq = yarn.apply(inv_freq, dim=rotary_dim, base=rotary_base)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.inv_freq.device != position_ids.device:  # built on the host: moved once to the positions' device
            self.inv_freq = self.inv_freq.to(position_ids.device)  # (a CUDA run failed here: cuda x cpu)
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


def _rotate(x: torch.Tensor, angles: torch.Tensor, interleaved: bool, mscale: float, sign: float) -> torch.Tensor:
    """``mscale (x cos + sign R(x) sin)`` in fp32, returned in x's dtype (R: ``_rotate_half``)."""
    x32 = x.float()
    cos, sin = angles.cos(), angles.sin()
    if mscale != 1.0 or sign != 1.0:
        cos, sin = cos * mscale, sin * (sign * mscale)
    return (x32 * cos + _rotate_half(x32, interleaved) * sin).to(x.dtype)


class _Rotary(torch.autograd.Function):
    """Rotary embedding that saves only ``angles`` for backward (one tensor shared by every layer of a
    micro-batch), not the fp32 cos and sin of each call, which autograd would save per layer for q and for k
    (4 x ``[s, b, 1, r]`` fp32: 17 MB a layer at Llama-3-70B, s 8192). Backward rotates the gradient back:
    each channel pair is rotated by one angle and R^T = -R, so the gradient of a rotation by theta is the
    rotation by -theta (times ``mscale``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, angles: torch.Tensor, interleaved: bool, mscale: float) -> torch.Tensor:
        ctx.save_for_backward(angles)
        ctx.interleaved, ctx.mscale = interleaved, mscale
        return _rotate(x, angles, interleaved, mscale, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (angles,) = ctx.saved_tensors
        return _rotate(grad, angles, ctx.interleaved, ctx.mscale, -1.0), None, None, None


def apply_rotary_pos_emb(x: torch.Tensor, angles: torch.Tensor, *, interleaved: bool = False,
                         mscale: float = 1.0) -> torch.Tensor:
    """Rotates the first ``r`` channels of ``x`` ``[s, b, heads, d]`` by ``angles`` ``[s, b, 1, r]``, ``r <= d``
    (computed in fp32, returned in x's dtype); channels ``r:`` pass through unchanged. ``interleaved``: the
    channel pairs are (2i, 2i + 1), with angles from ``RotaryEmbedding(interleaved=True)``. ``mscale``
    multiplies cos and sin (YaRN's ``attention_factor``; ``config.rope_attention_factor``). Saves only
    ``angles`` for backward (``_Rotary``); the angles get no gradient."""
    assert not angles.requires_grad, "rotary angles are positions: they take no gradient"
    rotary_dim = angles.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    out = _Rotary.apply(rotated, angles, interleaved, mscale)
    return out if passed.shape[-1] == 0 else torch.cat([out, passed], dim=-1)
