"""``--fp8-param-gather``, the FP8 side: which weights ZeRO may gather as FP8 bytes, and the per-tensor scale each
is quantized with, which the FP8 linear then quantizes the gathered weight with.

A layer built with ``Fp8Config.fp8_param_gather`` and a per-tensor recipe (``tensorwise``, ``delayed``) tags
its 2-D weight with an ``Fp8GatherSpec`` (``tag_weight``); block recipes (blockwise, mxfp8), bf16 layers
(``first_last_layers_bf16``: their ``fp8`` is None) and grouped expert weights are never tagged. The ZeRO
gather (``megatron_core.distributed.fp8_param_gather``: after a ZeRO-1/2 step, or a ZeRO-3 unit's gather before
its forward and backward) quantizes each rank's shard of a tagged weight with the scale the layer would use on
the whole weight, writes the other ranks' FP8 values dequantized into the parameter and leaves a
``GatheredFp8Weight`` (that scale and the weight's global amax) on it (``param.fp8_gathered``). No FP8 copy
is kept: quantizing a dequantized value ``q / scale`` again with ``scale`` gives ``q`` back (the bf16 rounding
of the dequantized value, at most 2^-8 relative, is far below E4M3's half spacing of at least 2^-5), and this
rank's own slots hold the exact values it quantized, so the layer's bytes are the gathered ones.
``gathered_weight`` hands the entry to ``fp8_linear`` when still valid:

- the parameter was not written in place since (``param._version``; every gather drops the entry before the
  new values arrive, and ``Bucket.load_full`` drops it when it writes a gathered ZeRO-3 parameter),
- the layer's plan is the one of the spec (same config, same delayed-scaling slot, same tp reduction),
- delayed scaling: the scale buffer was not changed since (``fp8_scale``'s identity and version counter).

An entry that fails the last two checks while the parameter still holds the dequantized values raises (their
own amax would give another scale). No collective here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from megatron_core.fp8.config import Fp8Config
from megatron_core.fp8.formats import Fp8Format, role_format
from megatron_core.fp8.quantize import scale_from_amax
from megatron_core.fp8.state import Fp8ScalingState, ScalingView

PER_TENSOR_RECIPES = ("tensorwise", "delayed")
"""Recipes whose weight has one scale, known before the gather (delayed) or from an all-reduced amax."""


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8GatherSpec:
    """How a tagged weight is quantized: ``config`` (its layer's), ``scaling`` (the delayed recipe's slot, else
    None) and ``amax_group``: the tp group the layer all-reduces the weight's amax over (None: not split)."""
    config: Fp8Config
    scaling: Optional[ScalingView] = None
    amax_group: object = None

    @property
    def fmt(self) -> Fp8Format:
        return role_format(self.config.fp8_format, "weight")

    def usable_now(self) -> bool:
        """Whether the scale the next forward uses is known now: always for tensorwise; for delayed once the
        slot is calibrated and no amax was recorded since the last ``update_fp8_scales`` (else the update would
        change it after the gather). The same answer on every rank (the state is replicated)."""
        if self.scaling is None:
            return True
        state = self.scaling.state
        return state.fp8_amax_step._version == state.amax_step_cleared_version and self.calibrated()

    def calibrated(self) -> bool:
        """Whether the weight's scale is set: always for tensorwise; for delayed once the slot is calibrated. What a
        ZeRO-3 unit gather needs (the scale changes only in ``update_fp8_scales``, between steps, when no unit is
        gathered). The same answer on every rank."""
        if self.scaling is None:
            return True
        ready = self.scaling.ready("weight")
        return ready is None or bool(ready.all())

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        """fp32 0-dim scale of the weight: delayed, the state's; tensorwise, from the global ``amax``."""
        if self.scaling is not None:
            return self.scaling.scale("weight")
        return scale_from_amax(amax, self.fmt, self.config.fp8_margin)

    def scale_key(self) -> Optional[tuple[int, int]]:
        """Identifies the delayed scale buffer's contents (None for tensorwise)."""
        if self.scaling is None:
            return None
        scale = self.scaling.state.fp8_scale
        return id(scale), scale._version

    def serves(self, plan) -> bool:
        """Whether ``plan`` (an ``Fp8Plan``) quantizes the weight as this spec does."""
        split = "weight" in plan.split_roles
        return (plan.config == self.config and plan.scaling == self.scaling
                and split == (self.amax_group is not None) and (not split or plan.tp_group is self.amax_group))


@dataclasses.dataclass(frozen=True, eq=False)
class GatheredFp8Weight:
    """What the gather left on a weight: the fp32 0-dim ``scale`` it was quantized with, its global ``amax``,
    and what they are valid for."""
    scale: torch.Tensor
    amax: torch.Tensor
    spec: Fp8GatherSpec
    param_version: int
    scale_key: Optional[tuple[int, int]]


def tag_weight(weight: nn.Parameter, fp8: Optional[Fp8Config], state: Optional[Fp8ScalingState], *,
               amax_group=None) -> None:
    """Marks ``weight`` (``[N, K]``, used whole by one FP8 linear) for the FP8 gather when ``fp8`` asks for it
    with a per-tensor recipe. ``amax_group``: the tp group the layer reduces the weight's amax over (tp > 1)."""
    if fp8 is None or not fp8.fp8_param_gather or fp8.fp8_recipe not in PER_TENSOR_RECIPES or weight.dim() != 2:
        return
    weight.fp8_gather_spec = Fp8GatherSpec(fp8, state.view() if state is not None else None, amax_group)


def gather_spec(param: nn.Parameter) -> Optional[Fp8GatherSpec]:
    return getattr(param, "fp8_gather_spec", None)


def drop_gathered(param: nn.Parameter) -> None:
    """Forgets the parameter's gathered scale (its values are about to change)."""
    param.fp8_gathered = None


def keep_gathered(param: nn.Parameter, scale: torch.Tensor, amax: torch.Tensor, spec: Fp8GatherSpec) -> None:
    param.fp8_gathered = GatheredFp8Weight(scale, amax, spec, param._version, spec.scale_key())


@torch.compiler.disable
def gathered_weight(weight: torch.Tensor, plan) -> Optional[GatheredFp8Weight]:
    """The valid gather entry of ``weight`` for ``plan`` (module docstring), or None: the layer takes the
    weight's scale itself. Raises RuntimeError when the parameter holds the gather's dequantized values but the
    entry no longer fits (a changed delayed scale, another plan)."""
    entry = getattr(weight, "fp8_gathered", None)
    if entry is None or entry.param_version != weight._version:
        return None
    if not entry.spec.serves(plan) or entry.scale_key != entry.spec.scale_key():
        raise RuntimeError(
            f"fp8_param_gather: a weight {tuple(weight.shape)} was gathered in FP8 for another scale or plan "
            f"(recipe {entry.spec.config.fp8_recipe!r}); call update_fp8_scales before optimizer.step() (never "
            "between the step and the next forward) and use a tagged weight only in its own layer")
    return entry


__all__ = ["Fp8GatherSpec", "GatheredFp8Weight", "PER_TENSOR_RECIPES", "tag_weight", "gather_spec",
           "drop_gathered", "keep_gathered", "gathered_weight"]
