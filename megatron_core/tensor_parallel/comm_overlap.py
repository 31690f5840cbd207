"""Tensor-parallel communication overlapped with the neighbouring GEMM (Megatron's ``--tp-comm-overlap``), for
the sequence-parallel column- and row-parallel linear layers.

The sequence is cut into ``tp x num_chunks`` blocks: rank r's local ``[s/tp, b, h]`` input holds blocks
``(r, 0..num_chunks-1)``. Every collective is issued asynchronously per chunk (on gloo it runs on the process
group's worker threads, on NCCL on its stream), and the GEMM of the blocks already present runs meanwhile:

    column-parallel forward   all-gather chunk j  ||  GEMM of the local blocks, then of chunk j-1's blocks
    column-parallel backward  all-gather x (for the weight grad)  ||  input-grad GEMM of chunk j, whose
                              reduce-scatter  ||  input-grad GEMM of chunk j+1, then the weight-grad GEMM
    row-parallel forward      reduce-scatter of chunk j  ||  GEMM of chunk j+1
    row-parallel backward     all-gather of the output grad, chunk j  ||  input- and weight-grad GEMMs of
                              the local blocks, then of chunk j-1's blocks

Each block's GEMM writes straight into its rows of the result (``torch.mm(..., out=)`` on a contiguous
block), so the overlapped path makes no extra copy; its sums are the same as the plain path's up to the
GEMM blocking (fp32 agrees to ~1e-6). Only the local chunk of the column-parallel input is saved for
backward, as in ``sequence_parallel_linear``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_core.tensor_parallel.utils import group_rank, group_size

DEFAULT_NUM_CHUNKS = 2
"""Chunks each rank's sequence block is cut into (more chunks: finer overlap, smaller GEMMs)."""


def usable_chunks(local_rows: int, num_chunks: int) -> int:
    """The largest chunk count <= ``num_chunks`` that divides the local sequence length ``local_rows``."""
    for count in range(max(1, min(num_chunks, local_rows)), 0, -1):
        if local_rows % count == 0:
            return count
    return 1


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
    """``out[...] = a @ b (+ bias)`` on 2-D views of contiguous blocks (leading dims flattened)."""
    a2, out2 = a.reshape(-1, a.shape[-1]), out.view(-1, out.shape[-1])
    if bias is None:
        torch.mm(a2, b, out=out2)
    else:
        torch.addmm(bias, a2, b, out=out2)


def _gather_chunks(x: torch.Tensor, group, chunks: int) -> list[tuple[torch.Tensor, object]]:
    """Starts one async all-gather per chunk of ``x`` ``[s/tp, ...]``; each gives ``[tp, rows, ...]``."""
    world, pieces = group_size(group), x.view(chunks, x.shape[0] // chunks, *x.shape[1:])
    started = []
    for piece in pieces:
        gathered = torch.empty((world * piece.shape[0], *piece.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.all_gather_single(gathered, piece, group=group, async_op=True)
        started.append((gathered.view(world, *piece.shape), work))
    return started


def _blocks_times(source: torch.Tensor, weight_t: torch.Tensor, out: torch.Tensor, group, chunks: int, *,
                  bias: Optional[torch.Tensor] = None) -> None:
    """``out = gather_s(source) @ weight_t (+ bias)``: ``source`` ``[s/tp, b, k]`` local, ``out``
    ``[s, b, n]``; the local blocks first, then each chunk's remote blocks as its all-gather lands."""
    world, rank = group_size(group), group_rank(group)
    started = _gather_chunks(source, group, chunks)
    out_blocks = out.view(world, chunks, source.shape[0] // chunks, *out.shape[1:])
    _mm(source, weight_t, out_blocks[rank], bias)
    for j, (gathered, work) in enumerate(started):
        work.wait()
        for peer in range(world):
            if peer != rank:
                _mm(gathered[peer], weight_t, out_blocks[peer, j], bias)


def _times_reduce_scatter(source: torch.Tensor, weight_t: torch.Tensor, out: torch.Tensor, group,
                          chunks: int) -> list[tuple[torch.Tensor, object]]:
    """Starts ``out = reduce_scatter_s(source @ weight_t)`` chunk by chunk: ``source`` ``[s, b, k]``, ``out``
    ``[s/tp, b, n]``. Returns the works (with their buffers) to wait for."""
    world = group_size(group)
    rows = out.shape[0] // chunks
    blocks, out_chunks = source.view(world, chunks, rows, *source.shape[1:]), out.view(chunks, rows, *out.shape[1:])
    started = []
    for j in range(chunks):
        partial = torch.empty((world, *out_chunks[j].shape), dtype=out.dtype, device=out.device)
        for peer in range(world):
            _mm(blocks[peer, j], weight_t, partial[peer])
        stacked = partial.view(world * rows, *partial.shape[2:])
        started.append((partial, dist.reduce_scatter_single(out_chunks[j], stacked, group=group, async_op=True)))
    return started


def _wait_all(started: list[tuple[torch.Tensor, object]]) -> None:
    for _, work in started:
        work.wait()


class _AllGatherLinear(torch.autograd.Function):
    """Column-parallel: ``[s/tp, b, k]`` -> ``[s, b, n/tp]``."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, chunks):
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.chunks, ctx.has_bias = group, chunks, bias is not None
        out = torch.empty((group_size(group) * x.shape[0], *x.shape[1:-1], weight.shape[0]), dtype=x.dtype,
                          device=x.device)
        _blocks_times(x, weight.t(), out, group, chunks, bias=bias)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_output = grad_output.contiguous()
        total = gather_work = None
        if needs_weight:  # the whole input, for the weight grad: overlapped with the input-grad GEMMs
            total = torch.empty((group_size(ctx.group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            gather_work = dist.all_gather_single(total, x, group=ctx.group, async_op=True)
        grad_input, reductions = None, []
        if needs_input:
            grad_input = torch.empty_like(x)
            reductions = _times_reduce_scatter(grad_output, weight, grad_input, ctx.group, ctx.chunks)
        grad_weight = grad_bias = None
        flat_grad = grad_output.view(-1, grad_output.shape[-1])
        if needs_weight:
            gather_work.wait()
            grad_weight = flat_grad.t() @ total.view(-1, total.shape[-1])
        if ctx.has_bias and needs_bias:
            grad_bias = flat_grad.sum(0)
        _wait_all(reductions)
        return grad_input, grad_weight, grad_bias, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """Row-parallel: ``[s, b, k/tp]`` -> ``[s/tp, b, n]`` (no bias: it is added after the reduction)."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks):
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.chunks = group, chunks
        out = torch.empty((x.shape[0] // group_size(group), *x.shape[1:-1], weight.shape[0]), dtype=x.dtype,
                          device=x.device)
        _wait_all(_times_reduce_scatter(x, weight.t(), out, ctx.group, chunks))
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        needs_input, needs_weight = ctx.needs_input_grad[:2]
        grad_output = grad_output.contiguous()  # [s/tp, b, n]
        world, rank, chunks = group_size(ctx.group), group_rank(ctx.group), ctx.chunks
        started = _gather_chunks(grad_output, ctx.group, chunks)
        grad_input = torch.empty_like(x) if needs_input else None
        rows = grad_output.shape[0] // chunks
        x_blocks = x.view(world, chunks, rows, *x.shape[1:])
        in_blocks = grad_input.view(world, chunks, rows, *x.shape[1:]) if needs_input else None
        flat = grad_output.view(-1, grad_output.shape[-1])
        if needs_input:
            _mm(grad_output, weight, in_blocks[rank])
        grad_weight = flat.t() @ x_blocks[rank].reshape(-1, x.shape[-1]) if needs_weight else None
        for j, (gathered, work) in enumerate(started):
            work.wait()
            for peer in range(world):
                if peer == rank:
                    continue
                if needs_input:
                    _mm(gathered[peer], weight, in_blocks[peer, j])
                if needs_weight:
                    block = gathered[peer].view(-1, gathered.shape[-1])
                    grad_weight.addmm_(block.t(), x_blocks[peer, j].reshape(-1, x.shape[-1]))
        return grad_input, grad_weight, None, None


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group, *,
                      num_chunks: int = DEFAULT_NUM_CHUNKS) -> torch.Tensor:
    """``F.linear(all_gather_s(x), weight, bias)``, overlapped: ``x`` ``[s/tp, b, k]``, ``weight`` ``[n/tp, k]``
    -> ``[s, b, n/tp]``.

    Forward: chunked async all-gathers of x along s. Backward: async all-gather of x (weight grad) and
    chunked async reduce-scatter of the input grad along s.
    """
    chunks = usable_chunks(x.shape[0], num_chunks)
    return _AllGatherLinear.apply(x, weight, bias, group, chunks)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group, *,
                          num_chunks: int = DEFAULT_NUM_CHUNKS) -> torch.Tensor:
    """``reduce_scatter_s(F.linear(x, weight))``, overlapped: ``x`` ``[s, b, k/tp]``, ``weight`` ``[n, k/tp]``
    -> ``[s/tp, b, n]``.

    Forward: chunked async reduce-scatters along s. Backward: chunked async all-gathers of the output grad.
    """
    return _LinearReduceScatter.apply(x, weight, group, scattered_chunks(x, group, num_chunks))


def scattered_chunks(x: torch.Tensor, group, num_chunks: int) -> int:
    """The chunk count of a reduce-scatter along s of ``x`` ``[s, ...]`` (``usable_chunks`` of its ``s/tp`` output
    rows); ValueError when s does not divide by the group size."""
    world = group_size(group)
    if x.dim() == 0 or x.shape[0] % world != 0:
        raise ValueError(f"the sequence dim of shape {tuple(x.shape)} is not divisible by the tensor-parallel "
                         f"group size {world}")
    return usable_chunks(x.shape[0] // world, num_chunks)
