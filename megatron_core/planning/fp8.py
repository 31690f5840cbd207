"""What FP8 training (``config.fp8``, ``megatron_core.fp8``) changes in the planner's memory count: what the FP8
linear (``fp8.linear._Fp8Linear``) really saves for backward.

Activations: under a per-tensor recipe (delayed, tensorwise) with FP8 weight gradients, an FP8 linear saves its
input as the quantized 1-byte tensor (and a 0-dim fp32 scale) for the weight-gradient GEMM, so the
high-precision input is freed where nothing else holds it: per FP8 layer and micro-batch

    linear_qkv, linear_fc1   input (the norm output) s b h: 1 byte instead of e (sequence parallelism: the
                             local chunk s b h / t, which backward gathers again as FP8 bytes)
    linear_proj              input s b q_dim / t: 1 byte instead of e
    linear_fc2               input s b ffn / t: 1 byte instead of e
    routed experts           fc1 input M h and fc2 input M f / etp (M assignments): 1 byte instead of e
    shared expert            fc2 input as linear_fc2; its fc1 input is the router's input, which stays
                             saved in high precision, so its 1-byte copy adds s b h (SP: s b h / t)

Not changed: block recipes (blockwise, mxfp8) and ``fp8_wgrad=False`` save the high-precision input (the
wgrad GEMM quantizes along the token dim, or does not quantize); delayed scaling's calibration step (the first)
saves the high-precision input. The saved weight is the parameter (grouped experts: the stacked weights, as
without FP8). Multi-latent attention's projections and MTP layers are counted as high precision (an over-count).

Model states: unchanged. The layers keep their parameters in the model's dtype and quantize the weight at each
call (no FP8 weight copy is kept, also with ``--fp8-param-gather``, docs/fp8.md, which gathers the FP8 linears'
weights (routed experts included; per-tensor recipes and blockwise) as 1 byte per element, after the step at
ZeRO-1/2 and in each unit's forward and backward gathers at ZeRO-3: ``fp8_gathered_parameters`` and
``fp8_gathered_expert_parameters``, which ``step_time`` counts at 1 byte).
Delayed scaling's state is ``4 (3 L + 3)`` bytes per linear (amax history of length L, scales): negligible.

FLOPs: the same GEMMs; MFU is taken against the FP8 peak (``training.metrics.peak_for_device_name(fp8=True)``).
``tests/distributed/test_plan_fp8.py`` checks the count against measured steps.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_core.config import TransformerConfig
from megatron_core.fp8.config import layer_fp8
from megatron_core.fp8.param_gather import GATHERED_RECIPES
from megatron_core.planning.moe import assignments, expert_ffn

if TYPE_CHECKING:
    from megatron_core.planning.activations import ActivationShape


def gathers_fp8_inputs(config: TransformerConfig) -> bool:
    """Whether sequence parallelism all-gathers the FP8 linears' inputs as FP8 bytes (a per-tensor recipe:
    ``fp8.linear._gathered_fp8_input``; block recipes gather the high-precision input)."""
    fp8 = getattr(config, "fp8", None)
    return fp8 is not None and fp8.fp8_recipe in ("delayed", "tensorwise")


def saves_fp8_inputs(config: TransformerConfig) -> bool:
    """Whether the FP8 linears of ``config`` save their inputs as FP8 bytes (per-tensor recipe, FP8 wgrad)."""
    return gathers_fp8_inputs(config) and config.fp8.fp8_wgrad


def fp8_layers_on_stage(config: TransformerConfig, *, pp_rank: int) -> tuple[int, int]:
    """``(dense, moe)``: the transformer layers of pipeline rank ``pp_rank`` (every model chunk) whose linears
    run in FP8 (``layer_fp8``: ``--first-last-layers-bf16`` keeps the outer ones in high precision)."""
    if config.fp8 is None:
        return 0, 0
    vpp = config.virtual_pipeline_model_parallel_size
    dense = moe = 0
    for vp in range(vpp or 1):
        offset, count = config.pipeline_layer_range(pp_rank, vp if vpp else None)
        for number in range(offset + 1, offset + count + 1):
            if layer_fp8(config, number) is None:
                continue
            is_moe = config.moe is not None and config.moe.is_moe_layer(number, config.num_layers)
            moe, dense = moe + is_moe, dense + (not is_moe)
    return dense, moe


def fp8_layer_saving(config: TransformerConfig, shape: "ActivationShape", *, moe_layer: bool = False) -> float:
    """Bytes one FP8 transformer layer saves less than the same layer in high precision, per micro-batch on one
    tp rank (see the module docstring; 0 where the FP8 linears save high-precision inputs)."""
    if not saves_fp8_inputs(config):
        return 0.0
    s, b, h, t = shape.local_seq_length, shape.micro_batch_size, config.hidden_size, shape.tp
    less = shape.element_bytes - 1  # bytes per element an FP8 copy saves
    sp = t if shape.sequence_parallel else 1
    column_input = less * s * b * h / sp  # qkv's / fc1's input (SP: the local chunk)
    saving = 0.0
    if not config.multi_latent_attention:
        saving += column_input + less * s * b * config.kv_channels * config.num_attention_heads / t
    if not moe_layer:
        return saving + column_input + less * s * b * config.ffn_hidden_size / t
    tokens = s * b / (t if shape.sequence_parallel else 1)
    m = shape.etp * assignments(config, tokens)
    saving += less * m * (h + expert_ffn(config) / shape.etp)
    shared = config.moe.moe_shared_expert_intermediate_size or 0
    if shared:
        saving += less * s * b * shared / t - s * b * h / sp
    return saving


def _gathers_fp8(config: TransformerConfig) -> bool:
    fp8 = config.fp8
    return fp8 is not None and fp8.fp8_param_gather and fp8.fp8_recipe in GATHERED_RECIPES


def fp8_gathered_parameters(config: TransformerConfig, *, pp_rank: int) -> float:
    """Elements on one rank of pipeline stage ``pp_rank``, outside the routed experts, that ``--fp8-param-gather``
    all-gathers as 1-byte FP8 at ZeRO 1-3 (``distributed.fp8_param_gather``): the linear weights of the stage's
    FP8 layers (attention's QKV and projection or MLA's projections, the dense MLP's fc1 and fc2, an MoE layer's
    shared expert); not norms, biases, the router, embeddings or the output layer. Per-tensor recipes and
    blockwise (``fp8.param_gather.GATHERED_RECIPES``); 0 for mxfp8. The routed experts:
    ``fp8_gathered_expert_parameters``."""
    if not _gathers_fp8(config):
        return 0.0
    dense, moe = fp8_layers_on_stage(config, pp_rank=pp_rank)
    tp, h = config.tensor_model_parallel_size or 1, config.hidden_size
    gates = 2 if config.gated_activation else 1
    if config.multi_latent_attention:
        from megatron_core.planning.parameters import mla_parameters
        partitioned, replicated = mla_parameters(config)
        norms = (config.kv_lora_rank + (config.q_lora_rank or 0)) if config.qk_layernorm else 0
        attention = partitioned / tp + replicated - norms
    else:
        qkv = config.kv_channels * (config.num_attention_heads + 2 * config.num_query_groups)
        attention = (qkv + config.kv_channels * config.num_attention_heads) * h / tp
    mlp = (gates + 1) * config.ffn_hidden_size * h / tp
    shared = (gates + 1) * (config.moe.moe_shared_expert_intermediate_size or 0) * h / tp if moe else 0.0
    return dense * (attention + mlp) + moe * (attention + shared)


def fp8_gathered_expert_parameters(config: TransformerConfig, *, pp_rank: int, ep: int = 1, etp: int = 1) -> float:
    """Elements of the routed experts on one rank of stage ``pp_rank`` that ``--fp8-param-gather`` all-gathers as
    1 byte (over the expert-dp group): every local expert's fc1 and fc2 weight (``E / ep`` experts, ``1 / etp``
    of each) in the stage's FP8 MoE layers; not their biases."""
    if not _gathers_fp8(config) or config.moe is None:
        return 0.0
    _, moe = fp8_layers_on_stage(config, pp_rank=pp_rank)
    gates = 2 if config.gated_activation else 1
    per_expert = (gates + 1) * expert_ffn(config) * config.hidden_size / etp
    return moe * config.moe.num_moe_experts // ep * per_expert


__all__ = ["gathers_fp8_inputs", "saves_fp8_inputs", "fp8_layers_on_stage", "fp8_layer_saving",
           "fp8_gathered_parameters", "fp8_gathered_expert_parameters"]
