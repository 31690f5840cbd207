"""All-gather context parallelism (the simple baseline): every cp rank gathers the keys and values of the
whole sequence and attends with its own queries. Memory for K/V is that of the full sequence; the scores
are ``[s/cp, <= s]`` per rank, cut to the keys each query chunk can see.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import kernels
from megatron_core.context_parallel.split import chunk_ids, to_natural_order
from megatron_core.tensor_parallel import gather_from_sequence_parallel_region, get_rng_tracker


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, *, scale: float,
            dropout_p: float) -> torch.Tensor:
    """``[sq, b, hq, d]`` queries over ``[sk, b, hk, d]`` keys/values with a boolean ``[b|1, 1, sq, sk]`` mask
    -> ``[sq, b, hq * d]``. The fused masked softmax (Triton where it runs); dropout from the tracker's
    model-parallel RNG state (different per tp rank)."""
    sq, b, heads, d = query.shape
    groups = key.shape[2]
    if heads != groups:
        key, value = key.repeat_interleave(heads // groups, dim=2), value.repeat_interleave(heads // groups, dim=2)
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
    scores = torch.matmul(q, k.transpose(-1, -2))  # [b, heads, sq, sk]
    probs = kernels.scaled_masked_softmax(scores, mask.expand(b, 1, *mask.shape[-2:]), scale)
    if dropout_p > 0.0:
        with get_rng_tracker(query.device).fork():
            probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(sq, b, heads * d)


def allgather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], *, cp_group, cp_size: int, cp_rank: int,
                        scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's queries over the all-gathered keys and values.

    Args:
        query: ``[s/cp, b, hq, d]``, this rank's two chunks (load-balanced split) in local order.
        key, value: ``[s/cp, b, hk, d]`` (GQA: hk divides hq).
        attention_mask: None (causal) or boolean ``[b|1, 1, s, s]`` over global positions, True = masked out
            (combined with the causal mask).
        cp_group: the context-parallel group; cp_size, cp_rank: its size and this rank's index.
        scale: multiplies the scores; dropout_p: attention dropout (0 in eval).

    Returns:
        ``[s/cp, b, hq * d]`` in local order.

    Communication: forward all-gathers K and V over cp (one collective, ``[s, 2, b, hk, d]``); backward
    reduce-scatters their gradients (each rank's partial sums) back to the owning ranks.
    """
    chunk = query.shape[0] // 2
    kv = gather_from_sequence_parallel_region(torch.stack([key, value], dim=1), cp_group)  # [s, 2, b, hk, d]
    kv = to_natural_order(kv, dim=0, cp_size=cp_size)
    outputs = []
    for place, index in enumerate(chunk_ids(cp_size, cp_rank)):
        start, end = index * chunk, (index + 1) * chunk  # this query chunk's global positions; keys [0, end)
        causal = torch.ones(chunk, end, dtype=torch.bool, device=query.device).triu_(start + 1)[None, None]
        mask = causal if attention_mask is None else causal | attention_mask[:, :, start:end, :end]
        outputs.append(_attend(query[place * chunk:(place + 1) * chunk], kv[:end, 0], kv[:end, 1], mask,
                               scale=scale, dropout_p=dropout_p))
    return torch.cat(outputs, dim=0)


__all__ = ["allgather_attention"]
