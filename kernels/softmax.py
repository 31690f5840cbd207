"""Fused scale + mask + softmax over the last dim of attention scores, forward and backward.

``y = softmax(scale * x)`` with masked positions excluded (they get probability 0); a row with every position
masked gives zeros, never NaN. Backward: ``dx = scale * y * (dy - sum(dy * y))`` (no mask needed: y is 0 there).

One Triton program handles one row of ``sk`` scores. When the row fits one block of at most ``_MAX_BLOCK``
elements it is loaded once and kept in registers; longer rows run blocked loops (an online max / sum-of-exp
pass, then a pass that writes). Causal rows read only their first ``q + 1`` scores. Statistics are fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels import _dispatch
from kernels._dispatch import KernelBackend, jit, resolve, tl

_MAX_BLOCK = 16384  # longest row kept in registers; tests lower it to exercise the looped path


@jit
def _scores(x_row, m_row, cols, n_valid, n_cols, scale, m_sk, HAS_MASK: tl.constexpr):
    """fp32 ``scale * x`` at ``cols``, -inf where masked out or past the row; also the validity mask."""
    valid = cols < n_valid
    if HAS_MASK:
        masked = tl.load(m_row + cols * m_sk, mask=cols < n_cols, other=1)
        valid = valid & (masked == 0)
    s = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32) * scale
    return tl.where(valid, s, float("-inf")), valid


@jit
def _softmax_fwd_kernel(x_ptr, y_ptr, mask_ptr, n_cols, sq, heads, m_sb, m_sh, m_sq, m_sk, scale,
                        HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, ONE_BLOCK: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    q = row % sq
    m_row = mask_ptr + (row // (sq * heads)) * m_sb + ((row // sq) % heads) * m_sh + q * m_sq
    n_valid = n_cols
    if CAUSAL:
        n_valid = q + 1
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        s, valid = _scores(x_row, m_row, cols, n_valid, n_cols, scale, m_sk, HAS_MASK)
        row_max = tl.max(s, 0)
        e = tl.exp(s - tl.where(row_max == float("-inf"), 0.0, row_max))
        denom = tl.sum(e, 0)
        y = e / tl.where(denom == 0.0, 1.0, denom)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        row_max = tl.full([], float("-inf"), tl.float32)
        denom = tl.full([], 0.0, tl.float32)
        for start in range(0, n_valid, BLOCK):  # online max and sum of exp over the valid prefix
            cols = start + tl.arange(0, BLOCK)
            s, valid = _scores(x_row, m_row, cols, n_valid, n_cols, scale, m_sk, HAS_MASK)
            new_max = tl.maximum(row_max, tl.max(s, 0))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            denom = denom * tl.exp(row_max - shift) + tl.sum(tl.exp(s - shift), 0)
            row_max = new_max
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        inv = 1.0 / tl.where(denom == 0.0, 1.0, denom)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s, valid = _scores(x_row, m_row, cols, n_valid, n_cols, scale, m_sk, HAS_MASK)
            y = tl.exp(s - shift) * inv
            tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


@jit
def _softmax_bwd_kernel(y_ptr, dy_ptr, dx_ptr, n_cols, sq, scale, CAUSAL: tl.constexpr,
                        ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offset = row * n_cols
    n_valid = n_cols
    if CAUSAL:
        n_valid = row % sq + 1  # y is 0 past the diagonal: read only the prefix
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        y = tl.load(y_ptr + offset + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offset + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, 0)
        dx = scale * y * (dy - dot)
        tl.store(dx_ptr + offset + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_valid, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = tl.load(y_ptr + offset + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offset + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, 0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = tl.load(y_ptr + offset + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offset + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
            dx = scale * y * (dy - dot)
            tl.store(dx_ptr + offset + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < n_cols)


def softmax_reference(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool) -> torch.Tensor:
    """Plain-torch forward: fp32 ``softmax(scale * x)`` with masked positions (True) at 0, in x's dtype.

    Args:
        x: ``[..., sq, sk]`` scores.
        mask: boolean, broadcastable to x, True = masked out; or None.
        scale: multiplies x before the softmax.
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").
        causal: also mask the positions above the diagonal (``k > q``).
    """
    s = x.float() * scale
    if causal:
        upper = torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool, device=x.device).triu_(1)
        mask = upper if mask is None else mask | upper
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max))
    denom = e.sum(dim=-1, keepdim=True)
    return (e / torch.where(denom == 0, torch.ones_like(denom), denom)).to(x.dtype)


def softmax_backward_reference(y: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain-torch backward: ``scale * y * (dy - sum(dy * y))`` in fp32, returned in dy's dtype."""
    y32, dy32 = y.float(), dy.float()
    return (scale * y32 * (dy32 - (y32 * dy32).sum(dim=-1, keepdim=True))).to(dy.dtype)


def _forward_triton(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool,
                    backend: KernelBackend) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    sq, sk = x.shape[-2], x.shape[-1]
    heads = x.shape[1] if x.dim() == 4 else 1
    if mask is None:
        mask_arg, strides = x, (0, 0, 0, 0)  # never read: HAS_MASK is False
    else:
        mask_arg = torch.broadcast_to(mask, x.shape).view(torch.uint8)  # stride 0 along broadcast dims
        strides = tuple(mask_arg.stride())
    block, one_block = _dispatch.block_size(sk, _MAX_BLOCK)
    rows = x.numel() // sk
    backend.launch(_softmax_fwd_kernel, (rows,), x, y, mask_arg, sk, sq, heads, *strides, scale,
                   HAS_MASK=mask is not None, CAUSAL=causal, ONE_BLOCK=one_block, BLOCK=block,
                   num_warps=_dispatch.num_warps(block))
    return y


def _backward_triton(y: torch.Tensor, dy: torch.Tensor, scale: float, causal: bool,
                     backend: KernelBackend) -> torch.Tensor:
    dy = dy.contiguous()
    dx = torch.empty_like(y)
    sq, sk = y.shape[-2], y.shape[-1]
    block, one_block = _dispatch.block_size(sk, _MAX_BLOCK)
    backend.launch(_softmax_bwd_kernel, (y.numel() // sk,), y, dy, dx, sk, sq, scale, CAUSAL=causal,
                   ONE_BLOCK=one_block, BLOCK=block, num_warps=_dispatch.num_warps(block))
    return dx


class _ScaledMaskedSoftmax(torch.autograd.Function):
    """Forward saves only y (x's dtype); backward reuses the forward's backend."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool, op: str,
                kernel_backend: KernelBackend):
        backend = kernel_backend.select(op, x.device, _dispatch.unsupported_dtype("x", x))
        if backend == "triton" and x.numel() > 0:  # an empty grid is not launched
            y = _forward_triton(x, mask, scale, causal, kernel_backend)
        else:
            y = softmax_reference(x, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale, ctx.causal, ctx.backend, ctx.kernel_backend = scale, causal, backend, kernel_backend
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (y,) = ctx.saved_tensors
        if ctx.backend == "triton" and y.numel() > 0:
            dx = _backward_triton(y, dy, ctx.scale, ctx.causal, ctx.kernel_backend)
        else:
            dx = softmax_backward_reference(y, dy, ctx.scale)
        return dx, None, None, None, None, None


def _check_scores(x: torch.Tensor, op: str) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{op}: x must be a floating-point tensor, got dtype {x.dtype}")
    if x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have at least one key position, got shape {tuple(x.shape)}")


def scaled_masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, *,
                          backend: Optional[KernelBackend] = None) -> torch.Tensor:
    """``softmax(scale * x)`` over the last dim with ``mask`` positions excluded (Megatron's fused softmax).

    Args:
        x: ``[b, heads, sq, sk]`` attention scores, fp32 / bf16 / fp16; any sk.
        mask: boolean, broadcastable to x (e.g. ``[b, 1, sq, sk]`` or ``[b, 1, 1, sk]``), True = masked out;
            None for no mask. Not differentiated.
        scale: multiplies x before the softmax (e.g. ``1 / sqrt(head_dim)``).
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").

    Returns:
        ``[b, heads, sq, sk]`` probabilities in x's dtype (fp32 math); fully masked rows are all zeros.
    """
    op = "scaled_masked_softmax"
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be [b, heads, sq, sk], got shape {tuple(x.shape)}")
    _check_scores(x, op)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"{op}: mask must be torch.bool (True = masked out), got dtype {mask.dtype}")
        try:
            shape = torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            shape = None
        if shape != x.shape:
            raise ValueError(f"{op}: mask shape {tuple(mask.shape)} does not broadcast to x shape "
                             f"{tuple(x.shape)}")
        if mask.device != x.device:
            raise ValueError(f"{op}: mask is on {mask.device} but x is on {x.device}")
    return _ScaledMaskedSoftmax.apply(x, mask, float(scale), False, op, resolve(backend))


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float, *,
                                       backend: Optional[KernelBackend] = None) -> torch.Tensor:
    """Causal ``softmax(scale * x)``: key ``k`` is masked out for query ``q`` when ``k > q``.

    Args:
        x: ``[b * heads, sq, sk]`` attention scores with ``sq == sk``, fp32 / bf16 / fp16.
        scale: multiplies x before the softmax.
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").

    Returns:
        ``[b * heads, sq, sk]`` probabilities in x's dtype, zero above the diagonal.
    """
    op = "scaled_upper_triang_masked_softmax"
    if x.dim() != 3 or x.shape[1] != x.shape[2]:
        raise ValueError(f"{op}: x must be [b * heads, sq, sk] with sq == sk, got shape {tuple(x.shape)}")
    _check_scores(x, op)
    return _ScaledMaskedSoftmax.apply(x, None, float(scale), True, op, resolve(backend))
