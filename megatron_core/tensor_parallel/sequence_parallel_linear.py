"""The sequence-parallel column linear of Megatron-LM (arXiv 2205.05198, section 4.2.2) that keeps only the
local sequence chunk of its input for backward.

A plain ``F.linear(gather(x))`` would save the all-gathered ``[s, b, h]`` input: tp times the activation
memory sequence parallelism exists to save. Here forward saves ``x`` ``[s/tp, b, h]`` and backward
all-gathers it again, overlapped with the input-gradient GEMM, then reduce-scatters the input gradient
while it computes the weight gradient.

Communication: forward all-gather along s; backward all-gather along s (of the saved input) and
reduce-scatter along s (of the input gradient), both asynchronous. Under a zero-bubble schedule's B pass
(``weight_grad_store``) the weight gradient, with its all-gather of the saved input, is deferred to the W pass.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core.tensor_parallel.utils import group_size
from megatron_core.tensor_parallel.weight_grad_store import (
    WeightGradStore,
    deferrable_target,
    deferring_forward,
    linear_deferrable,
    weight_gradient,
)


def _gather_first_dim(x: torch.Tensor, group, async_op: bool):
    world = group_size(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = dist.all_gather_single(out, x.contiguous(), group=group, async_op=async_op)
    return out, handle


class _SequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                store: Optional[WeightGradStore]):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.store = group, bias is not None, store
        ctx.weight = deferrable_target(weight) if store is not None else None
        total, _ = _gather_first_dim(x, group, async_op=False)  # [s, b, h]
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if needs_weight and ctx.weight is not None and ctx.store.deferring:
            group = ctx.group  # the W pass all-gathers the input again and runs the weight GEMM
            ctx.store.defer(ctx.weight, lambda: weight_gradient(grad_output, _gather_first_dim(x, group, False)[0]))
            needs_weight = False
        gathered = _gather_first_dim(x, ctx.group, async_op=True) if needs_weight else None
        grad_input = reduce_handle = None
        if needs_input:
            grad_total = (grad_output @ weight).contiguous()  # [s, b, h], a partial sum on each rank
            grad_input = torch.empty_like(x)
            reduce_handle = dist.reduce_scatter_single(grad_input, grad_total, group=ctx.group, async_op=True)
        grad_weight = grad_bias = None
        if needs_weight:
            total, gather_handle = gathered
            gather_handle.wait()
            grad_weight = weight_gradient(grad_output, total)
        if ctx.has_bias and needs_bias:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        if reduce_handle is not None:
            reduce_handle.wait()
        return grad_input, grad_weight, grad_bias, None, None


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             group, weight_grad_store: Optional[WeightGradStore] = None) -> torch.Tensor:
    """``F.linear(all_gather_s(x), weight, bias)`` for ``x`` ``[s/tp, b, in]`` -> ``[s, b, out/tp]``,
    saving only ``x`` for backward (see the module docstring)."""
    if x.shape[0] == 0 or group_size(group) == 1:
        return linear_deferrable(x, weight, bias, weight_grad_store)
    store = weight_grad_store if deferring_forward(weight_grad_store) else None
    return _SequenceParallelLinear.apply(x, weight, bias, group, store)
