"""Cross-entropy over a (possibly vocab-sharded) row of logits, computed in blocks over the vocab.

Nothing of size ``[tokens, vocab]`` is materialised in fp32. The forward reads the logits once: one program
per row runs an online max / sum-of-exp over vocab blocks and also picks up the target logit (and the sum of
``logit - max``, for label smoothing); the results are ``[tokens]`` fp32 vectors. The backward reads the logits once
more and writes ``grad_scale * (softmax - (1 - eps) * onehot - eps / V)`` straight into the gradient buffer.

The same pieces serve the vocab-parallel loss: each rank computes ``cross_entropy_shard_stats`` of its shard,
the caller combines them across ranks (the max, then the sums after ``CrossEntropyShardStats.rebase`` to that
max), turns them into the loss with ``cross_entropy_loss_from_stats`` and writes its shard's gradient with
``cross_entropy_shard_backward``. (The file is not named cross_entropy.py so that ``kernels.cross_entropy``
stays the function.)

Label smoothing follows ``torch.nn.functional.cross_entropy``: ``loss = (1 - eps) * (lse - x_t) +
eps * (lse - mean_j x_j)`` with ``lse = max + log(sum_exp)``. Every sum is kept relative to the row max
(``sum_j (x_j - max)``), so logits of magnitude 1e30 lose no precision.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kernels import _dispatch
from kernels._dispatch import KernelBackend, jit, resolve, tl

_MAX_BLOCK = 4096  # vocab entries per loop step (per program in the backward); tests lower it


class CrossEntropyShardStats(NamedTuple):
    """Per-row statistics of one vocab shard (``shard_vocab`` entries), fp32 ``[tokens]`` tensors."""

    row_max: torch.Tensor  # max logit of the shard
    sum_exp: torch.Tensor  # sum of exp(logit - row_max) over the shard
    target_logit: torch.Tensor  # the target's logit when it lies in the shard, else 0
    shifted_sum: Optional[torch.Tensor]  # sum of (logit - row_max) (label smoothing only), else None
    shard_vocab: int

    def rebase(self, row_max: torch.Tensor) -> "CrossEntropyShardStats":
        """The same statistics relative to a larger ``row_max`` (e.g. the max over all shards).

        After rebasing, ``sum_exp`` and ``shifted_sum`` of the shards add up to those of the full vocab.
        """
        delta = torch.where(self.row_max == row_max, torch.zeros_like(row_max), self.row_max - row_max)
        shifted_sum = None if self.shifted_sum is None else self.shifted_sum + self.shard_vocab * delta
        return CrossEntropyShardStats(row_max, self.sum_exp * torch.exp(delta), self.target_logit, shifted_sum,
                                      self.shard_vocab)


@jit
def _ce_stats_kernel(logits_ptr, target_ptr, max_ptr, sum_exp_ptr, target_logit_ptr, shifted_sum_ptr, n_cols,
                     row_stride, vocab_start, WANT_SUM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    row_max = tl.full([], float("-inf"), tl.float32)
    shift = tl.full([], 0.0, tl.float32)  # row_max, or 0 while it is -inf (keeps every exp finite)
    sum_exp = tl.full([], 0.0, tl.float32)  # sum of exp(x - shift)
    shifted_sum = tl.full([], 0.0, tl.float32)  # sum of (x - shift)
    for start in range(0, n_cols, BLOCK):  # every block before the last one is full
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, 0))
        new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        sum_exp = sum_exp * tl.exp(row_max - new_shift) + tl.sum(tl.exp(x - new_shift), 0)  # exp(-inf) = 0
        if WANT_SUM:
            shifted_sum += tl.sum(tl.where(cols < n_cols, x - new_shift, 0.0), 0) - start * (new_shift - shift)
        row_max, shift = new_max, new_shift
    local = tl.load(target_ptr + row).to(tl.int64) - vocab_start
    in_shard = (local >= 0) & (local < n_cols)
    target_logit = tl.load(base + tl.where(in_shard, local, 0), mask=in_shard, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, row_max)
    tl.store(sum_exp_ptr + row, sum_exp)
    tl.store(target_logit_ptr + row, target_logit)
    if WANT_SUM:
        tl.store(shifted_sum_ptr + row, shifted_sum)


@jit
def _ce_bwd_kernel(logits_ptr, target_ptr, max_ptr, sum_exp_ptr, scale_ptr, out_ptr, n_cols, row_stride,
                   out_stride, vocab_start, smooth, target_weight, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
    prob = tl.exp(x - tl.load(max_ptr + row)) / tl.load(sum_exp_ptr + row)
    local = tl.load(target_ptr + row).to(tl.int64) - vocab_start
    grad = prob - smooth - tl.where(cols == local, target_weight, 0.0)
    grad = grad * tl.load(scale_ptr + row)
    tl.store(out_ptr + row * out_stride + cols, grad.to(out_ptr.dtype.element_ty), mask=valid)


def shard_stats_reference(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, with_shifted_sum: bool
                          ) -> CrossEntropyShardStats:
    """Plain-torch ``cross_entropy_shard_stats`` for ``[tokens, V_shard]`` logits (materialises fp32)."""
    x = logits.float()
    row_max = x.amax(dim=-1)
    shift = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    shifted = x - shift.unsqueeze(-1)  # [tokens, V_shard] fp32
    sum_exp = torch.exp(shifted).sum(dim=-1)
    local = target.long() - vocab_start
    in_shard = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(in_shard, picked, torch.zeros_like(picked))
    shifted_sum = shifted.sum(dim=-1) if with_shifted_sum else None
    return CrossEntropyShardStats(row_max, sum_exp, target_logit, shifted_sum, x.shape[-1])


def shard_backward_reference(logits, target, row_max, sum_exp, grad_scale, vocab_start, smooth, target_weight,
                             out):
    """Plain-torch ``cross_entropy_shard_backward`` for ``[tokens, V_shard]`` logits, written into ``out``.

    One fp32 ``[tokens, V_shard]`` buffer, updated in place (softmax, minus the smoothed target, times the
    per-token scale); the target column is adjusted with a scatter rather than a full one-hot mask.
    """
    grad = logits.float() - row_max.unsqueeze(-1)
    grad.exp_().div_(sum_exp.unsqueeze(-1))
    if smooth:
        grad.sub_(smooth)
    local = target.long() - vocab_start
    in_shard = (local >= 0) & (local < logits.shape[-1])
    grad.scatter_add_(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1),
                      (in_shard.to(grad.dtype) * -target_weight).unsqueeze(-1))
    out.copy_(grad.mul_(grad_scale.unsqueeze(-1)))
    return out


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """``[tokens, V]`` view of ``[..., V]`` logits with unit stride along the vocab (copied only if needed)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def cross_entropy_shard_stats(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int = 0,
                              with_shifted_sum: bool = False,
                              backend: Optional[KernelBackend] = None) -> CrossEntropyShardStats:
    """Statistics of one vocab shard of the logits, one pass over them; records op ``cross_entropy_shard_stats``.

    Args:
        logits: ``[..., V_shard]``, fp32 / bf16 / fp16; the vocab entries ``[vocab_start, vocab_start + V_shard)``.
        target: ``[...]`` integer ids in the full vocab; ids outside this shard contribute a target logit of 0.
        vocab_start: the full-vocab id of the shard's first entry.
        with_shifted_sum: also return the sum of ``logit - row_max`` (needed for label smoothing).
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").

    Returns:
        ``CrossEntropyShardStats`` of fp32 ``[tokens]`` vectors (tokens = ``target.numel()``).
    """
    rows, target = _rows(logits), target.reshape(-1).contiguous()
    if rows.shape[0] != target.shape[0]:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match target shape {tuple(target.shape)}")
    kernel_backend = resolve(backend)
    backend = kernel_backend.select("cross_entropy_shard_stats", logits.device,
                                    _dispatch.unsupported_dtype("logits", logits))
    if backend == "torch" or rows.shape[0] == 0:
        return shard_stats_reference(rows, target, vocab_start, with_shifted_sum)
    n, v = rows.shape
    row_max, sum_exp, target_logit = (torch.empty(n, dtype=torch.float32, device=rows.device) for _ in range(3))
    shifted_sum = torch.empty_like(row_max) if with_shifted_sum else None
    block = _dispatch.block_size(v, _MAX_BLOCK)[0]
    kernel_backend.launch(_ce_stats_kernel, (n,), rows, target, row_max, sum_exp, target_logit,
                           row_max if shifted_sum is None else shifted_sum, v, rows.stride(0), vocab_start,
                           WANT_SUM=with_shifted_sum, BLOCK=block, num_warps=_dispatch.num_warps(block))
    return CrossEntropyShardStats(row_max, sum_exp, target_logit, shifted_sum, v)


def cross_entropy_loss_from_stats(row_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor,
                                  shifted_sum: Optional[torch.Tensor], *, vocab_size: int,
                                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token fp32 loss from full-vocab statistics (each ``[tokens]``, already combined over shards).

    ``sum_exp`` and ``shifted_sum`` (needed only with label smoothing) must be relative to ``row_max`` (see
    ``CrossEntropyShardStats.rebase``). The target term ``(row_max - target_logit) + log(sum_exp)`` keeps full
    fp32 precision even for logits of magnitude 1e4.
    """
    log_sum_exp = torch.log(sum_exp)
    loss = (row_max - target_logit) + log_sum_exp
    if label_smoothing > 0:
        smooth_loss = log_sum_exp - shifted_sum / vocab_size  # -mean_j log p_j
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth_loss
    return loss


def cross_entropy_shard_backward(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor,
                                 sum_exp: torch.Tensor, grad_scale: torch.Tensor, *, vocab_start: int = 0,
                                 vocab_size: Optional[int] = None, label_smoothing: float = 0.0,
                                 out: Optional[torch.Tensor] = None,
                                 backend: Optional[KernelBackend] = None) -> torch.Tensor:
    """Writes ``grad_scale * (softmax - (1 - eps) * onehot(target) - eps / V)`` of one shard into ``out``.

    Args:
        logits: ``[..., V_shard]`` as given to ``cross_entropy_shard_stats``.
        target: ``[...]`` full-vocab ids.
        row_max, sum_exp: fp32 ``[tokens]`` over the FULL vocab (combined over shards), sum_exp relative to max.
        grad_scale: fp32 ``[tokens]``: the incoming loss gradient (0 for ignored tokens).
        vocab_start: full-vocab id of the shard's first entry.
        vocab_size: the full vocab V (default: the shard's own size).
        label_smoothing: eps in ``[0, 1)``.
        out: the gradient buffer ``[..., V_shard]`` written in place (default: a new tensor like the logits).
            It may be ``logits`` itself: each element is read before it is overwritten.
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").

    Returns:
        ``out``; records op ``cross_entropy_shard_backward``.
    """
    out = torch.empty_like(logits) if out is None else out
    if out.shape != logits.shape:
        raise ValueError(f"out shape {tuple(out.shape)} does not match logits shape {tuple(logits.shape)}")
    rows, target = _rows(logits), target.reshape(-1).contiguous()
    row_max, sum_exp, grad_scale = (t.reshape(-1).float().contiguous() for t in (row_max, sum_exp, grad_scale))
    if not row_max.shape == sum_exp.shape == grad_scale.shape == target.shape == rows.shape[:1]:
        raise ValueError(f"row_max {tuple(row_max.shape)}, sum_exp {tuple(sum_exp.shape)}, grad_scale "
                         f"{tuple(grad_scale.shape)} and target {tuple(target.shape)} must all have "
                         f"{rows.shape[0]} tokens (logits shape {tuple(logits.shape)})")
    vocab_size = rows.shape[-1] if vocab_size is None else vocab_size
    smooth, target_weight = label_smoothing / vocab_size, 1.0 - label_smoothing
    kernel_backend = resolve(backend)
    backend = kernel_backend.select("cross_entropy_shard_backward", logits.device,
                                    _dispatch.unsupported_dtype("logits", logits)
                                    or _dispatch.unsupported_dtype("out", out))
    buffer = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    buffer_rows = buffer.view(-1, buffer.shape[-1])  # [tokens, V_shard]
    if backend == "torch" or rows.shape[0] == 0:
        shard_backward_reference(rows, target, row_max, sum_exp, grad_scale, vocab_start, smooth, target_weight,
                                 buffer_rows)
    else:
        n, v = rows.shape
        block = _dispatch.block_size(v, _MAX_BLOCK)[0]
        kernel_backend.launch(_ce_bwd_kernel, (n, -(-v // block)), rows, target, row_max, sum_exp, grad_scale,
                              buffer_rows, v, rows.stride(0), buffer_rows.stride(0), vocab_start, smooth,
                              target_weight, BLOCK=block, num_warps=_dispatch.num_warps(block))
    return out if buffer is out else out.copy_(buffer)


class _CrossEntropy(torch.autograd.Function):
    """Saves the logits (by reference, no copy) and fp32 ``[tokens]`` max / sum_exp; no softmax buffer."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing: float, ignore_index: int, backend: KernelBackend):
        vocab = logits.shape[-1]
        stats = cross_entropy_shard_stats(logits, target, with_shifted_sum=label_smoothing > 0, backend=backend)
        loss = cross_entropy_loss_from_stats(*stats[:4], vocab_size=vocab, label_smoothing=label_smoothing)
        ignored = target.reshape(-1) == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, target, stats.row_max, stats.sum_exp, ignored)
        ctx.label_smoothing, ctx.backend = label_smoothing, backend
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, row_max, sum_exp, ignored = ctx.saved_tensors
        grad_scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
        grad = cross_entropy_shard_backward(logits, target, row_max, sum_exp, grad_scale,
                                            label_smoothing=ctx.label_smoothing, backend=ctx.backend)
        return grad, None, None, None, None


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """ValueError (CPU) or an asynchronous device assert (GPU) when a target lies outside ``[0, vocab)``."""
    valid = ((target >= 0) & (target < vocab)) | (target == ignore_index)
    if target.device.type != "cpu":
        torch._assert_async(valid.all(), f"cross_entropy target out of range [0, {vocab})")
    elif not bool(valid.all()):
        bad = target[~valid]
        raise ValueError(f"cross_entropy target must lie in [0, {vocab}) or equal ignore_index={ignore_index}, "
                         f"got values in [{int(bad.min())}, {int(bad.max())}]")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, label_smoothing: float = 0.0,
                  ignore_index: int = -100, backend: Optional[KernelBackend] = None) -> torch.Tensor:
    """Per-token cross-entropy, in blocks over the vocab (no fp32 ``[tokens, V]`` softmax is materialised).

    Records ops ``cross_entropy_shard_stats`` (forward) and ``cross_entropy_shard_backward`` (backward).

    Args:
        logits: ``[..., V]``, fp32 / bf16 / fp16; any V.
        target: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``.
        label_smoothing: eps in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.
        ignore_index: target value whose loss and gradient are 0.
        backend: the ``KernelBackend`` that chooses and records the implementation (default: mode "auto").

    Returns:
        fp32 loss with target's shape (``reduction="none"``); the logits gradient comes in the logits' dtype.
    """
    if not logits.is_floating_point() or logits.dim() == 0:
        raise ValueError(f"cross_entropy: logits must be floating-point [..., V], got dtype {logits.dtype} and "
                         f"shape {tuple(logits.shape)}")
    if logits.shape[:-1] != target.shape or logits.shape[-1] == 0:
        raise ValueError(f"cross_entropy: logits shape {tuple(logits.shape)} does not match target shape "
                         f"{tuple(target.shape)}: expected logits [*target.shape, V] with V >= 1")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cross_entropy: target must be int64 or int32, got dtype {target.dtype}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must lie in [0, 1), got {label_smoothing}")
    _check_targets(target, logits.shape[-1], ignore_index)
    return _CrossEntropy.apply(logits, target, float(label_smoothing), int(ignore_index), resolve(backend))
