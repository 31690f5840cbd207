"""All-to-all (DeepSpeed-Ulysses, arXiv 2309.14509) context parallelism: an all-to-all over cp turns the
sequence-sharded ``[s/cp, b, heads, d]`` into head-sharded ``[s, b, heads/cp, d]``, ordinary attention runs
over the whole sequence for ``heads/cp`` heads, and a second all-to-all turns the output back.

Needs the query heads and the key/value groups of each tp rank to be divisible by cp (GQA: splitting both
into cp contiguous parts keeps each query head with its key/value group).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Optional

import torch

from megatron_core.context_parallel.split import to_natural_order, to_rank_chunk_order
from megatron_core.tensor_parallel.mappings import all_to_all


def seq_to_heads(x: torch.Tensor, cp_size: int, group) -> torch.Tensor:
    """``[s/cp, b, h, d]`` -> ``[s, b, h/cp, d]`` (sequence in rank-chunk order). One all-to-all (backward:
    the all-to-all of ``heads_to_seq``)."""
    s_local, b, h, d = x.shape
    parts = x.view(s_local, b, cp_size, h // cp_size, d).permute(2, 0, 1, 3, 4)  # [cp (to), s/cp, b, h/cp, d]
    return all_to_all(parts, group).reshape(cp_size * s_local, b, h // cp_size, d)


def heads_to_seq(x: torch.Tensor, cp_size: int, group) -> torch.Tensor:
    """``[s, b, h/cp, d]`` (rank-chunk order) -> ``[s/cp, b, h, d]``. One all-to-all (inverse of seq_to_heads;
    backward: the all-to-all of ``seq_to_heads``)."""
    s, b, h_part, d = x.shape
    parts = all_to_all(x.view(cp_size, s // cp_size, b, h_part, d), group)  # [cp (from), s/cp, b, h/cp, d]
    return parts.permute(1, 2, 0, 3, 4).reshape(s // cp_size, b, cp_size * h_part, d)


_HEAD_SPLITS = MappingProxyType({  # cp_comm_type: (what the heads are split over, the fix)
    "a2a": ("context_parallel_size {size}", "use --cp-comm-type p2p or allgather, or change the sizes"),
    "a2a+p2p": ("the all-to-all level of --hierarchical-context-parallel-sizes ({size})",
                "choose a smaller first size or change the head counts"),
})


def check_heads_divisible(*, heads_per_rank: int, groups_per_rank: int, cp_size: int,
                          cp_comm_type: str = "a2a") -> None:
    """Raises ValueError unless the all-to-all can split this tp rank's query heads and key/value groups over
    ``cp_size`` ranks (the cp group for "a2a", the inner level of hierarchical cp for "a2a+p2p")."""
    if heads_per_rank % cp_size or groups_per_rank % cp_size:
        over, fix = _HEAD_SPLITS[cp_comm_type]
        raise ValueError(f"cp_comm_type '{cp_comm_type}' splits attention heads over {over.format(size=cp_size)}, "
                         f"but each tensor-parallel rank has {heads_per_rank} query heads and {groups_per_rank} "
                         "key/value groups (num_attention_heads and num_query_groups / tensor_model_parallel_size); "
                         f"both must be divisible by {cp_size}: {fix}")


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], *, cp_group, cp_size: int,
                      local_attention: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Attention over the whole sequence for ``heads/cp`` heads, between two all-to-alls over cp.

    Args:
        query: ``[s/cp, b, hq, d]`` in local order (load-balanced split); key, value: ``[s/cp, b, hk, d]``.
        attention_mask: None (causal) or boolean ``[b|1, 1, s, s]`` over global positions, passed through.
        cp_group, cp_size: the context-parallel group and its size.
        local_attention: ``(q [s, b, hq/cp, d], k, v [s, b, hk/cp, d], mask) -> [s, b, hq/cp * d]``, the
            single-rank core attention (natural order, causal when mask is None). cp rank r holds heads
            ``[r hq/cp, (r + 1) hq/cp)`` of this tp rank's: a sliding window applies as it is (the positions
            are the global ones), per-head sink logits must be those heads' (``DotProductAttention`` passes
            them).

    Returns:
        ``[s/cp, b, hq * d]`` in local order.

    Communication: forward, one all-to-all each for q, k and v (sequence -> heads) and one for the output
    (heads -> sequence); backward, the same four all-to-alls in the reverse direction.
    """
    s_local, b, hq, d = query.shape
    check_heads_divisible(heads_per_rank=hq, groups_per_rank=key.shape[2], cp_size=cp_size)
    q, k, v = (to_natural_order(seq_to_heads(x, cp_size, cp_group), dim=0, cp_size=cp_size)
               for x in (query, key, value))  # [s, b, heads/cp, d]
    context = local_attention(q, k, v, attention_mask)  # [s, b, hq/cp * dv]
    context = to_rank_chunk_order(context.view(s_local * cp_size, b, hq // cp_size, -1), dim=0, cp_size=cp_size)
    return heads_to_seq(context, cp_size, cp_group).reshape(s_local, b, -1)


__all__ = ["check_heads_divisible", "ulysses_attention"]
