"""The transient bytes of data parallelism that model states miss: what exists only for part of a step.

- ZeRO-3 gathers parameters around each unit (a module owning parameters): at most two neighbouring units
  (current + prefetched) are full at once (in an MoE model's backward: the local experts of two MoE layers), plus the
  small unit (norms and biases) of this layer and the next.
- ZeRO 2-3 reduce full-size gradient buckets (fp32, or 16-bit with ``grad_bytes=2``) that are freed when the
  collective completes; one bucket's collective stays in flight while the next one fills (so that it overlaps
  that backward), and older ones are finished before a new bucket is allocated: two exist at a time (at stage
  3, two neighbouring units').
- At every stage autograd first produces a parameter's grad in the parameter's dtype before it moves into its
  bucket: one parameter's worth.

These are upper bounds that a real run reaches (tested against ``LiveMemoryTracker`` peaks in
``tests/distributed/test_planner.py``), each at its own moment: the plan adds to the activations only what
coexists with them (``planning.peak_phases``).
"""
from __future__ import annotations

from typing import Optional

from megatron_core.config import TransformerConfig
from megatron_core.planning.moe import (
    expert_ffn,
    expert_parameters_per_rank,
    expert_units,
    moe_layers_on_stage,
    stage_layer_count,
)
from megatron_core.tensor_parallel.utils import vocab_size_with_padding

DEFAULT_STAGE2_BUCKET = 4_000_000  # DistributedDataParallelConfig's default bucket at ZeRO-2, in elements


def stage_units(config: TransformerConfig, *, vocab_size: int, make_vocab_size_divisible_by: int,
                first: bool, last: bool, moe_layers: int = 0, ep: int = 1,
                etp: int = 1, layers: Optional[int] = None) -> tuple[list[float], float]:
    """(elements of each weight unit in forward order, elements of one layer's small unit: its norms and
    biases) on one tp rank of a pipeline stage of ``GPTModel``. A tied output layer on the embedding's stage
    borrows the embedding's unit (listed again at its place). ``moe_layers`` of the stage's layers are MoE
    layers (``planning.moe.expert_units``: router, all local experts as one unit, shared expert) at
    expert-parallel size ``ep``; they are taken as the stage's last layers (placement barely matters)."""
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    h = config.hidden_size
    ffn = config.ffn_hidden_size * (2 if config.gated_activation else 1)
    qkv = config.kv_channels * (config.num_attention_heads + 2 * config.num_query_groups)
    q_dim = config.kv_channels * config.num_attention_heads
    norm = h * (2 if config.normalization == "LayerNorm" else 1)
    layers = layers if layers is not None else config.num_layers // pp  # (the caller's stage_layer_count)
    attention = [qkv * h / tp, h * q_dim / tp]
    moe_units, moe_small = expert_units(config, tp=tp, ep=ep, etp=etp) if moe_layers else ([], 0.0)
    units: list[float] = []
    padded = vocab_size_with_padding(vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                     tensor_model_parallel_size=tp)
    if first:
        units.append(padded * h / tp)
        if config.position_embedding_type == "learned_absolute":
            units.append(h * config.max_position_embeddings)
    units += (attention + [ffn * h / tp, h * config.ffn_hidden_size / tp]) * (layers - moe_layers)
    units += (attention + moe_units) * moe_layers
    # a layer's norms and biases: one small unit of the layer (gathers_small_parameters)
    small = 2 * norm + (qkv / tp if config.add_qkv_bias else 0) + (
        (2 * h + ffn / tp) if config.add_bias_linear else 0)
    if moe_layers == layers and layers:  # the small unit: attention's biases and the shared expert's
        small += moe_small - ((h + ffn / tp) if config.add_bias_linear else 0)
    if last:
        units.append(norm)
        units.append(padded * h / tp)  # the output layer (tied on the first stage: the embedding, borrowed)
    return units, small


def zero_transient_bytes(config: TransformerConfig, **kwargs) -> float:
    """Peak transient bytes on one rank of pipeline stage ``pp_rank`` (see the module docstring): the sum of
    ``zero_transient_parts``, which takes the same keywords."""
    return sum(zero_transient_parts(config, **kwargs))


def zero_transient_parts(config: TransformerConfig, *, vocab_size: int, make_vocab_size_divisible_by: int,
                         pp_rank: int, zero_stage: int, stage_params: float,
                         bucket_size: int = DEFAULT_STAGE2_BUCKET, ep: int = 1,
                         etp: int = 1, layers_only: bool = False, grad_bytes: int = 4) -> tuple[float, float]:
    """(autograd's grad of the largest parameter, the rest: ZeRO's gathered units and grad buckets), the peak
    transient bytes on one rank of pipeline stage ``pp_rank``. The two units gathered at once are neighbours in
    forward order (the current one and its prefetch). With ``layers_only``, those of a transformer layer's
    backward (the embedding and output layer left out: their moments are ``planning.peak_phases``'), (0, 0) on
    a stage without layers (``peak_phases`` places the parameter's grad at its own moment)."""
    pp = config.pipeline_model_parallel_size
    param_bytes = 2 if (config.bf16 or config.fp16) else 4
    units, small = stage_units(config, vocab_size=vocab_size,
                               make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                               first=pp_rank == 0 and not layers_only, last=pp_rank == pp - 1 and not layers_only,
                               layers=stage_layer_count(config, pp_rank),
                               moe_layers=moe_layers_on_stage(config, pp_rank=pp_rank), ep=ep, etp=etp)
    if not units:
        return 0.0, 0.0
    largest = max(units)
    pair = max((a + b for a, b in zip(units, units[1:])), default=largest)
    moe_layers = moe_layers_on_stage(config, pp_rank=pp_rank)
    largest_param = largest
    if moe_layers:
        experts = expert_parameters_per_rank(config, ep=ep, etp=etp)
        if moe_layers > 1:  # backward gathers the previous MoE layer's experts while this one's still are
            pair = max(pair, 2 * experts)
        # the experts' unit holds many parameters: autograd's largest single grad is one expert's fc1
        gated = 2 if config.gated_activation else 1
        largest_param = max([u for u in units if u != experts]
                            + [gated * expert_ffn(config) * config.hidden_size / etp])
    param_grad = param_bytes * largest_param  # autograd's grad of one parameter, before it moves into a bucket
    transient = 0.0
    if zero_stage == 3:
        transient += param_bytes * (2 * small + pair)  # two units, this and the next layer's small
        transient += grad_bytes * (largest + small)  # a full-size grad bucket, and the layer's small one, which
        #                                     fills during the whole backward of the layer
    elif zero_stage == 2:  # DistributedDataParallelConfig's default: capped at a quarter of the model, >= 1M
        bucket = min(bucket_size, max(1_000_000, stage_params // 4), stage_params)
        transient += grad_bytes * min(2 * bucket, stage_params)  # one bucket reducing, the next one filling
    return param_grad, transient


__all__ = ["stage_units", "zero_transient_bytes", "zero_transient_parts"]
