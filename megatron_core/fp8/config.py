"""``Fp8Config``: FP8 training settings (Megatron-LM's ``--fp8-*`` names); ``TransformerConfig.fp8`` holds one,
None = no FP8. Validation raises ValueError naming the value and the fix."""
from __future__ import annotations

import dataclasses
from typing import Optional

FP8_FORMATS = ("hybrid", "e4m3")
"""``hybrid``: E4M3 for inputs and weights, E5M2 for output gradients (Transformer Engine's); ``e4m3``: all E4M3."""
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
"""``delayed``: per-tensor scales from an amax history; ``tensorwise``: per-tensor current scaling;
``blockwise``: 1x128 activation / 128x128 weight blocks (DeepSeek-V3); ``mxfp8``: 32-element blocks with E8M0
power-of-two scales (OCP MX, Blackwell)."""
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
GEMM_BACKENDS = ("auto", "emulate", "scaled_mm")
"""``auto``: ``torch._scaled_mm`` on FP8 tensor cores (CUDA, compute capability >= 8.9), the exact fp32
emulation elsewhere; ``emulate``: always the emulation; ``scaled_mm``: ``torch._scaled_mm`` wherever torch runs it
(its CPU kernel too) for per-tensor scales. See ``megatron_core.fp8.gemm``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Config:
    fp8_format: str = "hybrid"
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    """Delayed / tensorwise scaling: ``scale = fp8_max / amax / 2**margin``."""
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    """Weight gradients from FP8 operands (False: the wgrad GEMM in the high-precision dtype)."""
    fp8_param_gather: bool = False
    """ZeRO-1/3 gather the weights in FP8 (half the bytes of bf16)."""
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    fp8_gemm_backend: str = "auto"
    """Which GEMM runs the FP8 products (``GEMM_BACKENDS``); the quantization is the same for all."""

    def __post_init__(self) -> None:
        for name, allowed in (("fp8_format", FP8_FORMATS), ("fp8_recipe", FP8_RECIPES),
                              ("fp8_amax_compute_algo", AMAX_COMPUTE_ALGOS), ("fp8_gemm_backend", GEMM_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len must be >= 1, got {self.fp8_amax_history_len}")
        if self.fp8_margin < 0:
            raise ValueError(f"fp8_margin must be >= 0, got {self.fp8_margin}")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def applies_to_layer(self, layer_number: int, num_layers: int) -> bool:
        """Whether global layer ``layer_number`` (1-based) runs its linears in FP8 (``first_last_layers_bf16``
        keeps the first ``num_layers_at_start_in_bf16`` and last ``num_layers_at_end_in_bf16`` in high
        precision, as Megatron-LM)."""
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 < layer_number <= num_layers - self.num_layers_at_end_in_bf16


def fp8_runs_emulated() -> Optional[str]:
    """Why FP8 GEMMs run emulated here (no CUDA device, or compute capability below 8.9), or None when this
    process's CUDA device has FP8 tensor cores."""
    from megatron_core.utils import accelerator
    if not accelerator.cuda_available():
        return "no CUDA device"
    major, minor = accelerator.device_capability()
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} has no FP8 tensor cores (8.9+: Ada, Hopper, Blackwell)"
    return None


def layer_fp8(config, layer_number: int) -> Optional[Fp8Config]:
    """The ``Fp8Config`` global layer ``layer_number`` of ``config`` (a TransformerConfig) runs with, or None.
    MTP layers (numbered past ``num_layers``) count as last layers."""
    fp8 = getattr(config, "fp8", None)
    if fp8 is None:
        return None
    return fp8 if fp8.applies_to_layer(min(layer_number, config.num_layers), config.num_layers) else None


__all__ = ["Fp8Config", "layer_fp8", "fp8_runs_emulated", "FP8_FORMATS", "FP8_RECIPES", "AMAX_COMPUTE_ALGOS",
           "GEMM_BACKENDS"]
