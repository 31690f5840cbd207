"""The entry point the core attention calls when ``context_parallel_size > 1``: picks the communication
scheme (``cp_comm_type``, Megatron's names) and checks the shapes it needs."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_core.config import CP_COMM_TYPES
from megatron_core.context_parallel.allgather import allgather_attention
from megatron_core.context_parallel.hierarchical import hierarchical_attention
from megatron_core.context_parallel.ring import ring_attention
from megatron_core.context_parallel.split import check_sequence_split
from megatron_core.context_parallel.ulysses import ulysses_attention
from megatron_core.parallel_state import ParallelState


def check_cp_comm_type(cp_comm_type: str) -> None:
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {cp_comm_type!r}")


def _check_inputs(query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  cp_size: int) -> None:
    s_local = query.shape[0]
    seq_length = s_local * cp_size
    if s_local % 2:
        check_sequence_split(seq_length, cp_size)  # raises, naming the lengths
    if key.shape[0] != s_local:
        raise ValueError(f"context-parallel attention needs keys for the same {s_local} local positions as the "
                         f"queries, got {key.shape[0]}: an inference cache does not work with context parallelism")
    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-2:] != (
                seq_length, seq_length) or attention_mask.dtype != torch.bool:
            raise ValueError(f"with context parallelism attention_mask is the boolean mask of the whole sequence, "
                             f"[b or 1, 1, {seq_length}, {seq_length}] (global positions, True = masked), got "
                             f"{attention_mask.dtype} {tuple(attention_mask.shape)}")


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Optional[torch.Tensor], *, parallel_state: ParallelState,
                               cp_comm_type: str, scale: float, dropout_p: float,
                               local_attention: Callable[..., torch.Tensor], window: Optional[tuple[int, int]] = None,
                               sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this cp rank's tokens (load-balanced split) over the whole sequence.

    Args:
        query: ``[s/cp, b, hq, d]`` (hq: heads of this tp rank); key, value: ``[s/cp, b, hk, d]``.
        attention_mask: None (causal) or boolean ``[b|1, 1, s, s]`` over global positions, True = masked out.
        parallel_state: its cp group, ranks and rank.
        cp_comm_type: "p2p" (ring attention), "a2a" (Ulysses), "allgather", or "a2a+p2p" (Ulysses over the
            inner level of the state's hierarchical cp groups, ring attention over the outer one).
        scale: multiplies the scores; dropout_p: attention dropout probability (0 in eval).
        local_attention: the single-rank core attention that "a2a" runs over the whole sequence (for its
            ``heads/cp`` heads: the caller's local_attention applies their window and sinks itself).
        window: the layer's sliding window ``(left, right)`` over global positions (-1 unbounded), or None.
        sink: ``[hq]`` attention-sink logits of this rank's heads ("p2p", "allgather"), or None.

    Returns:
        ``[s/cp, b, hq * d]``. The collectives of each scheme are listed in its module.
    """
    check_cp_comm_type(cp_comm_type)
    state = parallel_state
    _check_inputs(query, key, attention_mask, state.cp_size)
    if cp_comm_type == "p2p":
        return ring_attention(query, key, value, attention_mask, cp_group=state.cp_group, cp_ranks=state.cp_ranks,
                              cp_rank=state.cp_rank, scale=scale, dropout_p=dropout_p, rng_tracker=state.rng_tracker,
                              window=window, sink=sink)
    if cp_comm_type == "a2a+p2p":
        return hierarchical_attention(query, key, value, attention_mask, parallel_state=state, scale=scale,
                                      dropout_p=dropout_p, window=window, sink=sink)
    if cp_comm_type == "a2a":
        return ulysses_attention(query, key, value, attention_mask, cp_group=state.cp_group, cp_size=state.cp_size,
                                 local_attention=local_attention)
    return allgather_attention(query, key, value, attention_mask, cp_group=state.cp_group, cp_size=state.cp_size,
                               cp_rank=state.cp_rank, scale=scale, dropout_p=dropout_p,
                               rng_tracker=state.rng_tracker, window=window, sink=sink)


__all__ = ["CP_COMM_TYPES", "check_cp_comm_type", "context_parallel_attention"]
