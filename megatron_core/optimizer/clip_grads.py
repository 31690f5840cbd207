"""Global gradient norm, zero counting and the inf/nan check over tp, pp and dp, counting each unique
parameter element once.

Per rank, a piece of a gradient is counted when
- its parameter is tp-partitioned (``tensor_model_parallel``), or this is tp rank 0 (replicated over tp);
- it is not the last stage's copy of a tied embedding: ``shared_embedding`` params count on the first
  pipeline stage only.
Pieces that are 1/dp shards (distributed optimizer) are summed over dp; full pieces (stage 0) are the same
on every dp rank and are not. The sum is then all-reduced over the model-parallel group (tp x pp).

Expert parameters (``is_expert``, mixture of experts) are replicated over the expert-data-parallel group
only (the expert grid is independent of tp: expert-dp may span tp ranks), so every rank's copy counts: their
shards are summed over expert-dp and the result over the expert-model-parallel group (ep x etp x pp), then
added to the dense sum. With expert tensor parallelism (etp > 1) the split ones count on every etp rank, the
fc2 bias (replicated over the etp group) on etp rank 0 only.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel.utils import group_size


def counts_once(param: nn.Parameter, state: Optional[ParallelState]) -> bool:
    """Whether this rank's copy of ``param`` contributes to norms and zero counts."""
    if state is None:
        return True
    if getattr(param, "shared_embedding", False) and not state.is_pipeline_first_stage:
        return False
    if getattr(param, "is_expert", False):  # split over the etp group or replicated over it
        return bool(getattr(param, "tensor_model_parallel", False)) or state.etp_rank == 0
    return bool(getattr(param, "tensor_model_parallel", False)) or state.tp_rank == 0


def _all_reduce(value: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None and group_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)


def reduce_over_ranks(sharded: torch.Tensor, replicated: torch.Tensor, *, dp_group, mp_group) -> torch.Tensor:
    """Sum of per-rank partial values: ``sharded`` over dp, then plus ``replicated`` over tp x pp."""
    _all_reduce(sharded, dp_group)
    total = sharded + replicated
    _all_reduce(total, mp_group)
    return total


def _square_sum(tensor: torch.Tensor) -> torch.Tensor:
    """``sum(tensor ** 2)`` as an fp32 (or fp64) 0-dim tensor: one BLAS dot, no fp64 copy of the tensor
    (relative error ~1e-7 for a few million elements, against 1e-6 for ``torch._foreach_norm``)."""
    flat = tensor.reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    return torch.dot(flat, flat)


def _sum_over_devices(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The fp64 sum on ``device`` of 0-dim tensors that may lie on several devices (host-offloaded grads)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for value in values:
        by_device.setdefault(value.device, []).append(value)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in by_device.values():
        total = total + torch.stack(group).to(device, torch.float64).sum()
    return total


def _partial_sums(grads: Sequence[tuple[torch.Tensor, bool]], device: torch.device,
                  count_zeros: bool) -> torch.Tensor:
    """``[[sum of squares, zeros] of the dp shards, [same] of the full tensors]`` in fp64 on ``device``."""
    rows = []
    for want_shard in (True, False):
        tensors = [grad for grad, is_shard in grads if is_shard == want_shard]
        squares = _sum_over_devices([_square_sum(t) for t in tensors], device)
        zeros = (_sum_over_devices([(t == 0).sum() for t in tensors], device) if count_zeros
                 else torch.zeros((), dtype=torch.float64, device=device))
        rows.append(torch.stack([squares, zeros]))
    return torch.stack(rows)  # [sharded, replicated] x [sum of squares, zeros]


def global_norm_and_zeros(grads: Sequence[tuple[torch.Tensor, bool]], *, dp_group, mp_group,
                          device: torch.device, count_zeros: bool,
                          expert_grads: Optional[Sequence[tuple[torch.Tensor, bool]]] = None,
                          expert_dp_group=None, expert_mp_group=None) -> tuple[float, Optional[int]]:
    """L2 norm (and zero count) of ``grads``: ``(grad, is_dp_shard)`` pairs this rank counts, plus the
    expert pairs ``expert_grads`` when not None (every rank must then pass a list, empty or not).

    Collectives: all-reduce (sum) over dp of the sharded part, then over ``mp_group``; with ``expert_grads``
    the same over ``expert_dp_group`` and ``expert_mp_group``.
    """
    sums = _partial_sums(grads, device, count_zeros)
    total = reduce_over_ranks(sums[0].clone(), sums[1].clone(), dp_group=dp_group, mp_group=mp_group)
    if expert_grads is not None:
        sums = _partial_sums(expert_grads, device, count_zeros)
        total = total + reduce_over_ranks(sums[0].clone(), sums[1].clone(), dp_group=expert_dp_group,
                                          mp_group=expert_mp_group)
    return math.sqrt(total[0].item()), (int(total[1].item()) if count_zeros else None)


def clip_by_norm_(grads: Sequence[torch.Tensor], *, max_norm: float, total_norm: float) -> None:
    """Scales ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1 (Megatron's rule,
    the same as ``torch.nn.utils.clip_grad_norm_``)."""
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0:
        torch._foreach_mul_(list(grads), coefficient)


def found_inf_or_nan(grads: Sequence[torch.Tensor], *, dp_group, mp_group, device: torch.device,
                     expert_mp_group=None) -> bool:
    """True if any rank's grad has an inf or nan. Collectives: all-reduce (max) over dp, ``mp_group`` and
    ``expert_mp_group`` (experts differ between the ranks of an ep group)."""
    local = torch.zeros(1, dtype=torch.float32, device=device)
    for grad in grads:
        if not torch.isfinite(grad).all():
            local.fill_(1.0)
            break
    _all_reduce(local, dp_group, dist.ReduceOp.MAX)
    _all_reduce(local, mp_group, dist.ReduceOp.MAX)
    _all_reduce(local, expert_mp_group, dist.ReduceOp.MAX)
    return bool(local.item() > 0)
