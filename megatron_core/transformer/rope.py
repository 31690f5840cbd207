"""Rotary position embeddings (Su et al. 2021, arXiv 2104.09864), GPT-NeoX / Llama "rotate half" layout."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Angles ``position * base^(-2i/d)`` for the first ``d`` channels of every head.

    forward(position_ids ``[b, s]``) -> ``[s, b, 1, d]`` fp32 angles, each frequency repeated for both halves.
    """

    def __init__(self, kv_channels: int, *, rotary_base: float = 10000.0) -> None:
        super().__init__()
        exponents = torch.arange(0, kv_channels, 2, dtype=torch.float32) / kv_channels
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponents), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        freqs = position_ids.t().to(torch.float32).unsqueeze(-1) * self.inv_freq  # [s, b, d/2]
        return torch.cat([freqs, freqs], dim=-1).unsqueeze(2)  # [s, b, 1, d]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ``[s, b, heads, d]`` by ``angles`` ``[s, b, 1, d]`` (computed in fp32, returned in x's dtype)."""
    x32 = x.float()
    return (x32 * angles.cos() + _rotate_half(x32) * angles.sin()).to(x.dtype)
