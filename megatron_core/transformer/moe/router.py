"""``TopKRouter``: a linear gate over the experts, top-k selection, load-balancing and z losses, capacity.

Per rank, with T = s_local * b tokens of this rank (s_local = s / tp under sequence parallelism):
logits ``[T, E]`` = ``x W^T`` with W ``[E, h]`` replicated over every rank; the result is dense ``probs``
``[T, E]`` (zero where a token is not routed) and the bool ``routing_map`` ``[T, E]``.

Scores (Megatron-LM's ``topk_routing_with_score_function``):
- softmax: top-k of the logits, then softmax over the k chosen (``pre_softmax``: softmax over all experts,
  then top-k of the probabilities);
- sigmoid: ``sigmoid(logits)``, top-k (of ``scores + expert_bias`` with the aux-loss-free bias), the k chosen
  scores normalized to sum 1 when k > 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import init_method_normal, set_tensor_model_parallel_attributes
from megatron_core.tensor_parallel.initialization import InitRecipe, init_method_constant, init_param_
from megatron_core.transformer.moe.config import MoEConfig
from megatron_core.transformer.moe.losses import (
    GlobalCounts,
    attach_loss,
    global_aux_loss,
    sequence_aux_loss,
    switch_aux_loss,
    z_loss,
)


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, *, capacity: int, policy: str,
                   pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps at most ``capacity`` tokens per expert (``[T, E]`` in, ``[T, E]`` out).

    ``policy`` "probs" keeps each expert's tokens with the highest probabilities, "position" the earliest.
    ``pad``: every expert gets exactly ``capacity`` tokens, tokens not routed to it filling the rest with
    probability 0 (they cost compute, change nothing). With ``capacity >= T`` nothing is dropped (and padding
    sends every token to every expert), as in Megatron-LM.
    """
    num_tokens = probs.shape[0]
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if policy == "probs":
            rank_by = probs.detach()
        else:  # routed tokens first, each group in position order
            position = torch.arange(num_tokens, device=probs.device, dtype=torch.float32)[:, None] / num_tokens
            rank_by = routing_map.float() * 2.0 - position
        index = torch.topk(rank_by, k=capacity, dim=0, sorted=False).indices  # [C, E]
        keep = torch.zeros_like(routing_map).scatter(0, index, True)
    final_map = keep if pad else routing_map & keep
    return probs * final_map, final_map


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` ``[T, E]`` (fp32): rows and columns rescaled in turn until the
    column scales move less than ``tol`` (Megatron-LM's ``moe_utils.sinkhorn``, step for step)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


class _RandomLogits(torch.autograd.Function):
    """Random normal logits of the input's shape; backward passes the gradient through (Megatron's RandomSTE)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def group_limited_topk(scores: torch.Tensor, topk: int, *, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``scores`` ``[T, E]`` among the experts of each token's ``group_topk`` best groups (E split into
    ``num_groups`` groups of consecutive ids, a group scored by the sum of its top ``topk // group_topk``
    scores; Megatron-LM's ``group_limited_topk``, DeepSeek-V3's node-limited routing). Returns
    ``(values [T, k], index [T, k])``; the other groups' experts are masked with -inf."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)        # [T, groups]
    chosen_groups = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=topk, dim=-1)


def _gather_rows(x: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """``(rows of every rank of group, concatenated; this rank's first row)`` (no gradient)."""
    if group is None:
        return x, 0
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts), dist.get_group_rank(group, dist.get_rank()) * x.shape[0]


def token_split_group(state: ParallelState, *, sequence_parallel: bool):
    """The ranks whose tokens together form the micro-batch's sequences: tp x cp with sequence parallelism
    (each tp rank a chunk of each cp rank's part), cp without (tp ranks then hold the same tokens); None when
    the sequence is not split."""
    if sequence_parallel and state.tp_size * state.cp_size > 1:
        return state.tp_cp_group if state.cp_size > 1 else state.tp_group
    return state.cp_group if state.cp_size > 1 else None


class TopKRouter(nn.Module):
    """Routes each token to ``moe_router_topk`` of ``num_moe_experts`` experts.

    Args:
        config: the model's config (hidden size, init std, dtype, sequence parallelism); ``config.moe`` holds
            the routing settings.
        parallel_state: the layout; the aux losses count tokens over the ranks splitting the sequence
            (``token_split_group``: tp x cp with sequence parallelism, cp without).

    forward: hidden ``[s_local, b, h]`` -> ``(probs [T, E], routing_map [T, E])``, T = s_local * b.
    Collectives: with sequence parallelism or context parallelism, an all-reduce (no gradient) of the expert
    counts for the aux loss over ``token_split_group`` (tp x cp, Megatron's ``tp_cp_group``). The weight's
    grad is partial per tp rank then (tagged ``sequence_parallel``) and per cp rank (summed by the dp x cp
    gradient reduction, whose 1/cp the aux loss scale undoes as the lm loss does).

    The aux and z losses enter backward through ``attach_loss`` with ``aux_loss_scale`` (set it to the
    schedule's loss scale, ``1 / num_microbatches`` times the fp16 scale; default 1). ``loss_sums`` holds,
    per training forward, this rank's partial losses divided by their coefficients (for logging).
    """

    def __init__(self, config: TransformerConfig, *, parallel_state: ParallelState, layer_number: int = 1) -> None:
        super().__init__()
        moe: MoEConfig = config.moe
        self.layer_number, self.num_layers = layer_number, config.num_layers
        self.moe, self.topk, self.num_experts = moe, moe.moe_router_topk, moe.num_moe_experts
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype,
                                               device=parallel_state.device))
        init_param_(self.weight, (self.num_experts, config.hidden_size),
                    init_method=init_method_normal(config.init_method_std))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=False, dim=-1, stride=1)
        self.weight.sequence_parallel = config.sequence_parallel
        self.bias = None
        if config.add_bias_linear:  # Megatron-LM's router bias (gpt-oss has one); zero-initialized like our biases
            self.bias = nn.Parameter(torch.zeros(self.num_experts, dtype=config.params_dtype,
                                                 device=parallel_state.device))
            self.bias.init_recipe = InitRecipe(0, init_method_constant(0.0), (self.num_experts,), -1, 1, 0, 1)
            set_tensor_model_parallel_attributes(self.bias, is_parallel=False, dim=-1, stride=1)
            self.bias.sequence_parallel = config.sequence_parallel
        self.rng_tracker = parallel_state.rng_tracker
        self.dp_group = parallel_state.dp_group if parallel_state.dp_size > 1 else None  # global_aux_loss
        self.global_counts = GlobalCounts()
        self.split_group = token_split_group(parallel_state, sequence_parallel=config.sequence_parallel)
        self.aux_loss_scale = 1.0
        self.loss_sums: dict[str, torch.Tensor] = {}
        self.loss_count = 0
        if moe.moe_router_enable_expert_bias:
            device = parallel_state.device if parallel_state.device.type != "meta" else None
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32, device=device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32,
                                                                        device=device), persistent=False)
        else:
            self.expert_bias = None

    def _record(self, name: str, loss: torch.Tensor, coeff: float) -> None:
        value = loss.detach().float() / coeff
        self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value

    def _sinkhorn_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Megatron-LM's sinkhorn routing: in training the experts are chosen by top-k of the Sinkhorn-balanced
        logits (no gradient), weighted by the softmax (sigmoid for top-1) of the raw ones; in eval by top-k of
        those. The balancing runs over the micro-batch's tokens on every rank that splits them (all-gathered over
        ``token_split_group``; Megatron balances each rank's chunk alone), so every layout routes alike."""
        activated = torch.sigmoid(logits) if self.topk == 1 else torch.softmax(logits.float(), -1).type_as(logits)
        if self.training:
            with torch.no_grad():
                every, first = _gather_rows(logits.float(), self.split_group)
                balanced = sinkhorn(every)[first:first + logits.shape[0]]
                index = torch.topk(balanced, self.topk, dim=-1).indices
        else:
            index = torch.topk(activated, self.topk, dim=-1).indices
        return activated.gather(1, index), index, activated

    def _select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, index)`` of the top-k of ``scores`` ``[T, E]``, group-limited when configured."""
        if self.moe.moe_router_num_groups:
            return group_limited_topk(scores, self.topk, num_groups=self.moe.moe_router_num_groups,
                                      group_topk=self.moe.moe_router_group_topk)
        return torch.topk(scores, self.topk, dim=-1)

    def _topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(topk_probs [T, k], topk_index [T, k], scores_for_aux [T, E])``."""
        if self.moe.moe_router_load_balancing_type == "sinkhorn":
            return self._sinkhorn_topk(logits)
        chosen, index, for_aux = self._score_and_select(logits)
        if self.moe.moe_router_topk_scaling_factor:
            chosen = chosen * self.moe.moe_router_topk_scaling_factor
        return chosen, index, for_aux

    def _score_and_select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.moe.moe_router_score_function == "softmax":
            all_probs = torch.softmax(logits, dim=-1)
            if self.moe.moe_router_pre_softmax:
                chosen, index = self._select(all_probs)
            else:
                chosen, index = self._select(logits)
                chosen = torch.softmax(chosen, dim=-1)
            return chosen, index, all_probs
        scores = torch.sigmoid(logits)
        if self.expert_bias is not None:
            index = self._select(scores.detach() + self.expert_bias.to(scores.dtype))[1]
            chosen = scores.gather(1, index)
        else:
            chosen, index = self._select(scores)
        if self.topk > 1:
            chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, index, scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    def _aux_loss(self, scores: torch.Tensor, routing_map: torch.Tensor, batch_size: int) -> torch.Tensor:
        coeff = self.moe.moe_aux_loss_coeff
        if self.moe.moe_router_load_balancing_type == "seq_aux_loss":
            return sequence_aux_loss(scores, routing_map, batch_size=batch_size, topk=self.topk, coeff=coeff,
                                     split_group=self.split_group)
        if self.moe.moe_router_load_balancing_type == "global_aux_loss":
            counts = self.global_counts if self.training and not self.rng_tracker.recomputing else GlobalCounts()
            return global_aux_loss(scores, routing_map, topk=self.topk, coeff=coeff, split_group=self.split_group,
                                   dp_group=self.dp_group, running=counts)
        return switch_aux_loss(scores, routing_map, topk=self.topk, coeff=coeff, split_group=self.split_group)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq, batch, width = hidden.shape
        dtype = self.moe.router_dtype or hidden.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        logits = F.linear(hidden.reshape(seq * batch, width).to(dtype), self.weight.to(dtype), bias)  # [T, E]
        if self.moe.moe_router_force_load_balancing:
            with self.rng_tracker.fork():
                logits = _RandomLogits.apply(logits)
        training = self.training and torch.is_grad_enabled() and not self.rng_tracker.recomputing  # once a step
        z_coeff = self.moe.moe_z_loss_coeff or 0.0
        if z_coeff > 0:
            loss = z_loss(logits, coeff=z_coeff, split_group=self.split_group)
            logits = attach_loss(logits, loss, scale=self.aux_loss_scale)
            if training:
                self._record("z_loss", loss, z_coeff)
        chosen, index, scores = self._topk(logits)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)   # [T, E]
        probs = torch.zeros_like(logits).scatter(1, index, chosen)                         # [T, E]
        if self.moe.has_aux_loss:
            loss = self._aux_loss(scores, routing_map, batch)
            probs = attach_loss(probs, loss, scale=self.aux_loss_scale)
            if training:
                self._record("load_balancing_loss", loss, self.moe.moe_aux_loss_coeff)
        if training:
            self.loss_count += 1
        capacity = self.moe.capacity(seq * batch)
        if capacity is not None:
            probs, routing_map = apply_capacity(probs, routing_map, capacity=capacity,
                                                policy=self.moe.moe_token_drop_policy,
                                                pad=self.moe.moe_pad_expert_input_to_capacity)
        if self.expert_bias is not None and training:
            self.local_tokens_per_expert += routing_map.sum(dim=0).float()
        return probs, routing_map

    def reset_loss_sums(self) -> None:
        self.loss_sums, self.loss_count = {}, 0
