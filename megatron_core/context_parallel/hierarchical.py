"""Hierarchical context parallelism (``cp_comm_type`` "a2a+p2p", Megatron-LM's name): an all-to-all over the
small inner cp group (level 0 of ``ParallelState.hierarchical_cp_groups``, ``a`` ranks on the fast intra-node
link) turns sequence-sharding into head-sharding, then ring attention runs over the outer group (level 1, the
``p = cp / a`` ranks ``a`` apart, across nodes) for ``heads / a`` heads, and a second all-to-all turns the
output back. Ulysses bounds cp by the head count and the ring sends every K/V block across the slow link
``cp - 1`` times; the hybrid needs only ``a`` heads' divisibility and ``p - 1`` ring steps.

Why the chunks line up: with the load-balanced split over ``cp = a p`` (``2 cp`` fine chunks, cp rank ``r``
holds ``r`` and ``2cp-1-r``), the inner group of ring rank ``j`` (cp ranks ``ja .. ja+a-1``) holds exactly the
fine chunks of the outer split's chunks ``j`` and ``2p-1-j`` (``2p`` chunks of ``a`` fine chunks each), and
inner rank ``i``'s two chunks are that group's chunks ``i`` and ``2a-1-i``: the inner group's all-to-all output
is in the rank-chunk order of a ``cp = a`` split, so ``to_natural_order`` makes it the ring rank's local order
``[chunk j, chunk 2p-1-j]``. Example, cp 4 = a 2 x p 2, fine chunks 0..7::

    cp rank 0: 0 7 | cp rank 1: 1 6   -> all-to-all (inner group 0), natural order -> ring rank 0: 0 1 | 6 7
    cp rank 2: 2 5 | cp rank 3: 3 4   -> all-to-all (inner group 1), natural order -> ring rank 1: 2 3 | 4 5
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_core.context_parallel.ring import ring_attention
from megatron_core.context_parallel.split import to_natural_order, to_rank_chunk_order
from megatron_core.context_parallel.ulysses import check_heads_divisible, heads_to_seq, seq_to_heads
from megatron_core.parallel_state import ParallelState


def hierarchical_levels(state: ParallelState) -> tuple[int, int]:
    """``(a2a size, p2p size)`` of ``state``; ValueError unless it was built with two hierarchical cp levels."""
    sizes = state.hierarchical_cp_sizes
    if sizes is None or len(sizes) != 2:
        raise ValueError(f"cp_comm_type 'a2a+p2p' needs two hierarchical context-parallel levels, got "
                         f"{None if sizes is None else list(sizes)}: give --hierarchical-context-parallel-sizes A P "
                         f"with A x P = --context-parallel-size {state.cp_size} (A ranks all-to-all inside a node, "
                         "P ranks in the ring across nodes)")
    return sizes[0], sizes[1]


def hierarchical_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], *, parallel_state: ParallelState, scale: float,
                           dropout_p: float = 0.0, window: Optional[tuple[int, int]] = None,
                           sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this cp rank's tokens over the whole sequence, a2a inside and p2p across groups.

    Args:
        query: ``[s/cp, b, hq, d]`` in local order (load-balanced split over the whole cp group); key, value:
            ``[s/cp, b, hk, d]``.
        attention_mask: None (causal) or boolean ``[b|1, 1, s, s]`` over global positions, True = masked out.
        parallel_state: its ``hierarchical_cp_*`` levels (all-to-all level first) and cp rank.
        scale, dropout_p, window: as ``ring_attention``. sink: ``[hq]`` sink logits of this tp rank's heads
            (inner rank ``i`` uses heads ``[i hq/a, (i+1) hq/a)``; the grads of the others are zero here and
            summed over cp with the other replicated parameters' grads), or None.

    Returns:
        ``[s/cp, b, hq * d]`` in local order.

    Communication: forward, one all-to-all each for q, k and v over the a2a level, ring attention over the
    p2p level (``p - 1`` K/V steps of ``[2, b, hk/a, a s/cp, d]``), one all-to-all of the output; backward,
    the reverse all-to-alls and the ring's backward (see ``ring``).
    """
    a2a_size, _ = hierarchical_levels(parallel_state)
    a2a_group, p2p_group = parallel_state.hierarchical_cp_groups
    a2a_ranks, p2p_ranks = parallel_state.hierarchical_cp_ranks
    s_local, b, hq, _ = query.shape
    check_heads_divisible(heads_per_rank=hq, groups_per_rank=key.shape[2], cp_size=a2a_size,
                          cp_comm_type="a2a+p2p")
    q, k, v = (to_natural_order(seq_to_heads(x, a2a_size, a2a_group), dim=0, cp_size=a2a_size)
               for x in (query, key, value))  # [a s/cp, b, heads/a, d]: the ring rank's two chunks, local order
    a2a_rank = a2a_ranks.index(parallel_state.rank)
    if sink is not None:
        sink = sink.view(a2a_size, hq // a2a_size)[a2a_rank]  # this inner rank's heads
    context = ring_attention(q, k, v, attention_mask, cp_group=p2p_group, cp_ranks=p2p_ranks,
                             cp_rank=p2p_ranks.index(parallel_state.rank), scale=scale, dropout_p=dropout_p,
                             rng_tracker=parallel_state.rng_tracker, window=window, sink=sink,
                             dropout_rank=parallel_state.cp_rank)  # [a s/cp, b, hq/a * dv]
    context = to_rank_chunk_order(context.view(a2a_size * s_local, b, hq // a2a_size, -1), dim=0, cp_size=a2a_size)
    return heads_to_seq(context, a2a_size, a2a_group).reshape(s_local, b, -1)


__all__ = ["hierarchical_attention", "hierarchical_levels"]
