"""Parameters on one rank of a pipeline stage: each transformer layer's tp-partitioned and replicated
elements (standard or multi-latent attention, dense MLP), the MoE router and shared expert instead of the dense
MLP, the routed experts over ep x etp, the MTP depths, and the embedding / output layer on the first / last
stage (the tied copy counted on both at pp > 1)."""
from __future__ import annotations

from megatron_core.config import TransformerConfig
from megatron_core.planning.moe import (
    dense_mlp_parameters,
    expert_parameters_per_rank,
    moe_dense_parameters,
    moe_layers_on_stage,
    stage_layer_count,
)
from megatron_core.tensor_parallel.utils import vocab_size_with_padding


def mla_parameters(config: TransformerConfig) -> tuple[float, float]:
    """(partitioned over heads, replicated) parameters of multi-latent attention: the up projections and
    ``linear_proj`` are split over tp, the down projections and their norms are on every rank."""
    h, heads, rank = config.hidden_size, config.num_attention_heads, config.q_lora_rank
    q_dim = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    norms = config.qk_layernorm
    partitioned = (h * q_dim if rank is None else rank * q_dim) + config.kv_lora_rank * heads * (
        config.qk_head_dim + config.v_head_dim) + heads * config.v_head_dim * h
    replicated = h * (config.kv_lora_rank + config.qk_pos_emb_head_dim) + (config.kv_lora_rank if norms else 0)
    if rank is not None:
        replicated += h * rank + (rank if norms else 0)
    return partitioned, replicated


def _layer_params(config: TransformerConfig, tp: int) -> tuple[float, float]:
    """(tp-partitioned, replicated) parameters of one transformer layer on one tp rank."""
    gated = config.activation in ("swiglu", "quick_geglu")
    h, ffn = config.hidden_size, config.ffn_hidden_size * (2 if gated else 1)
    norm = h * (2 if config.normalization == "LayerNorm" else 1)
    replicated = 2 * norm + (2 * h if config.add_bias_linear else 0)
    if config.multi_latent_attention:
        partitioned, mla_replicated = mla_parameters(config)
        replicated += mla_replicated
    else:
        qkv = config.kv_channels * (config.num_attention_heads + 2 * config.num_query_groups)
        q_dim = config.kv_channels * config.num_attention_heads
        partitioned = qkv * h + h * q_dim + (qkv if config.add_qkv_bias else 0)
    partitioned += ffn * h + h * config.ffn_hidden_size + (ffn if config.add_bias_linear else 0)
    if config.softmax_type == "learnable":
        partitioned += config.num_attention_heads
    return partitioned / tp, replicated


def stage_parameters(config: TransformerConfig, workload, *, pp_rank: int) -> tuple[float, float]:
    """(parameters, of which keep full grads at ZeRO 2-3) on one rank of pipeline stage ``pp_rank``:
    the tied embedding copy on the first and last stage (pp > 1) and sequence-parallel norms/biases."""
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    h = config.hidden_size
    padded = vocab_size_with_padding(workload.vocab_size,
                                     make_vocab_size_divisible_by=workload.make_vocab_size_divisible_by,
                                     tensor_model_parallel_size=tp)
    partitioned, replicated = _layer_params(config, tp)
    layers = stage_layer_count(config, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    layers += (config.mtp_num_layers or 0) if last else 0  # each MTP depth holds one layer (its MLP: see moe)
    params = layers * (partitioned + replicated)
    full_grad = layers * replicated if config.sequence_parallel else 0.0
    moe_layers = moe_layers_on_stage(config, pp_rank=pp_rank)
    if moe_layers:  # the router and shared expert instead of the dense MLP; the experts: stage_expert_parameters
        dense_part, dense_rep = dense_mlp_parameters(config, tp=tp)
        moe_part, moe_rep, moe_full = moe_dense_parameters(config, tp=tp)
        params += moe_layers * (moe_part + moe_rep - dense_part - dense_rep)
        full_grad += moe_layers * (moe_rep - dense_rep if config.sequence_parallel else moe_full)
    tied = not config.untie_embeddings_and_output_weights
    if last and config.mtp_num_layers:  # enorm, hnorm, final_layernorm and eh_proj [2h -> h] per depth, and the
        norm = h * (2 if config.normalization == "LayerNorm" else 1)  # word embedding's copy (untied, pp > 1)
        params += config.mtp_num_layers * (3 * norm + 2 * h * h / tp)
        full_grad += config.mtp_num_layers * 3 * norm if config.sequence_parallel else 0
        if not tied and not first:
            params += padded * h / tp
            full_grad += padded * h / tp
    if first:
        params += padded * h / tp
        params += h * config.max_position_embeddings if config.position_embedding_type == "learned_absolute" else 0
        full_grad += padded * h / tp if tied and pp > 1 else 0
    if last:
        norm = h * (2 if config.normalization == "LayerNorm" else 1)
        params += norm + (padded * h / tp if (not tied or not first) else 0)
        full_grad += (norm if config.sequence_parallel else 0) + (padded * h / tp if tied and not first else 0)
    return params, full_grad


def stage_expert_parameters(config: TransformerConfig, *, pp_rank: int, ep: int, etp: int = 1) -> float:
    """Routed-expert elements on one rank of pipeline stage ``pp_rank`` (``E / ep`` per MoE layer, 1/etp of
    each)."""
    layers = moe_layers_on_stage(config, pp_rank=pp_rank)
    return layers * expert_parameters_per_rank(config, ep=ep, etp=etp) if layers else 0.0


__all__ = ["stage_parameters", "stage_expert_parameters", "mla_parameters"]
