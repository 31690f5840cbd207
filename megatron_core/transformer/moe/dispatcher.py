"""Token dispatchers: move each (token, expert) assignment to the rank holding the expert and back.

Experts are laid out consecutively over the expert-parallel (ep) group: ep rank r holds global experts
``[r * E/ep, (r+1) * E/ep)``. Per rank: tokens ``[T, h]``, dense ``probs`` / ``routing_map`` ``[T, E]``;
``dispatch`` returns the tokens for the local experts ``[N, h]`` sorted by local expert with one count per
local expert, and ``combine`` turns the experts' output ``[N, h]`` back into ``[T, h]``: the sum over each
token's experts of ``prob * expert_output`` (probabilities are applied on the token's own rank).

Permutation is expert-major and stable in token order (Megatron-LM's ``permute``), so every layout sums a
token's expert outputs in the same order.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_core.tensor_parallel.mappings import all_to_all
from megatron_core.tensor_parallel.utils import group_rank, group_size
from megatron_core.utils.accelerator import holds_no_data


@dataclasses.dataclass
class CommStats:
    """Bytes this rank sent to other ranks by the dispatcher's collectives (forward and backward)."""

    bytes_sent: int = 0


@dataclasses.dataclass(frozen=True)
class BalancedRouting:
    """The routing a dispatcher assumes when the routing map holds no values (a dry run's fake tensors:
    shapes, no data), so that every count, split size and permutation it derives from routing has a size.

    Balanced routing, the state the load-balancing loss drives a run to: of ``rows`` token rows each expert
    receives ``rows * topk / E`` (the remainder one each to the first experts), capped at ``capacity(rows)``
    when a capacity factor is set, exactly ``capacity(rows)`` (at most ``rows``) when padded to capacity. Every
    rank of a group holds the same number of rows (training micro-batches have one shape), so what a rank
    receives equals what it sends. Real runs never consult it: their routing maps have values.

    Args:
        topk: experts per token (``moe_router_topk``).
        capacity: tokens per expert for a number of rows, or None when dropless (``MoEConfig.capacity``).
        pad_to_capacity: ``moe_pad_expert_input_to_capacity``.
    """

    topk: int
    capacity: Optional[Callable[[int], Optional[int]]] = None
    pad_to_capacity: bool = False

    def counts(self, rows: int, num_experts: int) -> list[int]:
        """Assignments per expert (all ``num_experts``) of ``rows`` token rows."""
        base, extra = divmod(rows * self.topk, num_experts)
        counts = [base + (e < extra) for e in range(num_experts)]
        cap = self.capacity(rows) if self.capacity is not None else None
        if cap is not None:
            counts = [min(cap, rows)] * num_experts if self.pad_to_capacity else [min(c, cap) for c in counts]
        return counts


def _assumed_counts(routing_map: torch.Tensor, balanced: Optional[BalancedRouting], *, num_experts: int,
                    first: int = 0) -> Optional[list[int]]:
    """None for a routing map with values (a real run); the balanced counts of its columns (global experts
    ``first, first + routing_map.shape[1]``) for one without (a dry run)."""
    if not holds_no_data(routing_map):
        return None
    if balanced is None:
        raise ValueError(f"the routing map {tuple(routing_map.shape)} holds no values (a dry run's fake tensors): "
                         "pass the dispatcher balanced=BalancedRouting(topk=...) to size its tokens per expert")
    return balanced.counts(routing_map.shape[0], num_experts)[first:first + routing_map.shape[1]]


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
            assumed_counts: Optional[list[int]] = None):
    """Expert-major copy of the routed tokens.

    ``tokens [T, h]``, ``routing_map [T, E]``, ``probs [T, E]`` -> ``(permuted [M, h], token_index [M],
    permuted_probs [M], counts [E])`` with M the number of assignments. No collective. ``assumed_counts``
    (a dry run, where the map has no values: ``BalancedRouting``) sizes M and the counts instead of the map;
    the tensors then have the shapes of such a routing, their values none.
    """
    num_tokens, num_experts = routing_map.shape
    if assumed_counts is not None:
        num_assigned = sum(assumed_counts)
        token_index = torch.arange(num_assigned, device=tokens.device) % num_tokens                # [M]
        counts = torch.tensor(assumed_counts, device=routing_map.device)
        return (tokens.index_select(0, token_index), token_index, probs.t().reshape(-1)[:num_assigned], counts)
    map_t = routing_map.t()                                                          # [E, T]
    token_index = torch.arange(num_tokens, device=tokens.device).expand(num_experts, -1).masked_select(map_t)
    return tokens.index_select(0, token_index), token_index, probs.t().masked_select(map_t), map_t.sum(dim=1)


def unpermute(expert_output: torch.Tensor, token_index: torch.Tensor, probs: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """``[M, h]`` in ``permute`` order -> ``[T, h]``: each token's outputs weighted by ``probs`` and summed."""
    weighted = expert_output * probs.to(expert_output.dtype)[:, None]
    out = expert_output.new_zeros(num_tokens, expert_output.shape[1])
    return out.index_add(0, token_index, weighted)


def _reorder(x: torch.Tensor, sizes: list[int], rows: int, cols: int) -> torch.Tensor:
    """Chunks of ``x`` laid out ``[rows, cols]`` (``sizes`` row-major) -> laid out ``[cols, rows]``."""
    chunks = x.split(sizes)
    return torch.cat([chunks[r * cols + c] for c in range(cols) for r in range(rows)])


@dataclasses.dataclass
class _Handle:
    token_index: torch.Tensor
    probs: torch.Tensor
    num_tokens: int
    input_splits: list[int] = dataclasses.field(default_factory=list)
    output_splits: list[int] = dataclasses.field(default_factory=list)
    recv_sizes: list[int] = dataclasses.field(default_factory=list)
    local_tokens: Optional[int] = None  # allgather: this rank's T before padding to the ep group's largest


class AllToAllDispatcher:
    """Permute, all-to-all with uneven splits, sort by local expert; combine reverses it.

    Collectives (over ``ep_group``): dispatch all-to-alls the per-expert counts (no gradient) and the tokens
    (backward: the reverse all-to-all of their gradient); combine all-to-alls the expert outputs back
    (backward: the reverse). Per rank: ``sum(counts sent) = M`` assignments out, N received.
    """

    def __init__(self, *, num_experts: int, ep_group: Optional[dist.ProcessGroup],
                 stats: Optional[CommStats] = None, balanced: Optional[BalancedRouting] = None) -> None:
        self.ep_group, self.ep = ep_group, group_size(ep_group)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep
        self.first = group_rank(ep_group) * self.num_local
        self.stats, self.balanced = stats, balanced

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """-> ``(expert_input [N, h], tokens_per_local_expert list, handle)``."""
        assumed = _assumed_counts(routing_map, self.balanced, num_experts=self.num_experts)
        permuted, token_index, permuted_probs, counts = permute(tokens, routing_map, probs, assumed)
        handle = _Handle(token_index, permuted_probs, tokens.shape[0])
        if self.ep == 1:
            return permuted, assumed or counts.tolist(), handle
        send = counts.view(self.ep, self.num_local)                                   # [ep, E_local]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.ep_group)          # [ep (source), E_local]
        if assumed is None:
            send_sizes, recv_sizes = send.tolist(), recv.tolist()                    # [ep][E_local] each
        else:  # balanced: every source sends this rank's experts what this rank sends them
            send_sizes = [assumed[r * self.num_local:(r + 1) * self.num_local] for r in range(self.ep)]
            recv_sizes = [assumed[self.first:self.first + self.num_local]] * self.ep
        handle.input_splits = [sum(row) for row in send_sizes]
        handle.output_splits = [sum(row) for row in recv_sizes]
        handle.recv_sizes = [n for row in recv_sizes for n in row]
        received = all_to_all(permuted, self.ep_group, output_split_sizes=handle.output_splits,
                              input_split_sizes=handle.input_splits, stats=self.stats)              # [N, h]
        expert_input = _reorder(received, handle.recv_sizes, self.ep, self.num_local)  # by (expert, source)
        return expert_input, [sum(column) for column in zip(*recv_sizes)], handle

    def combine(self, expert_output: torch.Tensor, handle: _Handle) -> torch.Tensor:
        if self.ep > 1:
            by_expert = [handle.recv_sizes[r * self.num_local + e] for e in range(self.num_local)
                         for r in range(self.ep)]
            by_source = _reorder(expert_output, by_expert, self.num_local, self.ep)
            expert_output = all_to_all(by_source, self.ep_group, output_split_sizes=handle.input_splits,
                                       input_split_sizes=handle.output_splits, stats=self.stats)   # [M, h]
        return unpermute(expert_output, handle.token_index, handle.probs, handle.num_tokens)


class _GatherFromEP(torch.autograd.Function):
    """All-gather along dim 0 over ep; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return _gather(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.stats), None, None


class _ReduceScatterToEP(torch.autograd.Function):
    """Reduce-scatter (sum) along dim 0 over ep; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return _reduce_scatter(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.stats), None, None


def _gather(x, group, stats):
    size = group_size(group)
    out = x.new_empty(size * x.shape[0], *x.shape[1:])
    dist.all_gather_single(out, x.contiguous(), group=group)
    if stats is not None:
        stats.bytes_sent += x.numel() * x.element_size() * (size - 1)
    return out


def _reduce_scatter(x, group, stats):
    size = group_size(group)
    out = x.new_empty(x.shape[0] // size, *x.shape[1:])
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    if stats is not None:
        stats.bytes_sent += out.numel() * out.element_size() * (size - 1)
    return out


def gather_routed_tokens(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                         group: Optional[dist.ProcessGroup], stats: Optional[CommStats] = None):
    """``[T, h]``, ``[T, E]``, ``[T, E]`` of every rank of ``group`` (same T on each) concatenated in rank
    order. Collectives: all-gathers (backward: reduce-scatter of the tokens' and probs' grads); the routing
    map has no gradient."""
    size = group_size(group)
    tokens = _GatherFromEP.apply(tokens, group, stats)                                  # [size T, h]
    probs = _GatherFromEP.apply(probs, group, stats)                                    # [size T, E]
    gathered_map = routing_map.new_empty(size * routing_map.shape[0], routing_map.shape[1], dtype=torch.uint8)
    dist.all_gather_single(gathered_map, routing_map.to(torch.uint8).contiguous(), group=group)
    return tokens, probs, gathered_map.bool()


def reduce_scatter_tokens(x: torch.Tensor, group: Optional[dist.ProcessGroup],
                          stats: Optional[CommStats] = None) -> torch.Tensor:
    """``[size T, h]`` partial sums -> this rank's ``[T, h]`` of their sum (backward: all-gather)."""
    return _ReduceScatterToEP.apply(x, group, stats)


class AllGatherDispatcher:
    """All-gather every ep rank's tokens, run the local experts on those routed to them, reduce-scatter.

    Collectives (over ``ep_group``): dispatch all-gathers tokens ``[T_max, h]``, probs ``[T_max, E]`` (backward:
    reduce-scatter of their gradients) and the routing map (no gradient); combine reduce-scatters the
    ``[ep * T_max, h]`` weighted outputs (backward: all-gather). Ranks may hold different token counts T:
    an all-reduce (max, no gradient) of T finds ``T_max``, every rank pads its tokens, probs and routing map
    with ``T_max - T`` rows routed nowhere (probability 0, so they get no expert and no gradient), and combine
    drops the padding rows of the reduce-scattered ``[T_max, h]``. A dry run (no values: ``balanced``) takes
    every rank's T as this rank's.
    """

    def __init__(self, *, num_experts: int, ep_group: Optional[dist.ProcessGroup],
                 stats: Optional[CommStats] = None, balanced: Optional[BalancedRouting] = None) -> None:
        self.ep_group, self.ep = ep_group, group_size(ep_group)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep
        self.first = group_rank(ep_group) * self.num_local
        self.stats, self.balanced = stats, balanced

    def _pad_to_group_max(self, tokens, probs, routing_map):
        """Rows appended so that every ep rank holds ``T_max`` tokens (an all-reduce of T, no gradient)."""
        count = torch.tensor([tokens.shape[0]], dtype=torch.int64, device=tokens.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ep_group)
        extra = 0 if holds_no_data(count) else int(count.item()) - tokens.shape[0]  # dry run: no values
        if extra == 0:
            return tokens, probs, routing_map
        tokens = torch.cat([tokens, tokens.new_zeros(extra, tokens.shape[1])])                  # [T_max, h]
        probs = torch.cat([probs, probs.new_zeros(extra, probs.shape[1])])                      # [T_max, E]
        routing_map = torch.cat([routing_map, routing_map.new_zeros(extra, routing_map.shape[1])])
        return tokens, probs, routing_map

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        local_tokens = tokens.shape[0]
        if self.ep > 1:
            tokens, probs, routing_map = self._pad_to_group_max(tokens, probs, routing_map)
            tokens, probs, routing_map = gather_routed_tokens(tokens, probs, routing_map, self.ep_group,
                                                              self.stats)                 # [ep T_max, .]
        local = slice(self.first, self.first + self.num_local)
        assumed = _assumed_counts(routing_map[:, local], self.balanced, num_experts=self.num_experts,
                                  first=self.first)
        permuted, token_index, permuted_probs, counts = permute(tokens, routing_map[:, local], probs[:, local],
                                                                assumed)
        handle = _Handle(token_index, permuted_probs, tokens.shape[0], local_tokens=local_tokens)
        return permuted, assumed or counts.tolist(), handle

    def combine(self, expert_output: torch.Tensor, handle: _Handle) -> torch.Tensor:
        out = unpermute(expert_output, handle.token_index, handle.probs, handle.num_tokens)  # [ep T_max, h]
        if self.ep > 1:
            out = _ReduceScatterToEP.apply(out, self.ep_group, self.stats)                   # [T_max, h]
            out = out[:handle.local_tokens]                                                  # [T, h]
        return out
