"""Fused LayerNorm and RMSNorm over the last dim, forward and backward, with fp32 statistics.

LayerNorm: ``y = (x - mean) * rstd * w + b``; RMSNorm: ``y = x * rstd * w`` with ``rstd = 1 / sqrt(var + eps)``
(for RMSNorm ``var`` is the mean of squares). With ``xhat = (x - mean) * rstd`` and ``g = w * dy`` the backward is
``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))`` (drop ``mean(g)`` for RMSNorm), ``dw = sum_rows(dy * xhat)``,
``db = sum_rows(dy)``.

Forward: one program per row, the row in registers when it fits one block of ``_MAX_BLOCK``, else blocked
loops. Backward: each program takes a contiguous chunk of rows, accumulates its partial ``dw`` / ``db`` in
fp32, and writes them to its own row of a ``[programs, hidden]`` buffer that the host sums (no atomics).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from kernels import _dispatch
from kernels._dispatch import KernelBackend, jit, resolve, tl

_MAX_BLOCK = 16384  # widest hidden size kept in registers; tests lower it to exercise the looped path


@jit
def _norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, IS_RMS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        mean = tl.sum(x, 0) / n_cols
        if IS_RMS:
            mean = mean * 0.0
        xc = tl.where(cols < n_cols, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = xc * rstd * w
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            acc += tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        mean = tl.sum(acc, 0) / n_cols
        if IS_RMS:
            mean = mean * 0.0
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):  # second pass: centred squares, no cancellation
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            xc = tl.where(cols < n_cols, x - mean, 0.0)
            acc += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(acc, 0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * w
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@jit
def _row_dx(x, dy, w, mean, rstd, valid, n_cols, IS_RMS: tl.constexpr):
    """``(xhat, dx)`` of one row held in registers (fp32)."""
    xhat = tl.where(valid, (x - mean) * rstd, 0.0)
    g = w * dy
    dx = g - xhat * (tl.sum(g * xhat, 0) / n_cols)
    if not IS_RMS:
        dx -= tl.sum(g, 0) / n_cols
    return xhat, dx * rstd


@jit
def _norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols,
                     rows_per_program, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_BLOCK: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    part = pid.to(tl.int64) * n_cols  # this program's row of the partial dw / db buffers
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        valid = cols < n_cols
        w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], tl.float32)
        db = tl.zeros([BLOCK], tl.float32)
        for row in range(first, last):
            offset = tl.cast(row, tl.int64) * n_cols  # the interpreter yields a Python int
            x = tl.load(x_ptr + offset + cols, mask=valid, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offset + cols, mask=valid, other=0.0).to(tl.float32)
            xhat, dx = _row_dx(x, dy, w, tl.load(mean_ptr + row), tl.load(rstd_ptr + row), valid, n_cols, IS_RMS)
            tl.store(dx_ptr + offset + cols, dx.to(dx_ptr.dtype.element_ty), mask=valid)
            dw += dy * xhat
            db += dy
        tl.store(dw_ptr + part + cols, dw, mask=valid)
        if HAS_BIAS:
            tl.store(db_ptr + part + cols, db, mask=valid)
    else:
        for row in range(first, last):
            offset = tl.cast(row, tl.int64) * n_cols  # the interpreter yields a Python int
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
            acc_gx = tl.zeros([BLOCK], tl.float32)
            acc_g = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + offset + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + offset + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
                acc_gx += w * dy * tl.where(cols < n_cols, (x - mean) * rstd, 0.0)
                acc_g += w * dy
            c_gx = tl.sum(acc_gx, 0) / n_cols
            c_g = tl.sum(acc_g, 0) / n_cols
            if IS_RMS:
                c_g = c_g * 0.0
            for start in range(0, n_cols, BLOCK):  # dx, and partial dw / db added into this program's row
                cols = start + tl.arange(0, BLOCK)
                valid = cols < n_cols
                x = tl.load(x_ptr + offset + cols, mask=valid, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + offset + cols, mask=valid, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
                xhat = tl.where(valid, (x - mean) * rstd, 0.0)
                dx = (w * dy - xhat * c_gx - c_g) * rstd
                tl.store(dx_ptr + offset + cols, dx.to(dx_ptr.dtype.element_ty), mask=valid)
                tl.store(dw_ptr + part + cols, tl.load(dw_ptr + part + cols, mask=valid) + dy * xhat, mask=valid)
                if HAS_BIAS:
                    tl.store(db_ptr + part + cols, tl.load(db_ptr + part + cols, mask=valid) + dy, mask=valid)


def norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                   rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch forward over the last dim; returns ``(y in x's dtype, mean fp32 [rows], rstd fp32 [rows])``.

    Args:
        x: ``[rows, hidden]``.
        weight, bias: ``[hidden]`` (bias may be None; ignored for RMSNorm).
        eps: added to the variance.
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").
        rms: RMSNorm (no centring, no bias) instead of LayerNorm.
    """
    x32 = x.float()
    mean = torch.zeros(x.shape[0], device=x.device) if rms else x32.mean(dim=-1)
    xc = x32 - mean.unsqueeze(-1)
    rstd = torch.rsqrt((xc * xc).mean(dim=-1) + eps)
    y = xc * rstd.unsqueeze(-1) * weight.float()
    if bias is not None and not rms:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def norm_backward_reference(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                            rstd: torch.Tensor, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch backward for ``[rows, hidden]`` inputs: ``(dx in x's dtype, dw fp32, db fp32)``."""
    xhat = (x.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dy32 = dy.float()
    g = dy32 * weight.float()
    dx = g - xhat * (g * xhat).mean(dim=-1, keepdim=True)
    if not rms:
        dx = dx - g.mean(dim=-1, keepdim=True)
    return (dx * rstd.unsqueeze(-1)).to(x.dtype), (dy32 * xhat).sum(dim=0), dy32.sum(dim=0)


def _forward_triton(x, weight, bias, eps, rms, backend):
    rows, hidden = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block, one_block = _dispatch.block_size(hidden, _MAX_BLOCK)
    backend.launch(_norm_fwd_kernel, (rows,), x, weight, weight if bias is None else bias, y, mean, rstd, hidden, eps,
                              IS_RMS=rms, HAS_BIAS=bias is not None, ONE_BLOCK=one_block, BLOCK=block,
                              num_warps=_dispatch.num_warps(block))
    return y, mean, rstd


@functools.lru_cache(maxsize=None)
def _backward_programs(device: torch.device) -> int:
    """Backward programs: a few row chunks per SM keep every SM busy and the partial dw / db buffers small."""
    if device.type == "cuda":
        from megatron_core.utils import accelerator  # the dry run's simulated GPU answers too
        return 4 * accelerator.multi_processor_count(device)
    return 4


def _backward_triton(x, weight, dy, mean, rstd, rms, has_bias, backend):
    rows, hidden = x.shape
    dx = torch.empty_like(x)
    programs = _backward_programs(x.device)
    per_program = -(-rows // max(1, min(programs, rows)))
    programs = max(1, -(-rows // per_program))
    block, one_block = _dispatch.block_size(hidden, _MAX_BLOCK)
    dw = torch.zeros(programs, hidden, dtype=torch.float32, device=x.device)
    db = torch.zeros_like(dw) if has_bias else dw
    backend.launch(_norm_bwd_kernel, (programs,), x, weight, dy, dx, mean, rstd, dw, db, rows, hidden, per_program,
                                  IS_RMS=rms, HAS_BIAS=has_bias, ONE_BLOCK=one_block, BLOCK=block,
                                  num_warps=_dispatch.num_warps(block))
    return dx, dw.sum(dim=0), db.sum(dim=0)


class _Norm(torch.autograd.Function):
    """Saves x, weight and the fp32 ``[rows]`` mean / rstd; backward reuses the forward's backend."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool, op: str, kernel_backend):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()  # [rows, hidden]
        unsupported = next(filter(None, (_dispatch.unsupported_dtype(name, t) for name, t in
                                         (("x", x), ("weight", weight), ("bias", bias)) if t is not None)), None)
        backend = kernel_backend.select(op, x.device, unsupported)
        args = (x2, weight.contiguous(), None if bias is None else bias.contiguous(), eps, rms)
        if backend == "triton" and x2.numel() > 0:
            y, mean, rstd = _forward_triton(*args, kernel_backend)
        else:
            y, mean, rstd = norm_reference(*args)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.has_bias, ctx.backend, ctx.kernel_backend = rms, bias is not None, backend, kernel_backend
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        if ctx.backend == "triton" and x2.numel() > 0:
            dx, dw, db = _backward_triton(x2, weight.contiguous(), dy2, mean, rstd, ctx.rms, ctx.has_bias,
                                          ctx.kernel_backend)
        else:
            dx, dw, db = norm_backward_reference(x2, weight, dy2, mean, rstd, ctx.rms)
        db = db.to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(dy.shape), dw.to(weight.dtype), db, None, None, None, None


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> None:
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"{op}: x must be a floating-point tensor [..., hidden], got dtype {x.dtype} and "
                         f"shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != x.shape[-1:] or not t.is_floating_point()):
            raise ValueError(f"{op}: {name} must be a floating-point [hidden] = [{x.shape[-1]}] tensor, got "
                             f"shape {tuple(t.shape)} and dtype {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if not eps > 0:
        raise ValueError(f"{op}: eps must be positive, got {eps}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float = 1e-5, *,
               backend: Optional[KernelBackend] = None) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics.

    Args:
        x: ``[..., hidden]``, fp32 / bf16 / fp16; any hidden size.
        weight: ``[hidden]`` scale (any of those dtypes; gets a gradient in its own dtype).
        bias: ``[hidden]`` shift, or None for a LayerNorm without bias.
        eps: added to the variance.
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").

    Returns:
        ``[..., hidden]`` in x's dtype. Backward gives dx, dweight and dbias.
    """
    _check("layer_norm", x, weight, bias, eps)
    backend = resolve(backend)
    if _native("layer_norm", x, weight, bias, backend):
        return F.layer_norm(x, x.shape[-1:], weight.to(x.dtype), None if bias is None else bias.to(x.dtype), eps)
    return _Norm.apply(x, weight, bias, float(eps), False, "layer_norm", backend)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
             backend: Optional[KernelBackend] = None) -> torch.Tensor:
    """RMSNorm over the last dim with fp32 statistics: ``x / sqrt(mean(x^2) + eps) * weight``.

    Args:
        x: ``[..., hidden]``, fp32 / bf16 / fp16; any hidden size.
        weight: ``[hidden]`` scale (gets a gradient in its own dtype).
        eps: added to the mean of squares.
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").

    Returns:
        ``[..., hidden]`` in x's dtype. Backward gives dx and dweight.
    """
    _check("rms_norm", x, weight, None, eps)
    backend = resolve(backend)
    if _native("rms_norm", x, weight, None, backend):
        return F.rms_norm(x, x.shape[-1:], weight.to(x.dtype), eps)
    return _Norm.apply(x, weight, None, float(eps), True, "rms_norm", backend)


def _native(op: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            backend: KernelBackend) -> bool:
    """Where the Triton kernel cannot run, torch's own fused op is the fastest path (``F.layer_norm``'s
    backward is 3-5x faster than the reference's on CPU); recorded as the "torch" backend. fp16/bf16 inputs
    keep the reference, whose statistics and weight grads are fp32 whatever torch's kernel does."""
    if backend.would_run_triton(x.device) or x.dtype != torch.float32:
        return False
    if any(t is not None and t.dtype != torch.float32 for t in (weight, bias)):
        return False
    backend.select(op, x.device)
    return True
