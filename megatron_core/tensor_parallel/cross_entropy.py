"""Cross-entropy over logits whose vocab dim is split across tensor-parallel ranks (Megatron-LM).

No rank ever holds a full row of logits: each computes statistics of its vocab shard and two small
all-reduces over tp combine them: the max, then the target logit and sum of exponentials stacked
(plus the sum of logits with label smoothing) in one call, ``[tokens]`` each.

Label smoothing follows ``torch.nn.functional.cross_entropy``: with smoothing ``eps`` over ``V`` classes the
target distribution is ``(1 - eps) * onehot + eps / V``, so the loss is
``(1 - eps) * nll - eps * mean_j(log p_j)`` and the logits gradient ``p - (1 - eps) * onehot - eps / V``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

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
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, label_smoothing: float):
        tp_size, tp_rank = group_size(group), group_rank(group)
        vocab_per_rank = logits.shape[-1]
        vocab_size = vocab_per_rank * tp_size
        start, end = vocab_range(vocab_size, tp_rank, tp_size)
        check_ids_in_range(target, vocab_size, "cross-entropy target")

        logits_max = _all_reduce_(logits.max(dim=-1).values.float(), group, dist.ReduceOp.MAX)
        shifted = logits.float() - logits_max.unsqueeze(-1)  # [..., V/tp] fp32, a fresh tensor
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        pieces = [target_logit]
        if label_smoothing > 0:
            pieces.append(shifted.sum(dim=-1))  # for the mean log-probability
        exp_logits = shifted.exp_()
        pieces.append(exp_logits.sum(dim=-1))
        stats = _all_reduce_(torch.stack(pieces), group)  # one all-reduce for all per-token sums
        target_logit, sum_exp = stats[0], stats[-1]

        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            mean_log_probs = stats[1] / vocab_size - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_probs

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # reuses the exp buffer
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size, ctx.input_dtype = label_smoothing, vocab_size, logits.dtype
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.backward_done:
            raise RuntimeError("vocab_parallel_cross_entropy backward reuses its softmax buffer in place and "
                               "cannot run twice (retain_graph=True is not supported)")
        ctx.backward_done = True
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # [..., V/tp], written in place: p - (1 - eps) onehot - eps / V
        hit = (~outside).to(grad.dtype) * (1.0 - ctx.label_smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if ctx.label_smoothing > 0:
            grad.sub_(ctx.label_smoothing / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, *, tp_group: Optional[dist.ProcessGroup] = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split over the vocab dim.

    Args:
        vocab_parallel_logits: ``[..., V/tp]``, this rank's vocab shard (the output of a ColumnParallelLinear
            without gather_output); any float dtype, computed in fp32. Not modified.
        target: ``[...]`` int64 ids in ``[0, V)``, V the full (padded) vocab.
        tp_group: the tensor-parallel group; None means the logits hold the whole vocab.
        label_smoothing: in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.

    Returns:
        fp32 loss with the shape of ``target`` (unreduced). Its backward yields the logits gradient in the
        logits' dtype; the forward's fp32 softmax buffer is reused for it, so backward runs once.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing}")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits shape {tuple(vocab_parallel_logits.shape)} does not match target shape "
                         f"{tuple(target.shape)}: expected logits [*target.shape, V/tp]")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, label_smoothing)
