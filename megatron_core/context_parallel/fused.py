"""Fused attention kernels that return the log-sum-exp of their block, per device, for ring and all-gather
attention (``blocks`` cuts a block into pieces, runs them here and merges them; no communication here).

One piece is ``q [b, h, sq, d]`` over ``k, v [b, h, sk, d]`` (kv heads already expanded), no user mask, no
dropout, either unmasked or top-left causal with ``sq == sk`` (the only causal shape ``blocks`` asks for, so
top-left and bottom-right causal agree on every kernel). Returns ``(out [b, h, sq, d]`` in the input dtype,
``lse [b, h, sq])``; backward takes the final (merged) output and statistics, flash-attention style.

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (any float dtype).
- CUDA: ``aten._scaled_dot_product_flash_attention`` (fp16 / bf16, head dim a multiple of 8 up to 256, sm80+)
  or else ``aten._scaled_dot_product_efficient_attention`` (fp32 / fp16 / bf16, head dim a multiple of 4 and
  8 for 16-bit), with their ``_backward``; the efficient kernel's statistics are padded to a multiple of 32
  rows (sliced off in forward, padded again for backward). UNTESTED: written without a GPU; the CPU tests
  run the same piece / merge logic with the CPU kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_core.utils import accelerator

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
_EFFICIENT_LSE_ROWS = 32
_ATEN = torch.ops.aten
"""The operator namespace the kernels are called from (a constant; tests put CPU stand-ins here)."""


def kernel_for(q: torch.Tensor) -> Optional[str]:
    """``"cpu"``, ``"cuda_flash"``, ``"cuda_efficient"`` or None (no fused kernel for this device, dtype and
    head dim: the tiled math runs)."""
    d = q.shape[-1]
    if q.device.type == "cpu":
        return "cpu" if q.dtype in _CPU_DTYPES else None
    if q.device.type != "cuda":
        return None
    if q.dtype in _HALF and d % 8 == 0 and d <= 256 and accelerator.device_capability(q.device)[0] >= 8:
        return "cuda_flash"
    if (q.dtype == torch.float32 and d % 4 == 0) or (q.dtype in _HALF and d % 8 == 0):
        return "cuda_efficient"
    return None


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The statistics' dtype the kernels take back: fp64 for fp64 (CPU), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def piece_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, h, sq, d]`` in q's dtype, ``lse [b, h, sq])`` of one piece (see the module docstring)."""
    aten = _ATEN
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "cuda_flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]


def piece_backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, *, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one piece in q's dtype, from the final ``out`` (q's dtype, contiguous) and ``lse``
    (``lse_dtype``, contiguous) of these query rows over every key."""
    aten = _ATEN
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                         scale=scale)
    sq, sk = q.shape[2], k.shape[2]
    if kernel == "cuda_flash":  # dense inputs: no cumulative lengths; dropout 0: the philox state is never read
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, None, None, sq, sk, 0.0,
                                                                 causal, unused, unused, scale=scale)
    padded = F.pad(lse, (0, -sq % _EFFICIENT_LSE_ROWS)).contiguous()  # the kernel's row-padded layout
    unused = torch.empty((), dtype=torch.int64)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, unused, unused, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


__all__ = ["kernel_for", "lse_dtype", "piece_backward", "piece_forward"]
