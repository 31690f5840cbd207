"""Context parallelism: the sequence split over the cp ranks of ``ParallelState`` for long context.

- ``split``: the load-balanced causal split (2 cp chunks, rank r holds r and 2cp-1-r) of batches and tensors.
- ``ring``: p2p ring attention (K/V blocks around the cp ring, online-softmax merge), cp_comm_type "p2p".
- ``ulysses``: all-to-all between sequence- and head-sharding (DeepSpeed-Ulysses), cp_comm_type "a2a".
- ``allgather``: K/V all-gathered over cp, the simple baseline, cp_comm_type "allgather".
- ``hierarchical``: Ulysses inside the inner cp level, ring attention across the outer one, cp_comm_type
  "a2a+p2p" (with ``initialize_model_parallel(hierarchical_context_parallel_sizes=...)``).
- ``attention``: ``context_parallel_attention``, which ``DotProductAttention`` calls when cp > 1.
- ``blocks`` / ``fused``: one block's attention with its log-sum-exp (tiled torch math or fused kernels);
  ``band``: sliding windows over global positions for them; ``sinks``: attention sinks and ``BlockAttention``.
  Every scheme supports gpt-oss's sliding windows and sinks.

Gradients of replicated parameters are reduced over dp x cp (``ParallelState.dp_cp_group``), and the loss
of a micro-batch is normalized by its token count over every cp rank (``training.loop.forward_step``).
"""
from megatron_core.context_parallel.allgather import allgather_attention
from megatron_core.context_parallel.attention import CP_COMM_TYPES, check_cp_comm_type, context_parallel_attention
from megatron_core.context_parallel.hierarchical import hierarchical_attention
from megatron_core.context_parallel.ring import ring_attention
from megatron_core.context_parallel.split import (
    check_sequence_split,
    chunk_ids,
    local_positions,
    rank_chunk_order,
    split_batch,
    split_sequence,
    to_natural_order,
    to_rank_chunk_order,
)
from megatron_core.context_parallel.ulysses import check_heads_divisible, ulysses_attention

__all__ = [
    "CP_COMM_TYPES", "allgather_attention", "check_cp_comm_type", "check_heads_divisible", "check_sequence_split",
    "chunk_ids", "context_parallel_attention", "hierarchical_attention", "local_positions", "rank_chunk_order",
    "ring_attention", "split_batch", "split_sequence", "to_natural_order", "to_rank_chunk_order", "ulysses_attention",
]
