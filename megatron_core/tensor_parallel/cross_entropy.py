"""Cross-entropy over logits whose vocab dim is split across tensor-parallel ranks (Megatron-LM).

No rank ever holds a full row of logits. Each rank reads its vocab shard once with the fused kernel
``kernels.cross_entropy_shard_stats`` (per-token max, sum of exp relative to that max, target logit, and the
sum of ``logit - max`` with label smoothing; all fp32 ``[tokens]``), then two small all-reduces over tp combine
them: the max, then the target logit and the sums rebased to the global max, stacked in one call. The backward,
``kernels.cross_entropy_shard_backward``, recomputes the softmax from the
logits and writes the gradient straight into a fresh buffer of the logits' dtype: no ``[tokens, V/tp]`` fp32
softmax is kept between forward and backward.

The kernels run as Triton when it can run for the logits (CUDA, or CPU under ``TRITON_INTERPRET=1``) and as
their torch reference otherwise; ``kernel_backend.last["cross_entropy_shard_stats"]`` says which ran.

Label smoothing follows ``torch.nn.functional.cross_entropy``: with smoothing ``eps`` over ``V`` classes the
target distribution is ``(1 - eps) * onehot + eps / V``, so the loss is
``(1 - eps) * nll - eps * mean_j(log p_j)`` and the logits gradient ``p - (1 - eps) * onehot - eps / V``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core.tensor_parallel.utils import check_ids_in_range, group_rank, group_size, vocab_range


def _all_reduce_(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a tensor this module owns (a no-op without tensor parallelism)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: an all-reduce (max) of the row maxima, then one (sum) of the stacked per-token sums.

    Backward: no communication; the gradient of each shard is local (softmax minus the smoothed target).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, label_smoothing: float, kernel_backend):
        import kernels  # lazily: importing megatron_core never imports Triton
        tp_size, tp_rank = group_size(group), group_rank(group)
        vocab_size = logits.shape[-1] * tp_size
        start, _ = vocab_range(vocab_size, tp_rank, tp_size)
        check_ids_in_range(target, vocab_size, "cross-entropy target")

        stats = kernels.cross_entropy_shard_stats(logits, target, vocab_start=start,
                                                  with_shifted_sum=label_smoothing > 0,
                                                  backend=kernel_backend)  # [tokens] each, fp32
        row_max = _all_reduce_(stats.row_max.clone(), group, dist.ReduceOp.MAX)
        stats = stats.rebase(row_max)  # sums relative to the global max: they now add up over shards
        pieces = [stats.target_logit, stats.sum_exp] + ([stats.shifted_sum] if label_smoothing > 0 else [])
        summed = _all_reduce_(torch.stack(pieces), group)  # one all-reduce for all per-token sums
        shifted_sum = summed[2] if label_smoothing > 0 else None
        loss = kernels.cross_entropy_loss_from_stats(row_max, summed[1], summed[0], shifted_sum,
                                                     vocab_size=vocab_size, label_smoothing=label_smoothing)
        ctx.save_for_backward(logits, target, row_max, summed[1])
        ctx.label_smoothing, ctx.vocab_size, ctx.vocab_start = label_smoothing, vocab_size, start
        ctx.backward_done, ctx.kernel_backend = False, kernel_backend
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.backward_done:
            raise RuntimeError("vocab_parallel_cross_entropy backward cannot run twice (retain_graph=True is "
                               "not supported)")
        ctx.backward_done = True
        import kernels
        logits, target, row_max, sum_exp = ctx.saved_tensors
        grad = kernels.cross_entropy_shard_backward(  # [..., V/tp] in the logits' dtype, written in place
            logits, target, row_max, sum_exp, grad_loss, vocab_start=ctx.vocab_start, vocab_size=ctx.vocab_size,
            label_smoothing=ctx.label_smoothing, backend=ctx.kernel_backend)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, *, tp_group: Optional[dist.ProcessGroup] = None,
    label_smoothing: float = 0.0, kernel_backend=None,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split over the vocab dim.

    Args:
        vocab_parallel_logits: ``[..., V/tp]``, this rank's vocab shard (the output of a ColumnParallelLinear
            without gather_output); any float dtype, computed in fp32. Not modified.
        target: ``[...]`` int64 ids in ``[0, V)``, V the full (padded) vocab.
        tp_group: the tensor-parallel group; None means the logits hold the whole vocab.
        label_smoothing: in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.
        kernel_backend: the ``kernels.KernelBackend`` that chooses and records the implementation (a model
            passes its layout's ``ParallelState.kernel_backend``; default: a fresh "auto" one).

    Returns:
        fp32 loss with the shape of ``target`` (unreduced). Its backward yields the logits gradient in the
        logits' dtype, computed from the saved logits and fp32 ``[tokens]`` statistics; it runs once.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing}")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits shape {tuple(vocab_parallel_logits.shape)} does not match target shape "
                         f"{tuple(target.shape)}: expected logits [*target.shape, V/tp]")
    from kernels import KernelBackend  # lazily: importing megatron_core never imports Triton
    kernel_backend = kernel_backend if kernel_backend is not None else KernelBackend()
    if group_size(tp_group) == 1 and _native_is_faster(vocab_parallel_logits, kernel_backend):
        # one rank holds the whole vocab and the Triton kernel cannot run: torch's fused log-softmax + nll is
        # the fastest path (its backward keeps the fp32 log-probabilities, as large as the fp32 logits)
        check_ids_in_range(target, vocab_parallel_logits.shape[-1], "cross-entropy target")
        logits = vocab_parallel_logits.reshape(-1, vocab_parallel_logits.shape[-1])
        return F.cross_entropy(logits, target.reshape(-1), reduction="none",
                               label_smoothing=label_smoothing).view(target.shape)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, label_smoothing, kernel_backend)


def _native_is_faster(logits: torch.Tensor, kernel_backend) -> bool:
    """fp32 logits where Triton does not run (recorded as the kernels' "torch" backend)."""
    if logits.dtype != torch.float32 or kernel_backend.would_run_triton(logits.device):
        return False
    kernel_backend.select("cross_entropy_shard_stats", logits.device)
    return True
