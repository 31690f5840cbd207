"""Delayed scaling's state: per FP8 linear and role (input, weight, grad_output) an amax history and the scale
the next optimizer step's GEMMs use, and the once-per-step update with its reductions.

``Fp8ScalingState`` holds, for a table of ``shape`` linears (``()`` for one layer, ``(num_experts, 2)`` for an
MoE layer's fc1 / fc2 of every global expert):

    fp8_amax_history  [*shape, 3, history_len]  persistent (checkpointed: ``STATE_BUFFERS``), most recent first
    fp8_scale         [*shape, 3]               persistent; 0 = not calibrated yet (see below)
    fp8_amax_step     [*shape, 3]               not persistent: max of the amaxes seen since the last update

Calibration: a role whose scale is still 0 (the first step; an expert that has seen no token yet) is not
quantized: its GEMM operand is the unquantized tensor while its amax is recorded (Transformer Engine's
calibration), so the first step neither depends on an arbitrary initial scale nor on the layout (a fixed scale
would quantize a dp-dependent loss scaling differently), and every later scale comes from real amaxes.

Every forward and backward of the step (micro-batches, recompute) takes the max into ``fp8_amax_step``; the
scales stay fixed for the whole step. ``update_fp8_scales`` then, once per optimizer step, all-reduces the
step amaxes with MAX over the tensor-parallel group (a split tensor's amax is the max of its shards' amaxes;
replicated tensors give the same value on every rank) and over the data x context parallel group (each
replica saw other micro-batches / sequence chunks), pushes them into the histories and recomputes
``scale = fp8_max / amax / 2**margin`` with ``amax`` the newest entry (``most_recent``) or the history's max
(``max``); a zero or non-finite amax keeps the previous scale (0 before the first real amax), one whose scale
overflows gets fp32's max.
Both groups together are every rank of a pipeline stage, so the MoE table (each rank fills the rows of its own
experts, zeros elsewhere) comes out whole and identical on every rank: replicated over tp, dp, cp and ep,
like the other state buffers, and independent of the layout.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.fp8.config import Fp8Config
from megatron_core.fp8.formats import ROLE_INDEX, ROLES, role_format
from megatron_core.fp8.quantize import FP32_MAX

Index = Union[tuple, tuple[torch.Tensor, ...]]


class Fp8ScalingState(nn.Module):
    """The delayed-scaling buffers of ``shape`` linears (see the module docstring). No collective."""

    def __init__(self, config: Fp8Config, shape: Sequence[int] = (), device=None) -> None:
        super().__init__()
        if config.fp8_recipe != "delayed":
            raise ValueError(f"Fp8ScalingState is the delayed recipe's state; fp8_recipe is {config.fp8_recipe!r} "
                             "(current-scaling recipes keep none)")
        self.config, self.shape = config, tuple(shape)
        device = None if device is not None and torch.device(device).type == "meta" else device
        full = (*self.shape, len(ROLES))
        self.register_buffer("fp8_amax_history", torch.zeros(*full, config.fp8_amax_history_len, device=device))
        self.register_buffer("fp8_scale", torch.zeros(*full, device=device))
        self._ready_version: Optional[int] = None
        self.register_buffer("fp8_amax_step", torch.zeros(*full, device=device), persistent=False)
        self.amax_step_cleared_version = self.fp8_amax_step._version  # no amax recorded since (fp8_param_gather)

    def fp8_max(self) -> torch.Tensor:
        """``[3]`` the largest finite value of each role's format."""
        return torch.tensor([role_format(self.config.fp8_format, r).max for r in ROLES],
                            dtype=torch.float32, device=self.fp8_scale.device)

    def follow(self, device: torch.device) -> None:
        """Moves the buffers to the compute ``device`` if they are elsewhere (a meta-device build makes them on
        the CPU, like the router's expert bias), so the update's all-reduces run on the groups' device."""
        if self.fp8_scale.device != device:
            self.to(device)
            self._ready_version = None

    def ready(self) -> Optional[torch.Tensor]:
        """None when every scale is set (checked once per change of ``fp8_scale``: its version counter), else the
        bool mask ``[*shape, 3]`` of the calibrated ones."""
        version = self.fp8_scale._version
        if self._ready_version == version:
            return None
        mask = self.fp8_scale > 0
        if bool(mask.all()):
            self._ready_version = version
            return None
        return mask

    def view(self, index: Index = ()) -> "ScalingView":
        """The scales and amax slots of the linears at ``index`` of ``shape`` (ints, or index tensors)."""
        return ScalingView(self, tuple(index))

    @torch.no_grad()
    def advance(self, step_amax: torch.Tensor) -> None:
        """Pushes ``step_amax`` ``[*shape, 3]`` (already reduced) into the history, recomputes the scales and
        clears the step's amaxes."""
        history = torch.cat([step_amax[..., None].to(self.fp8_amax_history), self.fp8_amax_history[..., :-1]], -1)
        self.fp8_amax_history.copy_(history)
        amax = history[..., 0] if self.config.fp8_amax_compute_algo == "most_recent" else history.amax(-1)
        scale = (self.fp8_max() / amax) / (2.0 ** self.config.fp8_margin)
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
        usable = (amax > 0) & torch.isfinite(amax)
        self.fp8_scale.copy_(torch.where(usable, scale, self.fp8_scale))
        self.fp8_amax_step.zero_()
        self.amax_step_cleared_version = self.fp8_amax_step._version

    def extra_repr(self) -> str:
        return f"shape={self.shape}, history_len={self.config.fp8_amax_history_len}"


@dataclasses.dataclass(frozen=True)
class ScalingView:
    """The part of an ``Fp8ScalingState`` one GEMM call uses (a linear, or a grouped GEMM's experts)."""
    state: Fp8ScalingState
    index: Index = ()

    def ready(self, role: str) -> Optional[torch.Tensor]:
        """None when ``role``'s scales are all set, else the bool mask (0-dim or one per index entry)."""
        mask = self.state.ready()
        return None if mask is None else mask[(*self.index, ROLE_INDEX[role])]

    def scale(self, role: str) -> torch.Tensor:
        """fp32 scale(s) of ``role``: 0-dim, or one per index entry (a copy: the buffer changes at the update)."""
        return self.state.fp8_scale[(*self.index, ROLE_INDEX[role])].clone()

    @torch.no_grad()
    def record(self, role: str, amax: torch.Tensor) -> None:
        """Takes the max of ``amax`` (this rank's, unreduced) into the step's amax of ``role``."""
        where = (*self.index, ROLE_INDEX[role])
        step = self.state.fp8_amax_step
        step[where] = torch.maximum(step[where], amax.to(step))


def scaling_states(chunks: Sequence[nn.Module]) -> list[Fp8ScalingState]:
    """Every ``Fp8ScalingState`` of the model chunks (wrapped or not), in module order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, Fp8ScalingState)]


def _all_reduce_max(value: torch.Tensor, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)


@torch.no_grad()
def update_fp8_scales(model_chunks: Sequence[nn.Module], parallel_state) -> None:
    """Once per optimizer step (every rank calls it, after the backward passes; called before ``optimizer.step()``
    it lets ``fp8_param_gather`` gather the weights in FP8 with the new scales, after it they are gathered exactly):
    reduces the step's amaxes of every delayed-scaling state with MAX over ``tp_group`` and ``dp_cp_group`` (two
    all-reduces of one flat tensor; none without FP8 delayed scaling) and advances the histories and scales. Model
    chunks may be wrapped (``DistributedDataParallel``): their ``modules()`` include the wrapped model's."""
    states = scaling_states(model_chunks)
    if not states:
        return
    flat = torch.cat([s.fp8_amax_step.reshape(-1) for s in states])
    _all_reduce_max(flat, parallel_state.tp_group)
    _all_reduce_max(flat, parallel_state.dp_cp_group)
    for state, amax in zip(states, flat.split([s.fp8_amax_step.numel() for s in states])):
        state.advance(amax.view_as(state.fp8_amax_step))


__all__ = ["Fp8ScalingState", "ScalingView", "scaling_states", "update_fp8_scales"]
