"""``--fp8-param-gather``, the FP8 side: which weights ZeRO may gather as FP8 bytes, and the scale(s) each is
quantized with, which the FP8 linear then quantizes the gathered weight with.

A layer built with ``Fp8Config.fp8_param_gather`` and a per-tensor recipe (``tensorwise``, ``delayed``) or
``blockwise`` tags its 2-D weight with an ``Fp8GatherSpec`` (``tag_weight``); so do the routed experts
(``LocalExperts``): each expert's fc1 / fc2 weight ``[N, K]`` with its own scale (``index``: its row of the
delayed table, ``amax_group`` the etp group when split). Not tagged: mxfp8 (``GATHERED_RECIPES``) and bf16
layers (``first_last_layers_bf16``: their ``fp8`` is None). The ZeRO gather
(``megatron_core.distributed.fp8_param_gather``: after a ZeRO-1/2 step, or a ZeRO-3 unit's gather before its
forward and backward) quantizes each rank's shard of a tagged weight with the scale the layer would use on the
whole weight (blockwise: each element with its 128x128 block's, from the per-block amaxes all-reduced over the
group: ``piece_amax``, ``piece_scale``), writes the other ranks' FP8 values dequantized into the parameter and
leaves a ``GatheredFp8Weight`` (that scale, or the ``[*blocks]`` scales, and the global amax) on it
(``param.fp8_gathered``). No FP8 copy is kept: quantizing a dequantized value ``q / scale`` again with
``scale`` gives ``q`` back (the bf16 rounding of the dequantized value, at most 2^-8 relative, is far below
E4M3's half spacing of at least 2^-5), and this rank's own slots hold the exact values it quantized, so the
layer's bytes are the gathered ones (blockwise: W^T's blocks are W's, so the dgrad's bytes too).
``gathered_weight`` hands the entry to ``fp8_linear`` when still valid (``gathered_experts``: the entries of a
grouped expert GEMM's weights, stacked):

- the parameter was not written in place since (``param._version``; every gather drops the entry before the
  new values arrive, and ``Bucket.load_full`` drops it when it writes a gathered ZeRO-3 parameter),
- the layer's plan is the one of the spec (same config, same delayed-scaling slot, same tp reduction),
- delayed scaling: the scale buffer was not changed since (``fp8_scale``'s identity and version counter).

An entry that fails the last two checks while the parameter still holds the dequantized values raises (their
own amax would give another scale). No collective here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core.fp8.config import Fp8Config
from megatron_core.fp8.formats import Fp8Format, role_format
from megatron_core.fp8.quantize import BLOCKWISE_WEIGHT_BLOCK, abs_amax, block_amax, block_scale, scale_from_amax
from megatron_core.fp8.state import Fp8ScalingState, ScalingView
from megatron_core.utils.compile_guard import eager_when_compiled

PER_TENSOR_RECIPES = ("tensorwise", "delayed")
"""Recipes whose weight has one scale, known before the gather (delayed) or from an all-reduced amax."""
GATHERED_RECIPES = (*PER_TENSOR_RECIPES, "blockwise")
"""Recipes whose weights ``tag_weight`` tags: blockwise has one scale per 128x128 block, from the block's
all-reduced amax (``quantize.block_scale``). Not mxfp8: its dgrad quantizes W^T in 1x32 blocks along the other
dim, which the gathered row-block bytes do not give back bit for bit."""


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8GatherSpec:
    """How a tagged weight is quantized: ``config`` (its layer's), ``scaling`` (the delayed recipe's slot, else
    None), ``amax_group``: the tp group the layer all-reduces the weight's amax over (None: not split; always
    None for blockwise, whose blocks are local to the tp shard) and ``shape``: the weight's ``[N, K]``."""
    config: Fp8Config
    scaling: Optional[ScalingView] = None
    amax_group: object = None
    shape: tuple = ()

    @property
    def fmt(self) -> Fp8Format:
        return role_format(self.config.fp8_format, "weight")

    @property
    def blocks(self) -> tuple:
        """Blockwise: the weight's block grid ``(ceil(N/128), ceil(K/128))``; per-tensor recipes: ``()``."""
        if self.config.fp8_recipe != "blockwise":
            return ()
        return tuple(-(-n // b) for n, b in zip(self.shape, BLOCKWISE_WEIGHT_BLOCK))

    def amax_numel(self) -> int:
        """Amaxes the gather all-reduces for the weight: 1, or one per block."""
        return math.prod(self.blocks)

    def _cover(self, start: int, n: int) -> tuple[int, int, int]:
        """The block rows covering the flat elements ``start ... start + n - 1`` of the weight: ``(first block
        row, elements before ``start`` from that block row's first element, whole weight rows covering them)``."""
        cols, rows_per_block = self.shape[1], BLOCKWISE_WEIGHT_BLOCK[0]
        first = start // cols // rows_per_block
        lead = start - first * rows_per_block * cols
        return first, lead, -(-(lead + n) // cols)

    def piece_amax(self, values: torch.Tensor, start: int) -> torch.Tensor:
        """``[amax_numel()]`` fp32: the amax of a piece (flat ``values``, from flat element ``start`` of the
        weight): per tensor its ``abs_amax``; blockwise each block's over the piece's elements (``block_amax``
        of the piece zero-padded to whole rows: 0 for blocks it misses), so the MAX over the pieces is
        ``block_amax`` of the whole weight."""
        if not self.blocks:
            return abs_amax(values).reshape(1)
        first, lead, rows = self._cover(start, values.numel())
        padded = F.pad(values.detach().reshape(-1), (lead, rows * self.shape[1] - lead - values.numel()))
        part = block_amax(padded.view(rows, self.shape[1]), BLOCKWISE_WEIGHT_BLOCK)
        amax = torch.zeros(self.blocks, dtype=torch.float32, device=values.device)
        amax[first:first + part.shape[0]] = part
        return amax.reshape(-1)

    def piece_scale(self, scale: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """The scale of each element of a piece of ``n`` elements from flat element ``start``: the 0-dim
        per-tensor ``scale``, or fp32 ``[n]`` (blockwise: its block's of ``scale`` ``[*blocks]``)."""
        if not self.blocks:
            return scale
        first, lead, rows = self._cover(start, n)
        (br, bc), cols = BLOCKWISE_WEIGHT_BLOCK, self.shape[1]
        part = scale[first:first + -(-rows // br)].repeat_interleave(br, 0)[:rows]
        return part.repeat_interleave(bc, 1)[:, :cols].reshape(-1)[lead:lead + n]

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
        """fp32 scale of the weight from its global ``amax`` (``[amax_numel()]``): delayed, the state's (0-dim);
        tensorwise, 0-dim from ``amax``; blockwise, ``[*blocks]`` (``quantize.block_scale``, as the layer)."""
        if self.scaling is not None:
            return self.scaling.scale("weight")
        if self.blocks:
            return block_scale(amax.reshape(self.blocks), self.fmt)
        return scale_from_amax(amax.reshape(()), self.fmt, self.config.fp8_margin)

    def scale_key(self) -> Optional[tuple[int, int]]:
        """Identifies the delayed scale buffer's contents (None for tensorwise)."""
        if self.scaling is None:
            return None
        scale = self.scaling.state.fp8_scale
        return id(scale), scale._version

    def serves(self, plan) -> bool:
        """Whether ``plan`` (an ``Fp8Plan``) quantizes the weight as this spec does."""
        if self.blocks:  # blocks local to the tp shard: no amax reduction to match
            return plan.config == self.config
        split = "weight" in plan.split_roles
        return (plan.config == self.config and plan.scaling == self.scaling
                and split == (self.amax_group is not None) and (not split or plan.tp_group is self.amax_group))


@dataclasses.dataclass(frozen=True, eq=False)
class GatheredFp8Weight:
    """What the gather left on a weight: the fp32 ``scale`` it was quantized with and its global ``amax`` (0-dim;
    blockwise ``[*spec.blocks]``), and what they are valid for."""
    scale: torch.Tensor
    amax: torch.Tensor
    spec: Fp8GatherSpec
    param_version: int
    scale_key: Optional[tuple[int, int]]


def tag_weight(weight: nn.Parameter, fp8: Optional[Fp8Config], state: Optional[Fp8ScalingState], *,
               amax_group=None, index: tuple = ()) -> None:
    """Marks ``weight`` (``[N, K]``, used whole by one FP8 linear) for the FP8 gather when ``fp8`` asks for it
    with a per-tensor or the blockwise recipe. ``amax_group``: the tp group the layer reduces the weight's amax
    over (tp > 1; ignored for blockwise); ``index``: the weight's linear in ``state``'s table (an expert's
    ``(global id, fc)``)."""
    if fp8 is None or not fp8.fp8_param_gather or fp8.fp8_recipe not in GATHERED_RECIPES or weight.dim() != 2:
        return
    amax_group = amax_group if fp8.fp8_recipe in PER_TENSOR_RECIPES else None
    weight.fp8_gather_spec = Fp8GatherSpec(fp8, state.view(index) if state is not None else None, amax_group,
                                           tuple(weight.shape))


def gather_spec(param: nn.Parameter) -> Optional[Fp8GatherSpec]:
    return getattr(param, "fp8_gather_spec", None)


def drop_gathered(param: nn.Parameter) -> None:
    """Forgets the parameter's gathered scale (its values are about to change)."""
    param.fp8_gathered = None


def keep_gathered(param: nn.Parameter, scale: torch.Tensor, amax: torch.Tensor, spec: Fp8GatherSpec) -> None:
    param.fp8_gathered = GatheredFp8Weight(scale, amax, spec, param._version, spec.scale_key())


@eager_when_compiled
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


@dataclasses.dataclass(frozen=True, eq=False)
class GatheredExperts:
    """The gather entries of a grouped GEMM's ``E`` expert weights: ``scale`` and ``amax`` fp32 ``[E]`` (blockwise
    ``[E, *blocks]``; 1 and 0 for an expert gathered plainly) and ``mask`` bool ``[E]``, the experts gathered in
    FP8 (None: all)."""
    scale: torch.Tensor
    amax: torch.Tensor
    mask: Optional[torch.Tensor] = None


@eager_when_compiled
def gathered_experts(weights: Sequence[torch.Tensor], plan, expert_ids: Sequence[int],
                     fc: int) -> Optional[GatheredExperts]:
    """The valid gather entries (``gathered_weight``) of the weights ``[N, K]`` of experts ``expert_ids`` (global
    ids, one per weight) that a grouped GEMM stacks to ``[E, N, K]`` under ``plan`` (its scaling view indexes
    every expert's row of ``fc``); None when no weight has one. Raises as ``gathered_weight``. No collective."""
    entries = []
    for weight, expert_id in zip(weights, expert_ids):
        own = plan if plan.scaling is None else dataclasses.replace(
            plan, scaling=plan.scaling.state.view((expert_id, fc)))
        entries.append(gathered_weight(weight, own))
    if all(entry is None for entry in entries):
        return None
    some = next(entry for entry in entries if entry is not None)
    one, zero = torch.ones_like(some.scale, dtype=torch.float32), torch.zeros_like(some.amax, dtype=torch.float32)
    scale = torch.stack([one if e is None else e.scale.float() for e in entries])
    amax = torch.stack([zero if e is None else e.amax.float() for e in entries])
    device = some.scale.device
    mask = None if all(e is not None for e in entries) else torch.tensor([e is not None for e in entries],
                                                                         device=device)
    return GatheredExperts(scale, amax, mask)


__all__ = ["Fp8GatherSpec", "GatheredFp8Weight", "GatheredExperts", "PER_TENSOR_RECIPES", "GATHERED_RECIPES",
           "tag_weight", "gather_spec", "drop_gathered", "keep_gathered", "gathered_weight", "gathered_experts"]
