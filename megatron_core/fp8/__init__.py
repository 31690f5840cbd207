"""FP8 training (Megatron-LM's ``--fp8-*`` recipes): quantizers, FP8 GEMMs (``torch._scaled_mm`` on FP8 tensor
cores, an exact emulation elsewhere), and the per-module scaling state."""
from megatron_core.fp8.config import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES, Fp8Config, layer_fp8

__all__ = ["Fp8Config", "layer_fp8", "FP8_FORMATS", "FP8_RECIPES", "AMAX_COMPUTE_ALGOS"]
