"""The FP8 linear: ``y = x W^T + b`` with x and W quantized, and its backward (``dx = dy W``, ``dW = dy^T x``)
with dy quantized, every GEMM ``nt_gemm`` (fp32 accumulation, output in the input's dtype).

Each GEMM's operands are quantized along its reduction dim (``Fp8Plan.quantize``):

    fprop  x [M, K]   . W [N, K]      input (E4M3), weight (E4M3)
    dgrad  dy [M, N]  . W^T [K, N]    grad_output (E5M2 under "hybrid", E4M3 under "e4m3"), weight
    wgrad  dy^T [N, M] . x^T [K, M]   grad_output, input

Per-tensor recipes (delayed, tensorwise) quantize each tensor once (its transpose is the same bytes); block
recipes quantize each orientation on its own (blockwise: 1x128 blocks for inputs and output grads, 128x128 for
weights, so W and W^T share blocks; mxfp8: 1x32 blocks everywhere). ``fp8_wgrad=False`` computes dW from the
unquantized dy and x. The bias and its grad stay in high precision.

Reductions for layout parity (``Fp8Plan.split_roles``: the roles whose tensor is split over ``tp_group``): the
tensorwise recipe all-reduces each such tensor's amax with MAX over tp (forward: input and/or weight;
backward: grad_output), so every rank uses the scale of the whole tensor; delayed scaling records local amaxes
and reduces them once per step (``state.update_fp8_scales``); block recipes use blocks local to the shard.

Sequence parallelism (``gather_group``): forward all-gathers x along dim 0 and backward reduce-scatters dx.
Per-tensor recipes quantize x's local chunk with the whole tensor's scale and gather the FP8 bytes (half of
bf16's; Transformer Engine's way), save the local FP8 chunk and gather it again for dW (``_gathered_fp8_input``;
``fp8_wgrad=False`` saves the local high-precision chunk instead); block recipes and delayed scaling's
calibration step gather x itself, save its local chunk and quantize the gathered tensor.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.distributed as dist

from megatron_core.fp8.config import Fp8Config
from megatron_core.fp8.formats import Fp8Format, role_format
from megatron_core.fp8.gemm import nt_gemm
from megatron_core.fp8.param_gather import GatheredExperts, GatheredFp8Weight, gathered_weight
from megatron_core.fp8.quantize import (
    BLOCKWISE_WEIGHT_BLOCK,
    Quantized,
    abs_amax,
    block_amax,
    block_scale,
    quantize_blocks,
    quantize_blocks_with_scale,
    quantize_mxfp8,
    quantize_with_scale,
    scale_from_amax,
)
from megatron_core.fp8.state import Fp8ScalingState, ScalingView
from megatron_core.tensor_parallel.utils import group_size
from megatron_core.tensor_parallel.weight_grad_store import WeightGradStore, deferrable_target, deferring_forward
from megatron_core.utils.compile_guard import eager_when_compiled

BLOCKWISE_ACTIVATION_BLOCK = (1, 128)
MXFP8_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class Fp8Plan:
    """How one FP8 linear call quantizes.

    config: the recipe. scaling: the delayed recipe's scales / amax slots (``ScalingView``), else None.
    tp_group, split_roles: roles (of "input", "weight", "grad_output") whose tensor is split over tp_group.
    record: take this call's amaxes into the delayed state (training forwards with grad only).
    """
    config: Fp8Config
    scaling: Optional[ScalingView] = None
    tp_group: object = None
    split_roles: frozenset = frozenset()
    record: bool = False

    def __post_init__(self) -> None:
        if self.config.fp8_recipe == "delayed" and self.scaling is None:
            raise ValueError("the delayed FP8 recipe needs its scaling state: pass scaling=Fp8ScalingState(...).view()")

    @property
    def per_tensor(self) -> bool:
        return self.config.fp8_recipe in ("delayed", "tensorwise")

    def fmt(self, role: str) -> Fp8Format:
        return role_format(self.config.fp8_format, role)

    def scale(self, role: str, tensor: torch.Tensor,
              amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Per-tensor recipes: ``(scale, ready)``, the fp32 scale(s) ``role`` quantizes ``tensor`` ``[..., rows,
        cols]`` with (one per leading index) and, for delayed scaling while some are not calibrated yet, the bool
        mask of those that are (else None). Delayed: the state's (and records the amax); tensorwise: from the
        current amax, all-reduced with MAX over tp for a split role. ``amax``: the tensor's (one per leading
        index), when known (else taken here)."""
        if self.config.fp8_recipe == "delayed":
            if self.record:
                self.scaling.record(role, abs_amax(tensor, (-2, -1)) if amax is None else amax)
            return self.scaling.scale(role), self.scaling.ready(role)
        amax = abs_amax(tensor, (-2, -1)) if amax is None else amax.clone()
        if role in self.split_roles and group_size(self.tp_group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.tp_group)
        return scale_from_amax(amax, self.fmt(role), self.config.fp8_margin), None

    def with_scale(self, role: str, tensor: torch.Tensor, scale: torch.Tensor,
                   ready: Optional[torch.Tensor]) -> Quantized:
        """``tensor`` quantized with a per-tensor ``scale`` (unquantized where ``ready`` is False)."""
        return quantize_with_scale(tensor, scale, self.fmt(role)).with_calibration(tensor, ready)

    def quantized(self, role: str, data: torch.Tensor, scale: torch.Tensor) -> Quantized:
        """FP8 bytes ``data`` ``[..., rows, cols]`` that were quantized with the per-tensor ``scale`` (one per
        leading index), as a ``Quantized`` again (a saved or gathered operand)."""
        return Quantized(data, torch.reciprocal(scale.reshape(*scale.shape, 1, 1)), self.fmt(role))

    def quantize_blocks(self, role: str, tensor: torch.Tensor) -> Quantized:
        """Block recipes: ``tensor`` quantized in blocks along its last dim (the GEMM's reduction dim)."""
        if self.config.fp8_recipe == "mxfp8":
            return quantize_mxfp8(tensor, self.fmt(role), MXFP8_BLOCK)
        block = BLOCKWISE_WEIGHT_BLOCK if role == "weight" else BLOCKWISE_ACTIVATION_BLOCK
        return quantize_blocks(tensor, self.fmt(role), block)

    def quantize(self, role: str, tensor: torch.Tensor):
        """``(quantized, per-tensor scale or None, ready mask or None)``."""
        if self.per_tensor:
            scale, ready = self.scale(role, tensor)
            return self.with_scale(role, tensor, scale, ready), scale, ready
        return self.quantize_blocks(role, tensor), None, None

    def quantize_weight(self, weight: torch.Tensor, gathered: Union[GatheredFp8Weight, GatheredExperts, None]):
        """``quantize("weight", weight)``; after an FP8 gather (``fp8_param_gather``) with the gather's scale, which
        gives back the gathered bytes (``fp8.param_gather``); delayed scaling records the global amax. A grouped
        GEMM's weight ``[E, N, K]`` of which only some experts were gathered in FP8 (``GatheredExperts.mask``)
        takes the others' amaxes itself (tensorwise: all-reduced over tp for a split weight, as without the flag).
        Blockwise: the gathered per-block scales ``[(E,) ceil(N/128), ceil(K/128)]`` (no ready mask)."""
        if gathered is None:
            return self.quantize("weight", weight)
        mask = getattr(gathered, "mask", None)
        if not self.per_tensor:
            scale = gathered.scale.to(weight.device)
            if mask is not None:
                own = block_scale(block_amax(weight, BLOCKWISE_WEIGHT_BLOCK), self.fmt("weight"))
                scale = torch.where(mask.to(weight.device)[:, None, None], scale, own)
            return quantize_blocks_with_scale(weight, scale, self.fmt("weight"), BLOCKWISE_WEIGHT_BLOCK), scale, None
        if mask is not None:
            amax = torch.where(mask.to(weight.device), gathered.amax.to(weight.device), abs_amax(weight, (-2, -1)))
            scale, ready = self.scale("weight", weight, amax)
            return self.with_scale("weight", weight, scale, ready), scale, ready
        if self.scaling is not None and self.record:
            self.scaling.record("weight", gathered.amax)
        return self.with_scale("weight", weight, gathered.scale, None), gathered.scale, None

    def gemm(self, a: Quantized, b: Quantized, dtype: torch.dtype, bias=None) -> torch.Tensor:
        return nt_gemm(a, b, out_dtype=dtype, bias=bias, backend=self.config.fp8_gemm_backend)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((group_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((x.shape[0] // group_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _all_gather_fp8(data: torch.Tensor, group) -> torch.Tensor:
    """FP8 rows ``[m, k]`` all-gathered along dim 0 as bytes (collectives take no float8 dtype)."""
    return _all_gather(data.view(torch.uint8), group).view(data.dtype)


def _gathered_fp8_input(plan: Fp8Plan, x: torch.Tensor, group):
    """Sequence parallelism under a per-tensor recipe, as Transformer Engine does it: x's local chunk ``[s/tp, b,
    K]`` quantized with the whole tensor's scale (its amax all-reduced with MAX over ``group``), then all-gathered
    as FP8 bytes, half of bf16's. The same bytes as gathering x and quantizing it, since quantizing is
    element-wise. ``(local FP8 rows [s/tp * b, K], gathered Quantized [s * b, K], scale)``; None for block
    recipes and while delayed scaling calibrates (the forward then gathers x in high precision)."""
    if not plan.per_tensor or (plan.scaling is not None and plan.scaling.ready("input") is not None):
        return None
    local, scale = local_fp8_input(plan, x, group)
    return local.data, dataclasses.replace(local, data=_all_gather_fp8(local.data, group)), scale


def local_fp8_input(plan: Fp8Plan, x: torch.Tensor, group, role: str = "input") -> tuple[Quantized, torch.Tensor]:
    """A per-tensor recipe's FP8 rows ``[s/tp * b, K]`` of x's local chunk ``[s/tp, b, K]`` (``role``: the input,
    or a row-parallel layer's output grad), quantized with the whole (sequence-gathered) tensor's scale:
    tensorwise from the amax MAX-reduced over ``group``; delayed the state's (recording that amax).
    ``(rows, scale)``."""
    rows = x.reshape(-1, x.shape[-1])
    amax = None  # the whole tensor's, where the scale (tensorwise) or the delayed record needs it
    if plan.config.fp8_recipe == "tensorwise" or plan.record:
        amax = abs_amax(rows, (-2, -1))
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale, _ = plan.scale(role, rows, amax)
    return plan.with_scale(role, rows, scale, None), scale


def _matrices(t: torch.Tensor, grouped: bool) -> torch.Tensor:
    """``[..., k]`` -> ``[M, k]`` (a grouped GEMM's ``[E, n, k]`` stays as it is)."""
    return t if grouped else t.reshape(-1, t.shape[-1])


class _Fp8Linear(torch.autograd.Function):
    """x ``[..., K]`` (``[E, n, K]`` with a grouped weight ``[E, N, K]``), weight ``[N, K]``, bias ``[N]`` (or
    ``[E, 1, N]``) -> ``[..., N]``. Collectives: see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: Fp8Plan, gather_group, store: Optional[WeightGradStore],
                gathered: Optional[GatheredFp8Weight] = None):
        grouped = weight.dim() == 3
        fp8_gathered = _gathered_fp8_input(plan, x, gather_group) if gather_group is not None and not grouped else None
        if fp8_gathered is not None:  # SP: the local chunk quantized, FP8 bytes gathered
            local_data, qx, scale_x = fp8_gathered
            ready_x, total_shape = None, (qx.data.shape[0] // x.shape[1:-1].numel(), *x.shape[1:])
        else:
            total = _all_gather(x, gather_group) if gather_group is not None else x
            qx, scale_x, ready_x = plan.quantize("input", _matrices(total, grouped))
            local_data, total_shape = qx.data, total.shape
        qw, scale_w, ready_w = plan.quantize_weight(weight, gathered)
        out = plan.gemm(qx, qw, x.dtype, bias)
        keep_fp8 = (plan.per_tensor and plan.config.fp8_wgrad and qx.passthrough is None
                    and (gather_group is None or fp8_gathered is not None))
        ctx.save_for_backward(local_data if keep_fp8 else x, weight, scale_x, scale_w, ready_x, ready_w)
        ctx.plan, ctx.group, ctx.store, ctx.keep_fp8 = plan, gather_group, store, keep_fp8
        ctx.grouped, ctx.x_shape, ctx.x_dtype, ctx.has_bias = grouped, total_shape, x.dtype, bias is not None
        ctx.weight_target = deferrable_target(weight) if store is not None else None
        return out if grouped else out.view(*total_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        saved_x, weight, scale_x, scale_w, ready_x, ready_w = ctx.saved_tensors
        plan, grouped = ctx.plan, ctx.grouped
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        dy = _matrices(grad_output, grouped)
        qdy = plan.quantize("grad_output", dy)[0] if plan.per_tensor else None
        grad_input = grad_weight = grad_bias = None
        if needs_input:
            grad_input = _input_grad(plan, dy, qdy, weight, (scale_w, ready_w), ctx.x_dtype).view(ctx.x_shape)
            if ctx.group is not None:
                grad_input = _reduce_scatter(grad_input, ctx.group)
        if needs_weight:
            def weight_grad() -> torch.Tensor:
                return _weight_grad(ctx_values, dy, qdy, weight)
            ctx_values = (plan, saved_x, (scale_x, ready_x), ctx.group, ctx.keep_fp8, grouped)
            if ctx.weight_target is not None and ctx.store.deferring:
                ctx.store.defer(ctx.weight_target, weight_grad)
            else:
                grad_weight = weight_grad()
        if ctx.has_bias and needs_bias:
            grad_bias = dy.sum(-2, keepdim=True) if grouped else dy.sum(0)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _input_grad(plan: Fp8Plan, dy, qdy: Optional[Quantized], weight, scale_w, dtype) -> torch.Tensor:
    """``dy W`` ``[..., M, K]``: dy along N, W^T along N (per tensor: the forward's ``(scale, ready)``, no new
    amax; blockwise after an FP8 gather: the forward's 128x128 block scales, transposed)."""
    if plan.per_tensor:
        qw_t = plan.with_scale("weight", weight, *scale_w).t()
        return plan.gemm(qdy, qw_t, dtype)
    weight_t = weight.transpose(-1, -2).contiguous()
    if scale_w[0] is not None:  # W^T's blocks are W's, transposed
        qw_t = quantize_blocks_with_scale(weight_t, scale_w[0].transpose(-1, -2), plan.fmt("weight"),
                                          BLOCKWISE_WEIGHT_BLOCK)
    else:
        qw_t = plan.quantize_blocks("weight", weight_t)
    return plan.gemm(plan.quantize_blocks("grad_output", dy), qw_t, dtype)


def _weight_grad(values, dy, qdy: Optional[Quantized], weight) -> torch.Tensor:
    """``dy^T x`` ``[..., N, K]`` in the weight's dtype (re-gathers x under sequence parallelism)."""
    plan, saved_x, scale_x, group, keep_fp8, grouped = values
    if keep_fp8:  # the FP8 input (SP: its local rows, gathered again as FP8 bytes)
        data = _all_gather_fp8(saved_x, group) if group is not None else saved_x
        return plan.gemm(qdy.t(), plan.quantized("input", data, scale_x[0]).t(), weight.dtype)
    x2 = _matrices(_all_gather(saved_x, group) if group is not None else saved_x, grouped)
    if not plan.config.fp8_wgrad:
        return torch.matmul(dy.transpose(-1, -2), x2.to(dy.dtype)).to(weight.dtype)
    if plan.per_tensor:
        return plan.gemm(qdy.t(), plan.with_scale("input", x2, *scale_x).t(), weight.dtype)
    return plan.gemm(plan.quantize_blocks("grad_output", dy.transpose(-1, -2).contiguous()),
                     plan.quantize_blocks("input", x2.transpose(-1, -2).contiguous()), weight.dtype)


def scaling_state(fp8: Optional[Fp8Config], *, device=None, shape=()) -> Optional[Fp8ScalingState]:
    """A layer's delayed-scaling state (``shape`` linears), None without FP8 or for current-scaling recipes."""
    if fp8 is None or fp8.fp8_recipe != "delayed":
        return None
    return Fp8ScalingState(fp8, shape, device=device)


def layer_plan(fp8: Fp8Config, state: Optional[Fp8ScalingState], *, training: bool, tp_group=None,
               split_roles=(), index=()) -> Fp8Plan:
    """The plan of one call of a layer: amaxes are recorded in training forwards with grad enabled (not in
    evaluation); ``split_roles`` count only when ``tp_group`` has more than one rank."""
    split = frozenset(split_roles) if group_size(tp_group) > 1 else frozenset()
    return Fp8Plan(fp8, state.view(index) if state is not None else None, tp_group, split,
                   record=training and torch.is_grad_enabled())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: Fp8Plan, *,
               gather_group=None, weight_grad_store: Optional[WeightGradStore] = None,
               gathered: Optional[GatheredExperts] = None) -> torch.Tensor:
    """``x W^T + b`` through FP8 GEMMs (see the module docstring). With ``fp8_param_gather`` a per-tensor plan
    quantizes the weight with the scale ZeRO's FP8 gather used, when valid (``fp8.param_gather.gathered_weight``;
    a grouped GEMM's stacked weight passes its experts' entries as ``gathered``, ``gathered_experts``).

    x ``[..., K]`` (``[s/tp, b, K]`` with ``gather_group``, which all-gathers it along dim 0 in forward and
    reduce-scatters dx in backward), weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]`` (``[s, b, N]``).
    A grouped GEMM passes x ``[E, n, K]``, weight ``[E, N, K]``, bias ``[E, 1, N]`` (per-expert scales).
    Inside ``weight_grad_store.deferrable_forward()`` the weight-gradient GEMM is deferred to the W pass.
    """
    if gather_group is not None and (group_size(gather_group) == 1 or x.shape[0] == 0):
        gather_group = None
    store = weight_grad_store if deferring_forward(weight_grad_store) else None
    gathered = prepare(plan, x, weight, gathered)
    if not plan.per_tensor:  # the block quantizers' padded reshapes run eager inside compiled layers
        return _apply_eager(x, weight, bias, plan, gather_group, store, gathered)
    return _Fp8Linear.apply(x, weight, bias, plan, gather_group, store, gathered)


def prepare(plan: Fp8Plan, x: torch.Tensor, weight: torch.Tensor, gathered):
    """What an FP8 linear call does before its GEMMs: the delayed state follows x's device; with
    ``fp8_param_gather`` the weight's entry of ZeRO's FP8 gather (whose scale quantizes it), unless given."""
    if plan.scaling is not None:
        plan.scaling.state.follow(x.device)
    if gathered is None and plan.config.fp8_param_gather:
        gathered = gathered_weight(weight, plan)
    return gathered


@eager_when_compiled
def _apply_eager(*args):
    """``_Fp8Linear.apply`` outside torch.compile's graph (inductor mis-sizes the blocked views, torch 2.13)."""
    return _Fp8Linear.apply(*args)


__all__ = ["Fp8Plan", "fp8_linear", "local_fp8_input", "prepare", "scaling_state", "layer_plan",
           "BLOCKWISE_ACTIVATION_BLOCK", "BLOCKWISE_WEIGHT_BLOCK", "MXFP8_BLOCK"]
