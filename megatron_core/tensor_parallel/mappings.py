"""The f/g operators of Megatron-LM (arXiv 1909.08053, section 3) and their sequence-parallel variants
(arXiv 2205.05198, section 4.2.2), as autograd functions that each take their process group.

Tensor-parallel regions split the hidden (last) dim; sequence-parallel regions split the sequence (first)
dim of Megatron's ``[s, b, h]`` activations. A ``None`` group, or a group of size 1, makes every operator
the identity. Collectives never modify their input or the incoming gradient in place (autograd may share
a gradient tensor between branches): each reduces into a fresh tensor.

    operator                                      forward              backward
    copy_to_tensor_model_parallel_region          identity             all-reduce        (f)
    reduce_from_tensor_model_parallel_region      all-reduce           identity          (g)
    scatter_to_tensor_model_parallel_region       split last dim       all-gather last dim
    gather_from_tensor_model_parallel_region      all-gather last dim  split last dim
    scatter_to_sequence_parallel_region           split first dim      all-gather first dim
    gather_from_sequence_parallel_region          all-gather first dim reduce-scatter first dim (or split)
    reduce_scatter_to_sequence_parallel_region    reduce-scatter dim 0 all-gather first dim
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_core.tensor_parallel.utils import group_rank, group_size

Group = Optional[dist.ProcessGroup]


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _check_split(x: torch.Tensor, dim: int, world: int) -> None:
    if x.dim() == 0 or x.shape[dim] % world != 0:
        what = "tensor" if x.dim() == 0 else f"dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)})"
        raise ValueError(f"{what} is not divisible by the tensor-parallel group size {world}")


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's equal chunk of ``x`` along ``dim``."""
    world = group_size(group)
    if world == 1:
        return x
    _check_split(x, dim, world)
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenation along ``dim`` of ``x`` from every rank of ``group``, in rank order."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    gathered = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(gathered, x, group=group)
    if dim % x.dim() == 0:
        return gathered
    return torch.cat(gathered.chunk(world, dim=0), dim=dim)


def _reduce_scatter_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over ``group`` of ``x``, of which this rank keeps its chunk of the first dim."""
    world = group_size(group)
    if world == 1:
        return x
    _check_split(x, 0, world)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        if not inplace:
            return _all_reduce(x, group)
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather in forward; split (or reduce-scatter, for partial-sum grads on dim 0) in backward."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_scatter_grad):
        ctx.group, ctx.dim, ctx.reduce_scatter_grad = group, dim, reduce_scatter_grad
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_scatter_grad:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 0, ctx.group), None


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's f: identity in forward, all-reduce of the gradient over ``group`` in backward."""
    if group_size(group) == 1:
        return input_
    return _CopyToRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None, *,
                                             inplace: bool = False) -> torch.Tensor:
    """Megatron's g: all-reduce (sum) over ``group`` in forward, identity in backward.

    ``inplace=True`` reduces into ``input_`` itself (no copy): only for a contiguous tensor the caller just
    made and that nothing else reads, such as a linear layer's partial-sum output."""
    if group_size(group) == 1:
        return input_
    if inplace and not input_.is_contiguous():
        inplace = False
    return _ReduceFromRegion.apply(input_, group, inplace)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keeps this rank's chunk of the last dim (``[..., h] -> [..., h/tp]``); backward all-gathers it."""
    if group_size(group) == 1:
        return input_
    return _ScatterToRegion.apply(input_, group, -1)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-gathers the last dim (``[..., h/tp] -> [..., h]``); backward keeps this rank's chunk."""
    if group_size(group) == 1:
        return input_
    return _GatherFromRegion.apply(input_, group, -1, False)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keeps this rank's chunk of the first (sequence) dim (``[s, ...] -> [s/tp, ...]``).

    Backward all-gathers the gradient along the first dim.
    """
    if group_size(group) == 1:
        return input_
    return _ScatterToRegion.apply(input_, group, 0)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, group: Group = None, *, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gathers the first (sequence) dim (``[s/tp, ...] -> [s, ...]``).

    Backward reduce-scatters the gradient along the first dim when the consumer is tensor-parallel
    (``tensor_parallel_output_grad=True``: each rank holds a partial sum of the gradient), and otherwise
    keeps this rank's chunk of it.
    """
    if group_size(group) == 1:
        return input_
    return _GatherFromRegion.apply(input_, group, 0, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sums over ``group`` and keeps this rank's chunk of the first dim (``[s, ...] -> [s/tp, ...]``).

    Backward all-gathers the gradient along the first dim.
    """
    if group_size(group) == 1:
        return input_
    return _ReduceScatterToSequenceRegion.apply(input_, group)
