"""FP8 linears with their sequence-parallel collectives overlapped with the GEMMs (``--tp-comm-overlap`` under
``--fp8``), for the per-tensor recipes (tensorwise, delayed once calibrated), as Transformer Engine's
userbuffers do: the collectives move FP8 bytes where the operand is FP8, and run chunk by chunk beside the
GEMMs of the rows already present (``tensor_parallel.comm_overlap`` for the high-precision layers):

    column forward    x's local chunk quantized with the whole tensor's scale (amax MAX-reduced over tp); its
                      FP8 bytes all-gathered in chunks || the FP8 GEMM of the local rows, then of each chunk's
                      rows as they land; only the local FP8 chunk is saved
    column backward   the FP8 input gathered again for dW || dgrad GEMM of chunk j's rows, whose reduce-scatter
                      || dgrad of chunk j+1; then the dW GEMM
    row forward       FP8 GEMM of chunk j's rows, whose partial sums reduce-scatter || GEMM of chunk j+1
    row backward      dy's local chunk quantized with the whole tensor's scale, its FP8 bytes all-gathered in
                      chunks || dgrad GEMM of the local rows, then of each chunk's; then the dW GEMM

Quantizing is element-wise and every GEMM row sees the same operands, so outputs and grads equal the plain FP8
path's (``fp8.linear``) up to the GEMM's blocking (bit-equal under the emulation here). Anything else
(block recipes, delayed scaling's calibration, ``fp8_wgrad=False``, grouped weights, a deferred weight grad)
takes the plain FP8 path: ``overlap_supported``.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_core.fp8 import linear as fp8_linear  # the module: fp8.linear imports tensor_parallel, which imports this
from megatron_core.fp8.quantize import Quantized
from megatron_core.tensor_parallel.comm_overlap import DEFAULT_NUM_CHUNKS, scattered_chunks, usable_chunks
from megatron_core.tensor_parallel.utils import group_rank, group_size

if TYPE_CHECKING:
    from megatron_core.fp8.linear import Fp8Plan


def overlap_supported(plan: Fp8Plan, weight: torch.Tensor, deferring: bool) -> bool:
    """Whether the overlapped FP8 path takes this call (else the plain FP8 path runs)."""
    calibrating = plan.scaling is not None and any(
        plan.scaling.ready(role) is not None for role in ("input", "weight", "grad_output"))
    return (plan.per_tensor and plan.config.fp8_wgrad and weight.dim() == 2 and not deferring
            and not calibrating)


def _rows(q: Quantized, data: torch.Tensor) -> Quantized:
    """``q``'s scales over other rows (``data``) of the same per-tensor-scaled tensor."""
    return dataclasses.replace(q, data=data)


def _gather_bytes(data: torch.Tensor, group, chunks: int) -> list[tuple[torch.Tensor, object]]:
    """Starts one async all-gather per chunk of FP8 rows ``data`` ``[m, k]``; each gives ``[tp, m/chunks, k]``
    (as bytes: collectives take no float8 dtype)."""
    world, pieces = group_size(group), data.view(torch.uint8).view(chunks, data.shape[0] // chunks, -1)
    started = []
    for piece in pieces:
        gathered = torch.empty((world * piece.shape[0], piece.shape[1]), dtype=torch.uint8, device=data.device)
        work = dist.all_gather_single(gathered, piece, group=group, async_op=True)
        started.append((gathered.view(data.dtype).view(world, *piece.shape), work))
    return started


def _gemm_gathered(plan: Fp8Plan, local: Quantized, other: Quantized, out: torch.Tensor, group, chunks: int,
                   bias=None, keep: bool = False) -> Optional[torch.Tensor]:
    """``out[rows] = gather(local)[rows] . other^T (+ bias)`` block by block: ``local`` ``[m, k]`` FP8 rows of
    this rank, ``out`` ``[tp * m, n]``; the local rows first, then each chunk's as its all-gather lands.
    ``keep``: also returns the gathered FP8 rows ``[tp * m, k]`` in global order (else None)."""
    world, rank = group_size(group), group_rank(group)
    started = _gather_bytes(local.data, group, chunks)
    out_blocks = out.view(world, chunks, local.data.shape[0] // chunks, out.shape[-1])
    out_blocks[rank].view(-1, out.shape[-1]).copy_(plan.gemm(local, other, out.dtype, bias))
    total = (torch.empty((world, chunks, *started[0][0].shape[1:]), dtype=torch.uint8, device=out.device)
             if keep else None)
    for j, (gathered, work) in enumerate(started):
        work.wait()
        if total is not None:
            total[:, j] = gathered.view(torch.uint8)
        for first, end in ((0, rank), (rank + 1, world)):  # the other ranks' rows: one GEMM per side of this one
            if end > first:
                rows = gathered[first:end].reshape(-1, gathered.shape[-1])
                out_blocks[first:end, j] = plan.gemm(_rows(local, rows), other, out.dtype, bias).view(
                    end - first, *out_blocks.shape[2:])
    return None if total is None else total.view(local.data.dtype).view(-1, local.data.shape[-1])


def _gemm_reduce_scatter(plan: Fp8Plan, a: Quantized, b: Quantized, out: torch.Tensor, group,
                         chunks: int) -> list[tuple[torch.Tensor, object]]:
    """Starts ``out = reduce_scatter(a . b^T)`` chunk by chunk: ``a`` ``[tp * m, k]`` FP8 rows, ``out``
    ``[m, n]``; each chunk's partial sums reduce-scatter while the next chunk's GEMMs run."""
    world, rows = group_size(group), out.shape[0] // chunks
    blocks, out_chunks = a.data.view(world, chunks, rows, -1), out.view(chunks, rows, out.shape[-1])
    started = []
    for j in range(chunks):
        chunk_rows = blocks.view(torch.uint8)[:, j].reshape(world * rows, -1).view(a.data.dtype)  # a byte copy
        partial = plan.gemm(_rows(a, chunk_rows), b, out.dtype)
        work = dist.reduce_scatter_single(out_chunks[j], partial, group=group, async_op=True)
        started.append((partial, work))
    return started


def _wait_all(started) -> None:
    for _, work in started:
        work.wait()


class _Fp8AllGatherLinear(torch.autograd.Function):
    """Column-parallel: x ``[s/tp, b, K]`` -> ``[s, b, N/tp]`` (collectives: the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: Fp8Plan, group, chunks: int, gathered):
        local, scale_x = fp8_linear.local_fp8_input(plan, x, group)
        qw, scale_w, ready_w = plan.quantize_weight(weight, gathered)
        world, k = group_size(group), x.shape[-1]
        out = torch.empty((world * x.shape[0], *x.shape[1:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        _gemm_gathered(plan, local, qw, out.view(-1, weight.shape[0]), group, chunks, bias)
        ctx.save_for_backward(local.data, weight, scale_x, scale_w, ready_w)
        ctx.plan, ctx.group, ctx.chunks, ctx.has_bias, ctx.k = plan, group, chunks, bias is not None, k
        return out

    @staticmethod
    def backward(ctx, grad_output):
        local_x, weight, scale_x, scale_w, ready_w = ctx.saved_tensors
        plan, group, chunks = ctx.plan, ctx.group, ctx.chunks
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        qdy = plan.quantize("grad_output", dy)[0]
        world = group_size(group)
        total = work = None
        if needs_weight:  # the FP8 input again, for dW: beside the dgrad GEMMs
            total = torch.empty((world * local_x.shape[0], ctx.k), dtype=torch.uint8, device=local_x.device)
            work = dist.all_gather_single(total, local_x.view(torch.uint8), group=group, async_op=True)
        grad_input, reductions = None, []
        if needs_input:
            grad_input = torch.empty((local_x.shape[0], ctx.k), dtype=grad_output.dtype, device=dy.device)
            qw_t = plan.with_scale("weight", weight, scale_w, ready_w).t()
            reductions = _gemm_reduce_scatter(plan, qdy, qw_t, grad_input, group, chunks)
        grad_weight = grad_bias = None
        if needs_weight:
            work.wait()
            qx = plan.quantized("input", total.view(local_x.dtype), scale_x)
            grad_weight = plan.gemm(qdy.t(), qx.t(), weight.dtype)
        if ctx.has_bias and needs_bias:
            grad_bias = dy.sum(0)
        _wait_all(reductions)
        if grad_input is not None:
            grad_input = grad_input.view(-1, *grad_output.shape[1:-1], ctx.k)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class _Fp8LinearReduceScatter(torch.autograd.Function):
    """Row-parallel: x ``[s, b, K/tp]`` -> ``[s/tp, b, N]`` partial sums reduce-scattered (no bias)."""

    @staticmethod
    def forward(ctx, x, weight, plan: Fp8Plan, group, chunks: int, gathered):
        rows = x.reshape(-1, x.shape[-1])
        qx, scale_x, _ = plan.quantize("input", rows)
        qw, scale_w, ready_w = plan.quantize_weight(weight, gathered)
        world = group_size(group)
        out = torch.empty((x.shape[0] // world, *x.shape[1:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        _wait_all(_gemm_reduce_scatter(plan, qx, qw, out.view(-1, weight.shape[0]), group, chunks))
        ctx.save_for_backward(qx.data, weight, scale_x, scale_w, ready_w)
        ctx.plan, ctx.group, ctx.chunks, ctx.x_shape = plan, group, chunks, x.shape
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x_data, weight, scale_x, scale_w, ready_w = ctx.saved_tensors
        plan, group, chunks = ctx.plan, ctx.group, ctx.chunks
        needs_input, needs_weight = ctx.needs_input_grad[:2]
        local, _ = fp8_linear.local_fp8_input(plan, grad_output, group, "grad_output")  # this rank's dy rows
        grad_input = torch.empty((x_data.shape[0], x_data.shape[1]), dtype=grad_output.dtype,
                                 device=grad_output.device)
        qw_t = plan.with_scale("weight", weight, scale_w, ready_w).t()
        total = _gemm_gathered(plan, local, qw_t, grad_input, group, chunks, keep=needs_weight)  # dgrad
        grad_weight = None
        if needs_weight:
            qx = plan.quantized("input", x_data, scale_x)
            grad_weight = plan.gemm(_rows(local, total).t(), qx.t(), weight.dtype)
        return (grad_input.view(ctx.x_shape) if needs_input else None), grad_weight, None, None, None, None


def fp8_all_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: Fp8Plan,
                          group, *, gathered=None, num_chunks: int = DEFAULT_NUM_CHUNKS) -> torch.Tensor:
    """The column-parallel FP8 linear under SP with its collectives overlapped: x ``[s/tp, b, K]``, weight ``[N/tp,
    K]``, bias ``[N/tp]`` or None -> ``[s, b, N/tp]``. Forward: chunked async all-gathers of x's FP8 bytes;
    backward: an async all-gather of them (dW) and chunked async reduce-scatters of dx."""
    chunks = usable_chunks(x.shape[0], num_chunks)
    return _Fp8AllGatherLinear.apply(x, weight, bias, plan, group, chunks,
                                     fp8_linear.prepare(plan, x, weight, gathered))


def fp8_linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, plan: Fp8Plan, group, *, gathered=None,
                              num_chunks: int = DEFAULT_NUM_CHUNKS) -> torch.Tensor:
    """The row-parallel FP8 linear under SP with its collectives overlapped: x ``[s, b, K/tp]``, weight ``[N,
    K/tp]`` -> ``[s/tp, b, N]``. Forward: chunked async reduce-scatters of the partial sums; backward: chunked
    async all-gathers of dy's FP8 bytes."""
    return _Fp8LinearReduceScatter.apply(x, weight, plan, group, scattered_chunks(x, group, num_chunks),
                                         fp8_linear.prepare(plan, x, weight, gathered))


__all__ = ["overlap_supported", "fp8_all_gather_linear", "fp8_linear_reduce_scatter"]
