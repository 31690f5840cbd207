"""Sharded, atomic, layout-independent checkpoints (safetensors + JSON, no pickle)."""
from megatron_core.checkpointing.checkpoint import (
    ShardReader,
    full_parameters,
    latest_iteration,
    load_model_weights,
    load_rng,
    read_metadata,
    save_checkpoint,
)
from megatron_core.checkpointing.layout import global_named_parameters

__all__ = ["save_checkpoint", "read_metadata", "load_model_weights", "load_rng", "latest_iteration",
           "global_named_parameters", "full_parameters", "ShardReader"]
