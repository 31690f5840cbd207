"""Memory of the zero-bubble schedule (``pipeline_parallel.schedule_plan.zero_bubble_ops``): what a split
backward leaves for its W pass, and the peak of a stage that holds such passes beside its 1F1B activations.

A split backward frees the micro-batch's activations except what its deferred weight GEMMs read: each
column-/row-parallel linear's input ``X`` and output gradient ``dY`` (``tensor_parallel.weight_grad_store``).
Per layer, on one tp rank (``s`` the rank's tokens, ``t`` = tp; a column-parallel input is the local ``s/t``
chunk under sequence parallelism, which W all-gathers again):

    QKV   X: s b h (/t with SP)    dY: s b (q + 2 kv) / t
    proj  X: s b q / t             dY: s b h
    fc1   X: s b h (/t with SP)    dY: s b fc1 / t      (fc1 = ffn, 2 ffn for SwiGLU)
    fc2   X: s b ffn / t           dY: s b h

plus the last stage's output layer (``X`` and the logits gradient ``s b V / t``). MoE layers keep their expert
GEMMs whole and count their attention only (a shared expert's MLP is split too, and not counted here); the
chunked ``tp_comm_overlap`` GEMMs are never split.

The peak of a rank comes from walking its order (``zero_bubble_extra_bytes``): an F holds one micro-batch's
activations until its B; a split B turns them into a stash held until its W. Rank 0 runs whole backwards
(no extra); ZB-H1 (``defer="all"``) adds r stashes on rank r; the cooldown split adds stashes only where its
draining stage holds fewer micro-batches than the stashes cost (the last stage: r - 1 of them). Measured at
pp 4 (``tests/distributed/test_zero_bubble.py``): +1.0 / 2.0 / 3.3 stashes for ZB-H1, +2.1 on the last stage
for cooldown.
"""
from __future__ import annotations

from megatron_core.config import TransformerConfig
from megatron_core.pipeline_parallel.schedule_plan import zero_bubble_ops
from megatron_core.planning.activations import ActivationShape


def weight_stash_bytes(config: TransformerConfig, shape: ActivationShape, *, layers: int, last: bool,
                       padded_vocab_size: int, moe_layers: int = 0) -> float:
    """Bytes one split backward of a stage of ``layers`` layers keeps until its W pass (module docstring)."""
    t = shape.tp
    if config.tp_comm_overlap and config.sequence_parallel and t > 1:
        return 0.0  # the chunked overlap GEMMs run whole backwards
    s, b, h, e = shape.local_seq_length, shape.micro_batch_size, config.hidden_size, shape.element_bytes
    column_input = s * b * h / (t if shape.sequence_parallel else 1)
    q_dim = config.kv_channels * config.num_attention_heads
    qkv = q_dim + 2 * config.kv_channels * config.num_query_groups
    ffn = config.ffn_hidden_size
    fc1 = 2 * ffn if config.gated_activation else ffn
    attention = (column_input + s * b * qkv / t) + (s * b * q_dim / t + s * b * h)
    mlp = (column_input + s * b * fc1 / t) + (s * b * ffn / t + s * b * h)
    stash = (layers - moe_layers) * (attention + mlp) + moe_layers * attention
    if last:
        stash += column_input + s * b * padded_vocab_size / t
    return e * stash


def zero_bubble_extra_bytes(*, pp_rank: int, pp_size: int, num_microbatches: int, defer: str,
                            microbatch_bytes: float, stash_bytes: float) -> float:
    """Bytes a zero-bubble rank holds at its peak beyond 1F1B's ``min(p - r, m)`` micro-batches: the rank's
    order (``zero_bubble_ops``) walked pass by pass, F holding a micro-batch's activations until its B, a
    split B turning them into a stash held until its W."""
    ops = zero_bubble_ops(pp_rank, pp_size, num_microbatches, defer=defer)
    split = {op.microbatch for op in ops if op.kind == "W"}
    activations = stashes = 0
    peak = 0.0
    for op in ops:
        if op.kind == "F":
            activations += 1
        elif op.kind == "B":
            activations -= 1
            stashes += op.microbatch in split
        else:
            stashes -= 1
        peak = max(peak, activations * microbatch_bytes + stashes * stash_bytes)
    return max(peak - min(pp_size - pp_rank, num_microbatches) * microbatch_bytes, 0.0)


__all__ = ["weight_stash_bytes", "zero_bubble_extra_bytes"]
