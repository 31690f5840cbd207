"""Sharded, atomic, layout-independent checkpoints (safetensors + JSON, no pickle)."""
from megatron_core.checkpointing.checkpoint import (
    full_parameters,
    latest_iteration,
    read_metadata,
    save_checkpoint,
)
from megatron_core.checkpointing.layout import global_named_parameters
from megatron_core.checkpointing.loading import load_model_weights, load_rng
from megatron_core.checkpointing.shard_reader import ShardReader

__all__ = ["save_checkpoint", "read_metadata", "load_model_weights", "load_rng", "latest_iteration",
           "global_named_parameters", "full_parameters", "ShardReader"]
