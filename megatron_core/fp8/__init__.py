"""FP8 training (Megatron-LM's ``--fp8-*`` recipes): quantizers, FP8 GEMMs (``torch._scaled_mm`` on FP8 tensor
cores, an exact emulation elsewhere), and the per-module scaling state.

A layer gets FP8 from its ``fp8=`` argument (``ColumnParallelLinear``, ``RowParallelLinear``, MLA's
``ReplicatedLinear``, ``LocalExperts``), which the transformer layers fill with ``layer_fp8(config,
layer_number)``; the training loop calls ``update_fp8_scales(model_chunks, parallel_state)`` once per step, just
before the optimizer step (the delayed recipe's amax reduction and scale update; before the step so that
``--fp8-param-gather`` knows the next forward's weight scales when ZeRO gathers them). ``fp8_linear``
(``megatron_core.fp8.linear``) is the autograd function behind the layers. See docs/fp8.md.
"""
from megatron_core.fp8.config import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES, GEMM_BACKENDS, Fp8Config, layer_fp8
from megatron_core.fp8.formats import E4M3, E5M2, Fp8Format, role_format
from megatron_core.fp8.quantize import (
    Quantized,
    quantize_blocks,
    quantize_mxfp8,
    quantize_tensorwise,
    quantize_with_scale,
    scale_from_amax,
)
from megatron_core.fp8.state import Fp8ScalingState, update_fp8_scales

__all__ = ["Fp8Config", "layer_fp8", "FP8_FORMATS", "FP8_RECIPES", "AMAX_COMPUTE_ALGOS", "GEMM_BACKENDS",
           "Fp8Format", "E4M3", "E5M2", "role_format", "Quantized", "quantize_with_scale", "quantize_tensorwise",
           "quantize_blocks", "quantize_mxfp8", "scale_from_amax", "Fp8ScalingState", "update_fp8_scales"]
