"""FP8 quantizers: per-tensor scales (delayed and tensorwise recipes), fp32 block scales (blockwise: 1x128 and
128x128 blocks) and E8M0 block scales (mxfp8: 1x32 blocks, OCP MX v1.0).

Every quantizer computes in fp32: ``q = cast(clamp(x * scale, -max, max))`` where ``cast`` is the round-to-
nearest-even conversion of ``tensor.to(torch.float8_*)`` (the hardware's). Saturation: finite values and
infinities beyond the range become +-max (never inf); NaN stays NaN. Amaxes ignore NaNs (CUDA's ``fmaxf``).
The dequantized value is ``q * scale_inv`` with ``scale_inv = 1 / scale`` in fp32 (what ``torch._scaled_mm``
takes).

Blocks run along the last dim of the tensor handed in (the GEMM's reduction dim: callers transpose for the
weight-gradient GEMM); a trailing partial block is its own block (its amax over the elements it has).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_core.fp8.formats import E8M0_BIAS, E8M0_MAX_EXPONENT, E8M0_MIN_EXPONENT, Fp8Format

FP32_MAX = torch.finfo(torch.float32).max
BLOCKWISE_WEIGHT_BLOCK = (128, 128)
"""The blockwise recipe's weight blocks (W and W^T share them)."""


@dataclasses.dataclass(frozen=True)
class Quantized:
    """An FP8 tensor and its dequantization scales.

    ``data``: ``[..., rows, cols]`` in ``fmt.dtype``. ``scale_inv``: fp32, ``[..., 1, 1]`` for a per-tensor scale
    (one per leading index: a grouped GEMM's experts), else ``[..., ceil(rows / br), ceil(cols / bc)]`` for
    ``block`` = ``(br, bc)``. ``scale_e8m0``: the MX scales as E8M0 bytes (``uint8``, bias 127), mxfp8 only.
    ``passthrough`` / ``ready``: delayed scaling's calibration (``with_calibration``): where ``ready`` (bool, one
    per leading index) is False the operand is ``passthrough``, the unquantized tensor.
    """
    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: Fp8Format
    block: Optional[tuple[int, int]] = None
    scale_e8m0: Optional[torch.Tensor] = None
    passthrough: Optional[torch.Tensor] = None
    ready: Optional[torch.Tensor] = None

    @property
    def per_tensor(self) -> bool:
        return self.block is None

    def expanded_scale_inv(self) -> torch.Tensor:
        """``scale_inv`` broadcast to ``data``'s shape (a view for per-tensor scales)."""
        if self.block is None:
            return self.scale_inv
        rows, cols = self.data.shape[-2:]
        full = self.scale_inv.repeat_interleave(self.block[0], -2).repeat_interleave(self.block[1], -1)
        return full[..., :rows, :cols]

    def dequantize(self) -> torch.Tensor:
        """fp32 ``q * scale_inv``, ``data``'s shape (the passthrough tensor where not ``ready``)."""
        values = self.data.float() * self.expanded_scale_inv()
        if self.passthrough is None:
            return values
        return torch.where(self.ready.reshape(*self.ready.shape, 1, 1), values, self.passthrough.float())

    def t(self) -> "Quantized":
        """The transpose of the last two dims (same bytes and scales, blocks swapped)."""
        block = None if self.block is None else (self.block[1], self.block[0])
        e8m0 = None if self.scale_e8m0 is None else self.scale_e8m0.transpose(-1, -2)
        scale_inv = self.scale_inv if self.block is None else self.scale_inv.transpose(-1, -2)
        passthrough = None if self.passthrough is None else self.passthrough.transpose(-1, -2)
        return Quantized(self.data.transpose(-1, -2), scale_inv, self.fmt, block, e8m0, passthrough, self.ready)

    def with_calibration(self, source: torch.Tensor, ready: Optional[torch.Tensor]) -> "Quantized":
        """This quantization, with ``source`` (unquantized) standing in where ``ready`` is False; itself when
        ``ready`` is None or all True."""
        if ready is None or bool(ready.all()):
            return self
        return dataclasses.replace(self, passthrough=source, ready=ready.to(self.data.device))


def abs_amax(x: torch.Tensor, dims: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """fp32 ``max |x|`` over ``dims`` (all dims when None), NaNs ignored, infinities kept; 0 for no elements."""
    magnitude = x.detach().abs().nan_to_num_(nan=0.0, posinf=float("inf"))
    if x.numel() == 0:
        shape = () if dims is None else [s for i, s in enumerate(x.shape) if i not in {d % x.dim() for d in dims}]
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    return (magnitude.amax() if dims is None else magnitude.amax(dim=dims)).float()


def scale_from_amax(amax: torch.Tensor, fmt: Fp8Format, margin: int = 0) -> torch.Tensor:
    """``fmt.max / amax / 2**margin`` in fp32; 1 where amax is 0 or not finite, fp32 max where it would
    overflow (Transformer Engine's rule)."""
    amax = amax.float()
    scale = torch.full_like(amax, fmt.max) / amax / (2.0 ** margin)  # a true division (``max / t`` is t^-1 * max)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, scale, torch.ones_like(scale))


def cast_to_fp8(scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp32 values (already scaled) -> ``fmt.dtype``: saturated to +-max (NaN kept), rounded to nearest even."""
    return scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> Quantized:
    """Per-tensor: ``scale`` fp32 ``[...]`` (one per leading index of ``x`` ``[..., rows, cols]``, or 0-dim)."""
    scale = scale.float().to(x.device)
    scale = scale.reshape(*scale.shape, 1, 1) if scale.dim() + 2 <= x.dim() else scale
    data = cast_to_fp8(x.float() * scale, fmt)
    return Quantized(data, torch.reciprocal(scale), fmt)


def quantize_tensorwise(x: torch.Tensor, fmt: Fp8Format, margin: int = 0, *,
                        amax: Optional[torch.Tensor] = None) -> Quantized:
    """Current per-tensor scaling: the amax of each ``[rows, cols]`` matrix of ``x`` (or ``amax`` when given,
    e.g. all-reduced over the ranks holding parts of the tensor)."""
    if amax is None:
        amax = abs_amax(x, (-2, -1))
    return quantize_with_scale(x, scale_from_amax(amax, fmt, margin), fmt)


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` ``[..., rows, cols]`` zero-padded to whole blocks, viewed ``[..., rows/br, br, cols/bc, bc]``."""
    rows, cols = x.shape[-2:]
    br, bc = block
    pad_rows, pad_cols = -rows % br, -cols % bc
    padded = F.pad(x, (0, pad_cols, 0, pad_rows)) if pad_rows or pad_cols else x
    return padded.reshape(*x.shape[:-2], (rows + pad_rows) // br, br, (cols + pad_cols) // bc, bc)


def _apply_block_scale(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fmt: Fp8Format) -> torch.Tensor:
    """``cast(x * scale)`` with ``scale`` ``[..., rows/br, cols/bc]`` applied blockwise; ``x``'s shape."""
    rows, cols = x.shape[-2:]
    blocks = _blocked(x.float(), block) * scale[..., :, None, :, None]
    return cast_to_fp8(blocks.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols], fmt)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 amax of each block: ``[..., ceil(rows/br), ceil(cols/bc)]`` (NaNs ignored; padding counts 0)."""
    return abs_amax(_blocked(x, block), (-3, -1))


def block_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Blockwise scaling's fp32 scale of each block from its ``amax`` (any shape): ``fmt.max / amax`` (1 for an
    all-zero or non-finite block). ``quantize_blocks`` and the FP8 ZeRO gather of blockwise weights
    (``fp8.param_gather``, from an all-reduced per-block amax) both take their scales from it."""
    return scale_from_amax(amax, fmt)


def quantize_blocks_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
                               block: tuple[int, int]) -> Quantized:
    """``x`` ``[..., rows, cols]`` quantized in ``block`` blocks with the given fp32 ``scale``
    ``[..., ceil(rows/br), ceil(cols/bc)]``."""
    scale = scale.float().to(x.device)
    return Quantized(_apply_block_scale(x, scale, block, fmt), torch.reciprocal(scale), fmt, block)


def quantize_blocks(x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int] = (1, 128)) -> Quantized:
    """Blockwise scaling (DeepSeek-V3; Megatron's ``--fp8-recipe blockwise``): one fp32 scale
    ``fmt.max / amax`` per ``block`` (1 for an all-zero or non-finite block: ``block_scale``)."""
    return quantize_blocks_with_scale(x, block_scale(block_amax(x, block), fmt), fmt, block)


def e8m0_exponent(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """OCP MX v1.0 shared-scale exponent: ``floor(log2(amax)) - emax_elem`` (emax 8 for E4M3, 15 for E5M2),
    clamped to E8M0's ``[-127, 127]``; 0 (scale 1) for an all-zero or non-finite amax. int32."""
    _, exponent = torch.frexp(amax.float())  # amax = m * 2**exponent, m in [0.5, 1): floor(log2) = exponent - 1
    shared = (exponent - 1 - fmt.emax).clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, shared, torch.zeros_like(shared)).to(torch.int32)


def quantize_mxfp8(x: torch.Tensor, fmt: Fp8Format, block_size: int = 32) -> Quantized:
    """MXFP8: 1 x ``block_size`` blocks along the last dim, scale ``X = 2**e`` (``e8m0_exponent``), elements
    ``cast(x / X)``: values above ``max * X`` (possible, as the spec's floor puts ``amax / X`` in
    ``[2**emax, 2**(emax+1))``) saturate to +-max."""
    block = (1, block_size)
    exponent = e8m0_exponent(block_amax(x, block), fmt)
    data = _apply_block_scale(x, torch.exp2(-exponent.float()), block, fmt)  # exact powers of two
    return Quantized(data, torch.exp2(exponent.float()), fmt, block, (exponent + E8M0_BIAS).to(torch.uint8))


__all__ = ["Quantized", "abs_amax", "scale_from_amax", "cast_to_fp8", "quantize_with_scale", "quantize_tensorwise",
           "quantize_blocks", "quantize_blocks_with_scale", "quantize_mxfp8", "block_amax", "block_scale",
           "e8m0_exponent", "BLOCKWISE_WEIGHT_BLOCK", "FP32_MAX"]
