"""Regional compilation: ``torch.compile`` of each transformer layer's forward (torchtitan's recipe), not of
the whole model.

Each ``TransformerLayer`` keeps being an ``nn.Module`` with its own parameters and state-dict names; only its
``forward`` is replaced by a compiled one. The module's ``__call__`` stays eager, so hooks registered on the
layer (ZeRO-3's gather / release / prefetch hooks) run outside the compiled code: ``compile_layer`` marks the
layer ``gathers_all_parameters`` and ZeRO-3 then treats the whole layer as one gather unit and installs no
hook inside it (a compiled region may not resize parameter storage or register autograd hooks).

Inside a compiled layer the fused ops take their plain-torch path (the layer's ``kernel_backend`` in mode
"torch" for the call): inductor
generates its own fused kernels from them (C++ on CPU, Triton on CUDA). What a layer does that dynamo cannot
trace (tensor-parallel collectives on some backends, RNG-tracker forks for dropout, selective-recompute
checkpoints) runs eagerly between compiled graphs ("graph breaks"), so results equal the eager layer's.
Inductor draws dropout masks from its own RNG, so with dropout > 0 the compiled masks differ from eager's
(set ``torch._inductor.config.fallback_random = True`` to draw them from torch's generators). Incremental
decoding (a call with an ``inference_cache``) runs the eager forward: its shapes change every step.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def compile_layer(layer: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Replaces ``layer.forward`` by ``torch.compile(layer.forward, **compile_kwargs)`` (in place) and marks
    the layer as one ZeRO-3 gather unit. Returns ``layer``. Compiling twice is a no-op."""
    if getattr(layer, "compiled_forward", None) is not None:
        return layer
    eager = layer.forward
    compiled = torch.compile(eager, **compile_kwargs)

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("inference_cache") is not None:  # incremental decoding: a new shape every step, eager
            return eager(*args, **kwargs)
        backend = getattr(layer, "kernel_backend", None)
        # inductor fuses the torch ops; a Triton launch would break the graph
        with backend.use("torch") if backend is not None else contextlib.nullcontext():
            return compiled(*args, **kwargs)

    layer.compiled_forward = compiled
    layer.forward = forward
    layer.gathers_all_parameters = True
    return layer


def compile_layers(model: nn.Module, *, layer_type: type[nn.Module] | None = None,
                   **compile_kwargs: Any) -> int:
    """``compile_layer`` on every ``layer_type`` module inside ``model`` (default ``TransformerLayer``);
    returns how many were compiled. Call it before wrapping the model in ``DistributedDataParallel``."""
    if layer_type is None:
        from megatron_core.transformer.layer import TransformerLayer
        layer_type = TransformerLayer
    layers = [m for m in model.modules() if isinstance(m, layer_type)]
    for layer in layers:
        compile_layer(layer, **compile_kwargs)
    logger.info("torch.compile: %d %s layers compiled (regional)", len(layers), layer_type.__name__)
    return len(layers)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``compile_layer`` compiled ``module``."""
    return getattr(module, "compiled_forward", None) is not None


__all__ = ["compile_layer", "compile_layers", "is_compiled"]
