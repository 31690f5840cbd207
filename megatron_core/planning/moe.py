"""What the planner adds for mixture-of-experts layers (``config.moe``) at expert-parallel size ``ep``.

An MoE layer replaces the dense MLP by (``megatron_core.transformer.moe``):

- the router ``[E, h]``, replicated on every rank (with sequence parallelism its grad is partial per tp rank
  and stays full at ZeRO 2-3, like the norms);
- ``E / ep`` routed experts per rank, each ``fc1 [f' x h]`` (f' = 2 f for SwiGLU) and ``fc2 [h x f]``, f =
  ``moe_ffn_hidden_size``, never split over tp; replicated over the expert-data-parallel group of
  ``tp x cp x dp / ep`` ranks, so their grads are reduced and their ZeRO shards cut over that group;
- the optional shared expert: a dense tensor-parallel MLP of width ``moe_shared_expert_intermediate_size``.

Activations per MoE layer and micro-batch, per rank, with T = ``s / cp * b`` tokens (over tp with sequence
parallelism) and M = ``T * topk`` (token, expert) assignments, fewer with a capacity factor (``E * C`` with
padding): the router's scores and top-k probabilities, the permuted expert inputs and outputs ``[M, h]``
(the all-to-all's received and returned buffers, which the experts and the combine save) and the expert MLP's
``[M, f']``, ``[M, f]`` activations, assuming balanced routing (an ep rank receives M of the group's
assignments on average). Step time: the dispatcher's ep traffic (``ep_comm_bytes``) and the expert-dp
reduction of the expert grads.
"""
from __future__ import annotations

import math

from megatron_core.config import TransformerConfig


def stage_layer_count(config: TransformerConfig, pp_rank: int) -> int:
    """Transformer layers pipeline rank ``pp_rank`` holds over its model chunks (even, uneven or a layout)."""
    vpp = config.virtual_pipeline_model_parallel_size
    return sum(config.pipeline_layer_range(pp_rank, vp if vpp else None)[1] for vp in range(vpp or 1))


def moe_layers_on_stage(config: TransformerConfig, *, pp_rank: int) -> int:
    """MoE layers held by pipeline rank ``pp_rank`` (every model chunk), by ``moe_layer_freq``."""
    if config.moe is None:
        return 0
    count = 0
    for vp in range(config.virtual_pipeline_model_parallel_size or 1):
        offset, layers = config.pipeline_layer_range(pp_rank,
                                                     vp if config.virtual_pipeline_model_parallel_size else None)
        count += sum(config.moe.is_moe_layer(n, config.num_layers) for n in range(offset + 1, offset + layers + 1))
    if pp_rank == (config.pipeline_model_parallel_size or 1) - 1 and mtp_layers_are_moe(config):
        count += config.mtp_num_layers  # the MTP depths' layers copy the last decoder layer's MLP
    return count


def mtp_layers_are_moe(config: TransformerConfig) -> bool:
    """Whether the multi-token-prediction layers are MoE layers (as the model's last layer, models/mtp.py)."""
    return bool(config.mtp_num_layers) and config.moe is not None and config.moe.is_moe_layer(
        config.num_layers, config.num_layers)


def expert_ffn(config: TransformerConfig) -> int:
    return config.moe.moe_ffn_hidden_size or config.ffn_hidden_size


def _gated(config: TransformerConfig) -> int:
    return 2 if config.gated_activation else 1


def expert_parameters_per_rank(config: TransformerConfig, *, ep: int, etp: int = 1) -> float:
    """Elements of one MoE layer's routed experts on one rank (``E / ep`` experts, biases included; with
    expert tensor parallelism 1/etp of fc1 and fc2, the fc2 bias whole)."""
    h, f = config.hidden_size, expert_ffn(config)
    one = (_gated(config) * f * h + h * f) / etp + ((_gated(config) * f / etp + h) if config.add_bias_linear else 0)
    return config.moe.num_moe_experts // ep * one


def moe_dense_parameters(config: TransformerConfig, *, tp: int) -> tuple[float, float, float]:
    """``(tp-partitioned, replicated, of which full grads at ZeRO 2-3)`` elements on one tp rank of one MoE
    layer outside the routed experts: the router (replicated; full grads with SP) and the shared expert."""
    h = config.hidden_size
    router = config.moe.num_moe_experts * h
    shared = config.moe.moe_shared_expert_intermediate_size or 0
    partitioned = (_gated(config) * shared * h + h * shared
                   + (_gated(config) * shared if config.add_bias_linear else 0)) / tp
    replicated = router + (h if shared and config.add_bias_linear else 0)
    return partitioned, replicated, router if config.sequence_parallel else 0.0


def dense_mlp_parameters(config: TransformerConfig, *, tp: int) -> tuple[float, float]:
    """``(tp-partitioned, replicated)`` elements of the dense MLP an MoE layer replaces."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    partitioned = (_gated(config) * ffn * h + h * ffn + (_gated(config) * ffn if config.add_bias_linear else 0)) / tp
    return partitioned, (h if config.add_bias_linear else 0)


def assignments(config: TransformerConfig, tokens: float) -> float:
    """(token, expert) pairs the experts process for ``tokens`` routed tokens (dropless: ``tokens * topk``)."""
    moe = config.moe
    routed = tokens * moe.moe_router_topk
    if moe.moe_expert_capacity_factor is None:
        return routed
    capacity = math.ceil(tokens * moe.moe_router_topk / moe.num_moe_experts * moe.moe_expert_capacity_factor)
    total = moe.num_moe_experts * capacity
    return total if moe.moe_pad_expert_input_to_capacity else min(routed, total)


def moe_mlp_activation_bytes(config: TransformerConfig, *, tokens: float, element_bytes: int, ep: int,
                             tp: int, sequence_tokens: float, etp: int = 1) -> float:
    """Bytes one MoE MLP saves for backward on one rank (router, dispatch, experts, shared expert).

    ``tokens``: T routed on this rank; ``sequence_tokens``: ``s / cp * b`` (the shared expert's input is
    tp-partitioned like the dense MLP's). With expert tensor parallelism the experts run on the etp group's
    ``etp x`` assignments, with ``f / etp`` of their hidden width."""
    moe, e, h = config.moe, element_bytes, config.hidden_size
    E, k, f = moe.num_moe_experts, moe.moe_router_topk, expert_ffn(config)
    r = {"fp32": 4, "fp64": 8}.get(moe.moe_router_dtype, e)
    router = r * tokens * k + 8 * tokens * k + tokens * E     # top-k probs, their indices, the routing map
    router += r * tokens * h if r != e else 0                  # the router's input cast to its dtype
    if moe.has_aux_loss or moe.moe_router_pre_softmax or moe.moe_router_score_function == "sigmoid":
        router += r * tokens * E                                # the scores over all experts
    if moe.moe_z_loss_coeff:
        router += r * tokens * E                                # the logits (logsumexp)
    m = etp * assignments(config, tokens)
    experts = e * m * h                                         # expert input (received from the all-to-all)
    experts += e * m * f / etp * (4 if config.gated_activation else 2)  # fc1 output, activation output
    experts += etp * tokens * E if etp > 1 else 0               # the routing map gathered over etp
    experts += e * m * h + e * m + 8 * m                        # expert output (all-to-all back), probs, index
    if moe.moe_token_dispatcher_type == "allgather" and ep > 1:
        experts += ep * etp * tokens * E                        # the gathered routing map
    if moe.moe_grouped_gemm:                                    # the stacked expert weights bmm saves
        experts += e * expert_parameters_per_rank(config, ep=ep, etp=etp)
    shared = moe.moe_shared_expert_intermediate_size or 0
    shared_bytes = e * sequence_tokens * shared * (4 if config.gated_activation else 2) / tp
    return router + experts + shared_bytes


def ep_comm_bytes(config: TransformerConfig, *, tokens: float, element_bytes: int, ep: int,
                  recompute_full: bool) -> float:
    # (with expert tensor parallelism pass the etp group's tokens, etp x T; ``etp_comm_bytes`` adds the rest)
    """Bytes one rank sends over ep in one micro-batch's forward and backward of one MoE layer.

    alltoall: the M assignments' hidden states out and back in forward, their grads in backward, each
    ``(ep - 1) / ep`` of them to other ranks; allgather: the T tokens (and their ``[T, E]`` probabilities)
    all-gathered and the ``[ep T, h]`` outputs reduce-scattered in forward, the reverse in backward. Full
    recompute runs the forward's traffic again."""
    if ep == 1:
        return 0.0
    e, h, E = element_bytes, config.hidden_size, config.moe.num_moe_experts
    if config.moe.moe_token_dispatcher_type == "alltoall":
        forward = 2 * (ep - 1) / ep * e * assignments(config, tokens) * h
    else:
        forward = (ep - 1) * e * tokens * (2 * h + E)
    return (2 + (1 if recompute_full else 0)) * forward


def etp_comm_bytes(config: TransformerConfig, *, tokens: float, element_bytes: int, etp: int,
                   recompute_full: bool) -> float:
    """Bytes one rank sends over the etp group per micro-batch and MoE layer: the T tokens and their
    ``[T, E]`` probabilities all-gathered and the ``[etp T, h]`` partial outputs reduce-scattered in
    forward, the reverse in backward (full recompute: the forward's again)."""
    if etp == 1:
        return 0.0
    forward = (etp - 1) * element_bytes * tokens * (2 * config.hidden_size + config.moe.num_moe_experts)
    return (2 + (1 if recompute_full else 0)) * forward


def expert_units(config: TransformerConfig, *, tp: int, ep: int, etp: int = 1) -> tuple[list[float], float]:
    """ZeRO-3 units of one MoE layer outside attention: (elements of each weight unit, of its share of the
    layer's small unit). The router and the shared expert's fc1 / fc2 are units; ``LocalExperts`` is one unit
    holding every local expert (biases included)."""
    h = config.hidden_size
    units = [config.moe.num_moe_experts * h, expert_parameters_per_rank(config, ep=ep, etp=etp)]
    shared = config.moe.moe_shared_expert_intermediate_size or 0
    small = 0.0
    if shared:
        units += [_gated(config) * shared * h / tp, h * shared / tp]
        small = (_gated(config) * shared / tp + h) if config.add_bias_linear else 0.0
    return units, small


__all__ = ["assignments", "dense_mlp_parameters", "ep_comm_bytes", "etp_comm_bytes", "expert_parameters_per_rank",
           "expert_units",
           "moe_dense_parameters", "moe_layers_on_stage", "moe_mlp_activation_bytes"]
