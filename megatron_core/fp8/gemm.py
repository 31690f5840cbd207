"""The FP8 GEMM ``a b^T`` of two quantized operands, both quantized along the reduction dim (or per tensor):
fp32 accumulation, output in the caller's dtype.

Backends (``Fp8Config.fp8_gemm_backend``):

- ``"emulate"``: dequantize both operands to fp32 (``q * scale_inv``) and ``torch.matmul`` in fp32, then add
  the bias in fp32 and cast. Exact and bit-reproducible on CPU; on any device.
- ``"scaled_mm"``: ``torch._scaled_mm(a_q, b_q^T, scale_inv_a, scale_inv_b, out_dtype=fp32)`` (FP8 tensor cores
  on CUDA devices of compute capability >= 8.9; torch's CPU kernel elsewhere) for per-tensor scales (the
  delayed and tensorwise recipes), then the bias in fp32 and the cast, as the emulation. The blockwise recipe
  (1x128 activations, 128x128 weights) runs ``torch.nn.functional.scaled_mm`` with cuBLAS's block scaling on
  Hopper (compute capability 9.x, CUDA >= 12.9) when every dim is a multiple of 128 (this path is untested:
  no such device in CI). mxfp8 (cuBLAS wants swizzled E8M0 scales), other devices and shapes the device
  cannot run (CUDA: dims not multiples of 16) are emulated, with a one-time warning.
- ``"auto"`` (default): ``scaled_mm`` on CUDA devices of compute capability >= 8.9, the emulation elsewhere
  (no torch.cuda call on a CPU tensor).

The two paths quantize identically; they differ only in the fp32 accumulation order of the GEMM (~1e-7).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_core.fp8.config import GEMM_BACKENDS
from megatron_core.fp8.quantize import Quantized
from megatron_core.utils import accelerator

MIN_SCALED_MM_CAPABILITY = (8, 9)
"""Ada / Hopper and later have FP8 tensor cores."""
BLOCK_1X128, BLOCK_128X128 = (1, 128), (128, 128)


class Fp8EmulationWarning(UserWarning):
    """An FP8 GEMM that a device kernel could not run fell back to the emulation (shown once per place)."""


def _fp8_tensor_cores(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return accelerator.device_capability(device) >= MIN_SCALED_MM_CAPABILITY


def _blockwise_fits(a: Quantized, b: Quantized) -> Optional[str]:
    """Why cuBLAS's 1x128 / 128x128 block scaling cannot take these (2-D) operands here, or None."""
    if a.block != BLOCK_1X128 or b.block not in (BLOCK_1X128, BLOCK_128X128):
        return "mxfp8 operands have no torch scaled-mm path wired here (cuBLAS wants swizzled E8M0 scales)"
    if not a.data.is_cuda or not hasattr(F, "scaled_mm"):
        return "blockwise scales run on CUDA through torch.nn.functional.scaled_mm only"
    capability, cuda = accelerator.device_capability(a.data.device), torch.version.cuda or "0.0"
    if capability[0] != 9 or tuple(int(v) for v in cuda.split(".")[:2]) < (12, 9):
        return f"blockwise scaled_mm needs Hopper (9.x) and CUDA >= 12.9, not {capability} with CUDA {cuda}"
    if any(d % 128 for d in (*a.data.shape, b.data.shape[0])):
        return f"dims {tuple(a.data.shape)} x {tuple(b.data.shape)} are not multiples of 128"
    return None


def _scaled_mm_fits(a: Quantized, b: Quantized) -> Optional[str]:
    """Why ``torch._scaled_mm`` (or, for blockwise operands, ``F.scaled_mm``) cannot take these operands here,
    or None."""
    if a.data.dim() != 2:
        return "grouped (batched) operands"
    if not (a.per_tensor and b.per_tensor):
        return _blockwise_fits(a, b)
    if a.data.is_cuda and (a.data.shape[-1] % 16 or b.data.shape[-2] % 16 or a.data.shape[-2] % 16):
        return f"dims {tuple(a.data.shape)} x {tuple(b.data.shape)} are not multiples of 16"
    return None


def use_scaled_mm(a: Quantized, b: Quantized, backend: str) -> bool:
    """Whether ``nt_gemm`` runs ``torch._scaled_mm`` for these operands under ``backend``; warns (once per
    call site) when a device kernel was asked for and the emulation runs instead."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"fp8_gemm_backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    if backend == "emulate" or (backend == "auto" and not _fp8_tensor_cores(a.data.device)):
        return False
    if a.passthrough is not None or b.passthrough is not None:  # delayed scaling's calibration: no warning
        return False
    reason = _scaled_mm_fits(a, b)
    if reason is not None:
        warnings.warn(f"FP8 GEMM emulated in fp32 on {a.data.device} ({reason}); numerics unchanged",
                      Fp8EmulationWarning, stacklevel=3)
        return False
    return True


def _blockwise_scaled_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    """cuBLAS block scaling (``F.scaled_mm``): a ``[M, R]`` 1x128 with fp32 decode scales ``[M, R/128]``, b ``[N, R]``
    1x128 (scales ``[N, R/128]``) or 128x128 (``[N/128, R/128]``). cuBLAS reads 1x128 scales column-major and
    128x128 ones as ``[R/128 padded to 4, N/128]`` column-major (torch's test_scaled_matmul_cuda layouts)."""
    def vector_scales(q: Quantized) -> torch.Tensor:
        return q.scale_inv.t().contiguous().t()
    if b.block == BLOCK_128X128:
        scale_b = F.pad(b.scale_inv, (0, -b.scale_inv.shape[1] % 4)).t()
    else:
        scale_b = vector_scales(b)
    recipe_b = F.ScalingType.BlockWise128x128 if b.block == BLOCK_128X128 else F.ScalingType.BlockWise1x128
    return F.scaled_mm(a.data.contiguous(), b.data.contiguous().t(), vector_scales(a), F.ScalingType.BlockWise1x128,
                       scale_b, recipe_b, output_dtype=torch.float32)


def _scaled_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    """``torch._scaled_mm``: a ``[M, R]`` row-major, b given ``[N, R]`` (so ``b^T`` is column-major)."""
    if not a.per_tensor:
        return _blockwise_scaled_mm(a, b)
    return torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a=a.scale_inv.reshape(()),
                            scale_b=b.scale_inv.reshape(()), out_dtype=torch.float32)


def nt_gemm(a: Quantized, b: Quantized, *, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
            backend: str = "auto") -> torch.Tensor:
    """``a b^T (+ bias)``: a ``[..., M, R]``, b ``[..., N, R]`` (same leading dims) -> ``[..., M, N]`` in
    ``out_dtype``; bias broadcastable to the output, added in fp32. No communication."""
    if use_scaled_mm(a, b, backend):
        out = _scaled_mm(a, b)
    else:
        out = torch.matmul(a.dequantize(), b.dequantize().transpose(-1, -2))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


__all__ = ["GEMM_BACKENDS", "Fp8EmulationWarning", "nt_gemm", "use_scaled_mm"]
