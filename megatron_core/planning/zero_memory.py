"""The transient bytes of data parallelism that model states miss: what exists only for part of a step.

- ZeRO-3 gathers parameters around each unit (a module owning parameters): at most two units (current +
  prefetched) are full at once, plus the small unit (norms and biases) of this layer and the next.
- ZeRO 2-3 reduce-scatter full-size fp32 gradient buckets that are freed when the collective completes; the
  reduce-scatters in flight are finished before the next bucket is allocated, so one exists at a time.
- At every stage autograd first produces a parameter's grad in the parameter's dtype before it moves into its
  bucket: one parameter's worth.

These are upper bounds that a real run reaches (tested against ``LiveMemoryTracker`` peaks in
``tests/distributed/test_planner.py``).
"""
from __future__ import annotations

from megatron_core.config import TransformerConfig
from megatron_core.planning.moe import expert_units, moe_layers_on_stage
from megatron_core.tensor_parallel.utils import vocab_size_with_padding

DEFAULT_STAGE2_BUCKET = 4_000_000  # DistributedDataParallelConfig's default bucket at ZeRO-2, in elements


def stage_units(config: TransformerConfig, *, vocab_size: int, make_vocab_size_divisible_by: int,
                first: bool, last: bool, moe_layers: int = 0, ep: int = 1) -> tuple[list[float], float]:
    """(elements of each weight unit, elements of one layer's small unit: its norms and biases) on one tp
    rank of a pipeline stage of ``GPTModel``. A tied output layer on the embedding's stage borrows the
    embedding's unit. ``moe_layers`` of the stage's layers are MoE layers (``planning.moe.expert_units``:
    router, all local experts as one unit, shared expert) at expert-parallel size ``ep``."""
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    h = config.hidden_size
    ffn = config.ffn_hidden_size * (2 if config.activation == "swiglu" else 1)
    qkv = config.kv_channels * (config.num_attention_heads + 2 * config.num_query_groups)
    q_dim = config.kv_channels * config.num_attention_heads
    norm = h * (2 if config.normalization == "LayerNorm" else 1)
    layers = config.num_layers // pp
    units = [qkv * h / tp, h * q_dim / tp] * layers + [ffn * h / tp, h * config.ffn_hidden_size / tp] * (
        layers - moe_layers)
    # a layer's norms and biases: one small unit of the layer (gathers_small_parameters)
    small = 2 * norm + (qkv / tp if config.add_qkv_bias else 0) + (
        (2 * h + ffn / tp) if config.add_bias_linear else 0)
    if moe_layers:
        moe_units, moe_small = expert_units(config, tp=tp, ep=ep)
        units += moe_units * moe_layers
        if moe_layers == layers:  # the small unit: attention's biases and the shared expert's
            small += moe_small - ((h + ffn / tp) if config.add_bias_linear else 0)
    padded = vocab_size_with_padding(vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                     tensor_model_parallel_size=tp)
    tied = not config.untie_embeddings_and_output_weights
    if first:
        units.append(padded * h / tp)
        if config.position_embedding_type == "learned_absolute":
            units.append(h * config.max_position_embeddings)
    if last:
        units.append(norm)
        if not (tied and first):
            units.append(padded * h / tp)
    return units, small


def zero_transient_bytes(config: TransformerConfig, *, vocab_size: int, make_vocab_size_divisible_by: int,
                         pp_rank: int, zero_stage: int, stage_params: float,
                         bucket_size: int = DEFAULT_STAGE2_BUCKET, ep: int = 1) -> float:
    """Peak transient bytes on one rank of pipeline stage ``pp_rank`` (see the module docstring)."""
    pp = config.pipeline_model_parallel_size
    param_bytes = 2 if (config.bf16 or config.fp16) else 4
    units, small = stage_units(config, vocab_size=vocab_size,
                                  make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                  first=pp_rank == 0, last=pp_rank == pp - 1,
                                  moe_layers=moe_layers_on_stage(config, pp_rank=pp_rank), ep=ep)
    largest = sorted(units, reverse=True)
    transient = param_bytes * largest[0]  # autograd's grad of one parameter, before it moves into a bucket
    if zero_stage == 3:
        transient += param_bytes * (2 * small + sum(largest[:2]))  # two units, this and the next layer's small
        transient += 4 * (largest[0] + small)  # a full-size fp32 grad bucket, and the layer's small one, which
        #                                         fills during the whole backward of the layer
    elif zero_stage == 2:  # DistributedDataParallelConfig's default: capped at a quarter of the model, >= 1M
        transient += 4 * min(bucket_size, max(1_000_000, stage_params // 4), stage_params)
    return transient


__all__ = ["stage_units", "zero_transient_bytes"]
