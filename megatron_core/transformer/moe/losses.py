"""The router's auxiliary losses and how their gradient enters backward.

Every loss here is a *partial* sum when the tokens of one sequence are split over ranks (sequence parallelism):
each rank computes its tokens' share with the global token counts, so the shares summed over the split group
equal the single-process loss and each rank's backward gives exactly its tokens' gradient.

The losses never reach the language-model loss tensor: ``attach_loss`` returns its input unchanged and, in
backward, adds ``scale * d(loss)`` (Megatron's ``MoEAuxLossAutoScaler``), so an MoE layer on any pipeline
stage trains its router without passing the loss down the pipeline. ``scale`` must be what the schedule applies
to the language-model loss before backward: ``1 / num_microbatches`` times the fp16 loss scale
(``set_aux_loss_scale``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce_no_grad(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """A sum over ``group`` of a tensor that carries no gradient (token counts)."""
    if group is not None and dist.get_world_size(group) > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
    return tensor


def switch_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, *, topk: int, coeff: float,
                    split_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Switch/GShard load balancing: ``coeff * E * sum_e f_e P_e`` over the micro-batch's tokens.

    Args:
        scores: ``[T, E]`` normalized router scores of this rank's T tokens (differentiable).
        routing_map: ``[T, E]`` bool, the top-k selection (before capacity dropping).
        split_group: the group the sequence is split over (sequence parallelism) or None.

    ``f_e`` is the share of the (token, expert) assignments that go to e and ``P_e`` the mean score of e, both
    over all tokens of the split group; this rank returns its partial sum. Collective: an all-reduce (sum,
    no gradient) of the per-expert counts over ``split_group`` in forward, nothing in backward.
    """
    counts = _all_reduce_no_grad(routing_map.sum(dim=0).to(scores.dtype), split_group)  # [E]
    total = scores.shape[0] * (dist.get_world_size(split_group) if split_group is not None else 1)
    num_experts = scores.shape[1]
    return (scores.sum(dim=0) * counts).sum() * (num_experts * coeff / (topk * total * total))


def global_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, *, topk: int, coeff: float,
                    split_group: Optional[dist.ProcessGroup], dp_group: Optional[dist.ProcessGroup],
                    running: "GlobalCounts") -> torch.Tensor:
    """Megatron-LM's ``global_aux_loss``: the Switch loss with the expert counts of the whole global batch so
    far, i.e. summed over the ranks splitting the sequence and the data-parallel replicas and averaged over the
    step's micro-batches (``running`` accumulates them; ``GlobalCounts.reset`` after each optimizer step).

    ``scores``, ``routing_map``: ``[T, E]`` of this rank's tokens. Returns this rank's partial sum (``P_e`` over
    its tokens, with the global token total). Collective: all-reduces (sum, no gradient) of the counts over
    ``split_group`` and ``dp_group`` in forward; nothing in backward.
    """
    counts = routing_map.sum(dim=0).to(torch.float64)
    counts = _all_reduce_no_grad(_all_reduce_no_grad(counts, split_group), dp_group)             # [E]
    ranks = (dist.get_world_size(split_group) if split_group is not None else 1) * (
        dist.get_world_size(dp_group) if dp_group is not None else 1)
    averaged = running.add(counts).to(scores.dtype)
    total, num_experts = scores.shape[0] * ranks, scores.shape[1]
    return (scores.sum(dim=0) * averaged).sum() * (num_experts * coeff / (topk * total * total))


class GlobalCounts:
    """The running expert counts of ``global_aux_loss`` over one optimizer step's micro-batches."""

    def __init__(self) -> None:
        self.sum: Optional[torch.Tensor] = None
        self.steps = 0

    def add(self, counts: torch.Tensor) -> torch.Tensor:
        """Adds one micro-batch's global counts ``[E]``; returns their running mean."""
        self.sum = counts.clone() if self.sum is None else self.sum + counts
        self.steps += 1
        return self.sum / self.steps

    def reset(self) -> None:
        self.sum, self.steps = None, 0


def sequence_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, *, batch_size: int, topk: int, coeff: float,
                      split_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Per-sequence load balancing (DeepSeek-V2): the Switch loss of each sequence, averaged over the batch.

    Args:
        scores, routing_map: ``[s_local * b, E]`` in the ``[s, b]`` order of the hidden states.
        batch_size: b.

    Collective: an all-reduce (sum, no gradient) of the per-sequence counts ``[b, E]`` over ``split_group``.
    """
    num_experts = scores.shape[1]
    seq_local = scores.shape[0] // batch_size
    seq_total = seq_local * (dist.get_world_size(split_group) if split_group is not None else 1)
    counts = routing_map.view(seq_local, batch_size, num_experts).sum(dim=0).to(scores.dtype)  # [b, E]
    counts = _all_reduce_no_grad(counts, split_group)
    f = counts * (num_experts / (seq_total * topk))                                       # [b, E]
    p = scores.view(seq_local, batch_size, num_experts).sum(dim=0) / seq_total             # [b, E]
    return (f * p).sum(dim=1).mean() * coeff


def z_loss(logits: torch.Tensor, *, coeff: float, split_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``coeff * mean_tokens(logsumexp(logits)^2)``, this rank's partial sum.

    ``logits``: ``[T, E]``. No collective (the token total is T times the split group's size).
    """
    total = logits.shape[0] * (dist.get_world_size(split_group) if split_group is not None else 1)
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / total)


class _AttachLoss(torch.autograd.Function):
    """Identity on ``x``; backward also sends ``scale`` into ``loss`` (no collective)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        loss_grad = torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=grad.device)
        return grad, loss_grad, None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``x`` unchanged; in backward, ``loss`` gets the gradient ``scale`` (as if ``scale * loss`` were added
    to the model's loss). Without autograd (evaluation), returns ``x``."""
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return x
    return _AttachLoss.apply(x, loss, scale)
