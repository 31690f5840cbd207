"""``MoELayer``: the mixture-of-experts MLP (Mixtral / DeepSeek style), and the layer spec that swaps it in.

    router -> dispatch (ep all-to-all or all-gather) -> local experts -> combine -> (+ shared experts)

Use it through the spec: ``GPTModel(config, ..., layer_spec=moe_layer_spec())`` with ``config.moe`` set;
``moe_layer_freq`` decides which layers are MoE (the others keep the dense ``MLP``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.transformer.mlp import MLP
from megatron_core.transformer.moe.dispatcher import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    BalancedRouting,
    CommStats,
    gather_routed_tokens,
    reduce_scatter_tokens,
)
from megatron_core.transformer.moe.experts import LocalExperts
from megatron_core.transformer.moe.router import TopKRouter
from megatron_core.transformer.spec import TransformerLayerSpec


def check_moe_layout(config: TransformerConfig, state: ParallelState) -> None:
    """ValueError naming the values when the MoE settings do not fit the layout."""
    experts, ep, etp = config.moe.num_moe_experts, state.ep_size, state.etp_size
    if experts % ep != 0:
        raise ValueError(f"num_moe_experts {experts} is not divisible by expert_model_parallel_size {ep}: every ep "
                         "rank holds the same number of experts; change --num-experts or "
                         "--expert-model-parallel-size")
    ffn = config.moe.moe_ffn_hidden_size or config.ffn_hidden_size
    if ffn % etp != 0:
        raise ValueError(f"the expert hidden size {ffn} (moe_ffn_hidden_size, default ffn_hidden_size) is not "
                         f"divisible by expert_tensor_parallel_size {etp}: each etp rank holds ffn / etp of every "
                         "expert; change --moe-ffn-hidden-size or --expert-tensor-parallel-size")


def check_replicated_tokens(module: nn.Module, *, tp: int, sequence_parallel: bool) -> None:
    """At tp > 1 without sequence parallelism every tp rank holds (and routes) the whole sequence: the forward
    is exact (each rank gets every token's output; the ep all-to-all carries each copy), so inference runs
    there (decoding one token cannot be split over tp), but an expert would see each token tp times in
    backward. ValueError when such a layer is run with gradients in training mode."""
    if tp > 1 and not sequence_parallel and module.training and torch.is_grad_enabled():
        raise ValueError(f"MoE layers with tensor_model_parallel_size {tp} need sequence_parallel=True to train "
                         "(as Megatron-LM): each tp rank routes its own chunk of the sequence; add "
                         "--sequence-parallel (without it they run forward-only, in eval mode or no_grad)")


class MoELayer(nn.Module):
    """Routed experts (``num_moe_experts / ep`` on this rank) plus optional shared experts.

    Args:
        config: the model's config; ``config.moe`` the MoE settings.
        layer_number: global, 1-based.
        parallel_state: the layout (``ep_group`` for dispatch, ``etp_group`` for the split experts, ``tp_group``
            for the shared experts).

    forward: hidden ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> ``(output, None)`` of the
    same shape. At tp > 1 without sequence parallelism (inference only: ``check_replicated_tokens``) every tp
    rank routes the whole sequence. Collectives: the dispatcher's over ep (see ``dispatcher``), the shared
    experts' over tp (as the dense MLP), and the router's count all-reduce over tp with sequence parallelism.
    With expert tensor parallelism (``etp_size`` > 1, any size: the etp group need not be the tp group) the
    routed tokens ``[T, h]``, probs and map ``[T, E]`` are all-gathered over the etp group before dispatch
    (``[etp T, .]``: every etp rank runs its ``f / etp`` part of each local expert on the tokens of the whole etp
    group) and the experts' partial outputs ``[etp T, h]`` reduce-scattered over it after combine (backward:
    reduce-scatter of the token and prob grads, all-gather of the output grad). Every rank of an etp group then
    holds the same tokens, so the ep all-to-all (ep groups stride etp) sends each expert shard the same ones.

    Initialization is layout-independent: the router first, then one seed per global expert (all of them,
    on every rank), then the shared experts, all from the layer's seeded generator.
    """

    recompute_module = "moe"  # selective recompute: --recompute-modules moe (Megatron-LM), "mlp" is the dense MLP

    def __init__(self, config: TransformerConfig, *, layer_number: int, parallel_state: ParallelState) -> None:
        super().__init__()
        check_moe_layout(config, parallel_state)
        moe = config.moe
        self.layer_number, self.moe = layer_number, moe
        self.tp_size, self.sequence_parallel = parallel_state.tp_size, config.sequence_parallel
        self.router = TopKRouter(config, parallel_state=parallel_state, layer_number=layer_number)
        seeds = [int(s) for s in torch.randint(0, 2 ** 31 - 1, (moe.num_moe_experts,))]
        local = moe.num_moe_experts // parallel_state.ep_size
        first = parallel_state.ep_rank * local
        etp = parallel_state.etp_size
        self.etp_group = parallel_state.etp_group if etp > 1 else None
        self.experts = LocalExperts(config, expert_ids=range(first, first + local), expert_seeds=seeds,
                                    device=parallel_state.device, etp_rank=parallel_state.etp_rank if etp > 1 else 0,
                                    etp_size=etp, etp_group=self.etp_group, layer_number=layer_number)
        self.shared_experts: Optional[MLP] = None
        if moe.moe_shared_expert_intermediate_size:
            shared = dataclasses.replace(config, ffn_hidden_size=moe.moe_shared_expert_intermediate_size, moe=None)
            self.shared_experts = MLP(shared, layer_number=layer_number, parallel_state=parallel_state)
        self.comm_stats = CommStats()
        dispatcher = AllToAllDispatcher if moe.moe_token_dispatcher_type == "alltoall" else AllGatherDispatcher
        balanced = BalancedRouting(topk=moe.moe_router_topk, capacity=moe.capacity,
                                   pad_to_capacity=moe.moe_pad_expert_input_to_capacity)  # dry runs only
        self.dispatcher = dispatcher(num_experts=moe.num_moe_experts, ep_group=parallel_state.ep_group,
                                     stats=self.comm_stats, balanced=balanced)

    def forward(self, hidden: torch.Tensor):
        check_replicated_tokens(self, tp=self.tp_size, sequence_parallel=self.sequence_parallel)
        probs, routing_map = self.router(hidden)                                  # [T, E] each
        tokens = hidden.reshape(-1, hidden.shape[-1])                             # [T, h]
        if self.etp_group is not None:  # every etp rank computes its part of each expert on all their tokens
            tokens, probs, routing_map = gather_routed_tokens(tokens, probs, routing_map, self.etp_group,
                                                              self.comm_stats)     # [etp T, .]
        expert_input, counts, handle = self.dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(expert_input, counts)                         # [N, h] (etp: partial)
        output = self.dispatcher.combine(expert_output, handle)                    # [T or etp T, h]
        if self.etp_group is not None:
            output = reduce_scatter_tokens(output, self.etp_group, self.comm_stats)  # [T, h]: summed over etp
        output = output.view_as(hidden)                                            # [s, b, h]
        if self.shared_experts is not None:
            shared, bias = self.shared_experts(hidden)
            output = output + (shared if bias is None else shared + bias)
        return output, None


def moe_or_dense_mlp(config: TransformerConfig, *, layer_number: int, parallel_state: ParallelState) -> nn.Module:
    """The spec's ``mlp``: an ``MoELayer`` where ``config.moe.moe_layer_freq`` says so, else the dense MLP."""
    if config.moe is not None and config.moe.is_moe_layer(layer_number, config.num_layers):
        return MoELayer(config, layer_number=layer_number, parallel_state=parallel_state)
    return MLP(config, layer_number=layer_number, parallel_state=parallel_state)


def moe_layer_spec(base: Optional[TransformerLayerSpec] = None) -> TransformerLayerSpec:
    """``base`` (default the GPT spec) with its MLP replaced by ``moe_or_dense_mlp``."""
    return dataclasses.replace(base or TransformerLayerSpec(), mlp=moe_or_dense_mlp)
