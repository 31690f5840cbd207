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
    all_to_all                                    all-to-all dim 0     all-to-all dim 0, splits swapped
"""
from __future__ import annotations

import math
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron_core.tensor_parallel.utils import group_rank, group_size

Group = Optional[dist.ProcessGroup]


class ByteCounter(Protocol):
    """Anything with a ``bytes_sent`` count (such as the MoE dispatcher's ``CommStats``)."""

    bytes_sent: int


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


def _all_to_all(x: torch.Tensor, group: Group, output_split_sizes: Optional[list[int]],
                input_split_sizes: Optional[list[int]], stats: Optional[ByteCounter]) -> torch.Tensor:
    """One ``all_to_all_single`` along dim 0 (even splits when the sizes are None) into a fresh tensor."""
    x = x.contiguous()
    rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = x.new_empty(rows, *x.shape[1:])
    dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)
    if stats is not None:
        me, world = group_rank(group), group_size(group)
        sizes = input_split_sizes if input_split_sizes is not None else [x.shape[0] // world] * world
        sent = sum(n for r, n in enumerate(sizes) if r != me)
        stats.bytes_sent += sent * math.prod(x.shape[1:]) * x.element_size()
    return out


def _check_all_to_all_splits(x: torch.Tensor, world: int, output_split_sizes: Optional[Sequence[int]],
                             input_split_sizes: Optional[Sequence[int]]) -> None:
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError(f"all_to_all takes both split lists or neither, got output_split_sizes="
                         f"{output_split_sizes} and input_split_sizes={input_split_sizes}")
    if x.dim() == 0:
        raise ValueError("all_to_all exchanges rows of dim 0: give a tensor of at least one dim")
    if input_split_sizes is None:
        if x.shape[0] % world:
            raise ValueError(f"all_to_all with even splits needs dim 0 of the input {tuple(x.shape)} divisible "
                             f"by the group size {world}; pad it or pass output/input_split_sizes")
    elif len(output_split_sizes) != world or len(input_split_sizes) != world or sum(input_split_sizes) != x.shape[0]:
        raise ValueError(f"all_to_all over a group of size {world} needs {world} output and {world} input split "
                         f"sizes, the input ones summing to dim 0 of the input {tuple(x.shape)}; got "
                         f"output_split_sizes={list(output_split_sizes)}, input_split_sizes={list(input_split_sizes)}")


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_split_sizes, input_split_sizes, stats):
        ctx.group, ctx.splits, ctx.stats = group, (output_split_sizes, input_split_sizes), stats
        return _all_to_all(x, group, output_split_sizes, input_split_sizes, stats)

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        return _all_to_all(grad, ctx.group, input_split_sizes, output_split_sizes, ctx.stats), None, None, None, None


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


def all_to_all(input_: torch.Tensor, group: Group = None, *, output_split_sizes: Optional[Sequence[int]] = None,
               input_split_sizes: Optional[Sequence[int]] = None,
               stats: Optional[ByteCounter] = None) -> torch.Tensor:
    """All-to-all along dim 0 over ``group``: this rank's j-th block of rows goes to rank j.

    Forward: one all-to-all, ``[sum(input_split_sizes), ...] -> [sum(output_split_sizes), ...]`` (the rows
    received from rank 0, then those from rank 1, ...). Backward: one all-to-all of the gradient with the two
    split lists swapped, ``[sum(output_split_sizes), ...] -> [sum(input_split_sizes), ...]``, which returns
    every row's gradient to the rank and position the row came from.

    Args:
        input_: ``[sum(input_split_sizes), ...]``: the rows for rank 0, then those for rank 1, and so on.
        group: the process group; None or a group of size 1 makes this the identity.
        output_split_sizes: rows this rank receives from each rank of ``group``, in rank order.
        input_split_sizes: rows this rank sends to each rank of ``group``, in rank order. Give both split
            lists or neither: without them (even splits) every rank holds the same ``[n, ...]`` and sends
            ``n / size`` rows to each rank, so the output is ``[n, ...]`` too.
        stats: if given, ``stats.bytes_sent`` grows by the bytes this rank sends to the other ranks, in
            forward and in backward.

    Returns:
        ``[sum(output_split_sizes), ...]``, or ``[n, ...]`` for even splits.

    Raises:
        ValueError: only one split list is given, their lengths are not the group size, the input splits do
            not sum to dim 0 of ``input_``, or (even splits) dim 0 does not divide by the group size.
    """
    world = group_size(group)
    _check_all_to_all_splits(input_, world, output_split_sizes, input_split_sizes)
    if world == 1:
        return input_
    if input_split_sizes is not None:
        output_split_sizes, input_split_sizes = list(output_split_sizes), list(input_split_sizes)
    return _AllToAll.apply(input_, group, output_split_sizes, input_split_sizes, stats)
