"""The quantized weights of Hugging Face hub folders, dequantized tensor by tensor on import.

config.json's ``quantization_config`` says how the folder is stored:

* ``quant_method: "fp8"`` (DeepSeek-V3 / R1 / V3.1, ``fmt: "e4m3"``): a linear weight ``<name>.weight`` is
  ``float8_e4m3fn`` with a companion ``<name>.weight_scale_inv`` of shape ``[..., ceil(out / b0), ceil(in /
  b1)]`` (``weight_block_size: [b0, b1]``, ``[128, 128]`` on the hub; ``null``: one scale per matrix). The
  weight is ``w.float() * scale_inv`` broadcast over each ``b0 x b1`` block, the blocks at the right and
  bottom edges partial (DeepSeek's ``weight_dequant``, transformers' ``_dequantize_fp8_weight``). Scales are
  fp32 (also bf16 / fp16), or UE8M0 exponents (``float8_e8m0fnu``, or ``uint8`` read as ``2 ** (s - 127)``).
* ``quant_method: "mxfp4"`` (gpt-oss): the experts' ``mlp.experts.gate_up_proj`` / ``down_proj`` are stored
  as ``<name>_blocks`` ``[E, rows, G, B]`` (``uint8``, two FP4 e2m1 values a byte, the low nibble first) and
  ``<name>_scales`` ``[E, rows, G]`` (``uint8`` e8m0 exponents, ``2 ** (s - 127)``, one per ``2 B`` = 32
  values); the tensor is transformers' ``convert_moe_packed_tensors``: ``[E, rows, G * 2 B]`` transposed to
  ``[E, G * 2 B, rows]`` (``gate_up_proj`` ``[E, h, 2f]``, ``down_proj`` ``[E, f, h]``).

``dequantized_view`` wraps the folder's ``(shapes, read, files)`` so that the stored pairs appear as the one
tensor the adapters' rules already name, with its dequantized shape: nothing else changes. Each tensor (or,
for a stacked ``[E, ...]`` one, each expert's slice) is dequantized only when the converter reads it, so an
import never holds more than one dequantized tensor. It comes out in the ``--params-dtype`` (default bf16);
the other tensors keep their dtype. Exports are never quantized: ``--saver hf`` writes bf16 / fp32 folders.

Bad input is an error naming the tensor or key and its value: a weight without its scale (or the reverse), a
scale of the wrong shape or dtype, a quantized dtype other than the ``fmt``, an unknown ``quant_method``.
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Callable, Optional

import torch

from megatron_core.checkpointing.shard_reader import open_safetensors
from megatron_core.utils.errors import InputFileError

FP8_SCALE = "_scale_inv"
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 e2m1 by its 4-bit code (transformers' ``FP4_VALUES``): bit 3 the sign."""
FLOAT_SCALES = ("F32", "BF16", "F16", "F8_E8M0")
EXPONENT_SCALES = ("U8",)
METHODS = ("fp8", "mxfp4")
_TORCH_NAMES = MappingProxyType({
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8", torch.int8: "I8",
    **({torch.float8_e8m0fnu: "F8_E8M0"} if hasattr(torch, "float8_e8m0fnu") else {})})


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A folder's ``quantization_config``: the method and, for fp8, the block (None: one scale per matrix)."""

    method: str
    block: Optional[tuple[int, int]] = None


@dataclasses.dataclass(frozen=True)
class Quantized:
    """One dequantized tensor: its name, the stored ``(values, scales)`` names and its dequantized shape."""

    name: str
    parts: tuple[str, str]
    shape: tuple[int, ...]
    method: str


def scheme_of(config: dict, path: str) -> Optional[Scheme]:
    """The folder's quantization (None when config.json has no ``quantization_config``); refuses what we do not
    dequantize, naming the key and value."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise InputFileError(f"{path}: quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method not in METHODS:
        raise InputFileError(f"{path}: quantization_config.quant_method={method!r} is not supported: imports "
                             "dequantize 'fp8' (block-wise e4m3, DeepSeek-V3) and 'mxfp4' (gpt-oss); load other "
                             "folders with transformers, dequantize and save_pretrained them first")
    if method == "mxfp4":
        return Scheme("mxfp4")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise InputFileError(f"{path}: quantization_config.fmt={quant['fmt']!r} is not supported: fp8 imports "
                             "read e4m3 weights (float8_e4m3fn)")
    if quant.get("expert_dtype", "fp8") != "fp8":
        raise InputFileError(f"{path}: quantization_config.expert_dtype={quant['expert_dtype']!r} is not "
                             "supported: fp8 imports read e4m3 experts")
    block = quant.get("weight_block_size")
    if block is None:
        return Scheme("fp8")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise InputFileError(f"{path}: quantization_config.weight_block_size={block!r} must be two positive "
                             "integers (e.g. [128, 128]) or null")
    return Scheme("fp8", (block[0], block[1]))


def stored_dtypes(shapes: dict[str, tuple], files: dict[str, str]) -> dict[str, str]:
    """``{name: safetensors dtype name}`` ("F8_E4M3", "U8", "BF16" ...): from ``shapes`` where it gives a torch
    dtype, else from the header of the tensor's file (read once a file)."""
    out, headers = {}, {}
    for name, (_, dtype) in shapes.items():
        if dtype is not None:
            out[name] = _TORCH_NAMES.get(dtype, str(dtype))
            continue
        file = files[name]
        if file not in headers:
            with open_safetensors(file) as handle:
                headers[file] = {k: handle.get_slice(k).get_dtype() for k in handle.keys()}
        out[name] = headers[file][name]
    return out


def _fp8_scale_shape(shape: tuple, block: Optional[tuple[int, int]]) -> tuple:
    if len(shape) < 2:
        return ()
    if block is None:
        return (*shape[:-2], 1, 1)
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def _plan_fp8(scheme: Scheme, shapes: dict, dtypes: dict, files: dict) -> dict[str, Quantized]:
    plan = {}
    for scale in (n for n in shapes if n.endswith(FP8_SCALE)):
        weight = scale.removesuffix(FP8_SCALE)
        if weight not in shapes:
            raise InputFileError(f"{files[scale]}: tensor {scale!r} scales a weight {weight!r} the folder does "
                                 "not hold")
        if dtypes[weight] != "F8_E4M3":
            raise InputFileError(f"{files[weight]}: tensor {weight!r} is {dtypes[weight]} although it has a scale "
                                 f"{scale!r}: quantization_config fmt e4m3 stores float8_e4m3fn (F8_E4M3)")
        if dtypes[scale] not in FLOAT_SCALES + EXPONENT_SCALES:
            raise InputFileError(f"{files[scale]}: tensor {scale!r} is {dtypes[scale]}: fp8 scales are one of "
                                 f"{', '.join(FLOAT_SCALES + EXPONENT_SCALES)}")
        shape, wanted = tuple(shapes[weight][0]), _fp8_scale_shape(tuple(shapes[weight][0]), scheme.block)
        got = tuple(shapes[scale][0])
        if got != wanted and not (scheme.block is None and math.prod(got) == math.prod(wanted)):
            raise InputFileError(f"{files[scale]}: tensor {scale!r} has shape {list(got)} but weight {weight!r} "
                                 f"{list(shape)} in blocks of {list(scheme.block or shape[-2:])} needs "
                                 f"{list(wanted)} (one scale per block, edge blocks partial)")
        plan[weight] = Quantized(weight, (weight, scale), shape, "fp8")
    unscaled = [n for n, d in dtypes.items() if d.startswith("F8_") and d != "F8_E8M0" and n not in plan]
    if unscaled:
        raise InputFileError(f"{files[unscaled[0]]}: tensor {unscaled[0]!r} is {dtypes[unscaled[0]]} but the folder "
                             f"has no {unscaled[0] + FP8_SCALE!r} to dequantize it with ({len(unscaled)} such)")
    return plan


def _plan_mxfp4(shapes: dict, dtypes: dict, files: dict) -> dict[str, Quantized]:
    plan = {}
    for blocks in (n for n in shapes if n.endswith(MX_BLOCKS)):
        name = blocks.removesuffix(MX_BLOCKS)
        scales = name + MX_SCALES
        if scales not in shapes:
            raise InputFileError(f"{files[blocks]}: tensor {blocks!r} has no {scales!r} (its e8m0 exponents)")
        for part in (blocks, scales):
            if dtypes[part] != "U8":
                raise InputFileError(f"{files[part]}: tensor {part!r} is {dtypes[part]}: mxfp4 stores uint8 (U8)")
        shape, scale_shape = tuple(shapes[blocks][0]), tuple(shapes[scales][0])
        if len(shape) != 4 or scale_shape != shape[:-1]:
            raise InputFileError(f"{files[scales]}: tensor {scales!r} has shape {list(scale_shape)} but blocks "
                                 f"{blocks!r} {list(shape)} need {list(shape[:-1])} (blocks [E, rows, groups, bytes],"
                                 " one exponent per group)")
        plan[name] = Quantized(name, (blocks, scales), (shape[0], shape[2] * shape[3] * 2, shape[1]), "mxfp4")
    orphans = [n for n in shapes if n.endswith(MX_SCALES) and n.removesuffix(MX_SCALES) not in plan]
    if orphans:
        raise InputFileError(f"{files[orphans[0]]}: tensor {orphans[0]!r} has no "
                             f"{orphans[0].removesuffix(MX_SCALES) + MX_BLOCKS!r} (the FP4 values it scales)")
    return plan


def _unconfigured(shapes: dict, files: dict, path: str) -> None:
    """A folder with quantized tensors but no ``quantization_config`` is named, not half-read."""
    marked = next((n for n in shapes if n.endswith((FP8_SCALE, MX_BLOCKS))), None)
    if marked:
        raise InputFileError(f"{files[marked]}: tensor {marked!r} is part of a quantized weight but {path} has no "
                             "quantization_config (add the hub's, quant_method 'fp8' or 'mxfp4')")


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: Optional[tuple[int, int]],
                   dtype: torch.dtype) -> torch.Tensor:
    """``weight.float() * scale_inv`` over ``block``-sized tiles (edge tiles partial), in fp32, cast to
    ``dtype``; ``block`` None: one scale per matrix. The scale expands over rows only; columns broadcast
    through a view (transformers' ``_dequantize_fp8_weight``)."""
    out = weight.to(torch.float32)
    rows, cols = out.shape[-2:]
    scale = scale_inv.to(torch.float32) if scale_inv.dtype != torch.uint8 else (scale_inv.float() - 127.0).exp2()
    b0, b1 = block or (rows, cols)
    scale = scale.reshape(*out.shape[:-2], math.ceil(rows / b0), math.ceil(cols / b1))
    scale = scale.repeat_interleave(b0, dim=-2)[..., :rows, :]
    full, rest = divmod(cols, b1)
    out[..., : full * b1].unflatten(-1, (full, b1)).mul_(scale[..., :full, None])
    if rest:
        out[..., full * b1:].mul_(scale[..., full:])
    return out.to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' ``convert_moe_packed_tensors``: ``blocks [..., rows, G, B]`` (low nibble = the even
    value) times ``2 ** (scales - 127)`` -> ``[..., G * 2 B, rows]`` (the last two dims transposed), computed
    in fp32 (exact for every FP4 value and exponent) and cast to ``dtype``."""
    *prefix, groups, width = blocks.shape
    if tuple(scales.shape) != (*prefix, groups):
        raise InputFileError(f"mxfp4 scales {list(scales.shape)} do not match blocks {list(blocks.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    packed = blocks.to(torch.uint8).reshape(-1, width)
    out = torch.empty(packed.shape[0], 2 * width, dtype=torch.float32)
    out[:, 0::2] = lut[(packed & 0x0F).long()]
    out[:, 1::2] = lut[(packed >> 4).long()]
    torch.ldexp(out, scales.to(torch.int32).reshape(-1, 1) - 127, out=out)
    return out.reshape(*prefix, groups * 2 * width).transpose(-1, -2).contiguous().to(dtype)


def dequantized_view(config: dict, path: str, shapes: dict[str, tuple], read: Callable[..., torch.Tensor],
                     files: dict[str, str], dtype: Optional[torch.dtype] = None):
    """``(shapes, read, files)`` of a folder (``io.open_hf_weights``) as the adapters expect them: each stored
    pair replaced by the one dequantized tensor (shape and ``dtype``, default bf16), produced lazily by
    ``read(name, index=None)`` (``index``: one expert of a stacked tensor, dequantized alone). A folder
    without ``quantization_config`` is returned as it is."""
    scheme = scheme_of(config, path)
    if scheme is None:
        _unconfigured(shapes, files, path)
        return shapes, read, files
    dtypes = stored_dtypes(shapes, files)
    plan = _plan_fp8(scheme, shapes, dtypes, files) if scheme.method == "fp8" else _plan_mxfp4(shapes, dtypes, files)
    dtype = dtype or torch.bfloat16
    parts = {part for q in plan.values() for part in q.parts}
    view_shapes = {n: v for n, v in shapes.items() if n not in parts}
    view_files = {n: f for n, f in files.items() if n not in parts}
    for name, q in plan.items():
        view_shapes[name], view_files[name] = (q.shape, dtype), files[q.parts[0]]

    def view_read(name: str, index: Optional[int] = None) -> torch.Tensor:
        q = plan.get(name)
        if q is None:
            return read(name, index)
        values, scales = (read(part, index) for part in q.parts)
        if q.method == "fp8":
            return dequantize_fp8(values, scales, scheme.block, dtype)
        return dequantize_mxfp4(values, scales, dtype)
    return view_shapes, view_read, view_files


__all__ = ["Scheme", "Quantized", "scheme_of", "stored_dtypes", "dequantize_fp8", "dequantize_mxfp4",
           "dequantized_view", "FP4_VALUES"]
