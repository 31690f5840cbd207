"""Predicting per-rank memory and step time of a parallel layout (``tools/plan_parallelism.py``)."""
from megatron_core.planning.activations import (
    ActivationShape,
    in_flight_microbatches,
    korthikanti_bytes,
    layer_activation_bytes,
    stage_activation_bytes,
)

__all__ = [
    "ActivationShape", "in_flight_microbatches", "korthikanti_bytes", "layer_activation_bytes",
    "stage_activation_bytes",
]
