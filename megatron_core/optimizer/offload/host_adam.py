"""Adam(W) on host tensors: ``adamw_`` repeats ``torch.optim.AdamW``'s single-tensor math op for op (so an update
streamed chunk by chunk equals the in-memory optimizer bit for bit in fp32), ``fused_adamw_`` is the fast
path (torch's fused CPU kernel: one pass over memory instead of eight).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamHyper:
    """One param group's Adam settings at this step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@torch.no_grad()
def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
           step: int, hyper: AdamHyper) -> None:
    """One AdamW update in place, exactly as ``torch.optim.adam._single_tensor_adam`` (decoupled decay, no
    amsgrad, not capturable). ``step`` is the step count after this update (1 for the first).

    Args:
        param, grad, exp_avg, exp_avg_sq: fp32 tensors of one shape (any slice of a parameter's elements).
    """
    if hyper.weight_decay != 0:
        param.mul_(1 - hyper.lr * hyper.weight_decay)
    exp_avg.lerp_(grad, 1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1 - hyper.beta2)
    step_f = float(step)
    bias_correction1 = 1 - hyper.beta1 ** step_f
    bias_correction2 = 1 - hyper.beta2 ** step_f
    step_size = hyper.lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(hyper.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


@torch.no_grad()
def fused_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], *, step: int, hyper: AdamHyper) -> None:
    """The same update with torch's fused kernel (``torch._fused_adamw_``, vectorized on CPU): one read and
    write of each tensor. Equal to ``adamw_`` to fp32 rounding (not bit for bit: the kernel orders the
    arithmetic differently)."""
    steps = [torch.tensor(float(step)) for _ in params]
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=hyper.lr, beta1=hyper.beta1,
                        beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps, amsgrad=False,
                        maximize=False)
