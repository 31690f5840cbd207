"""Inference on trained checkpoints: build a model at any tp/pp from a checkpoint, run it stage by stage,
and generate text with a key/value cache."""
from megatron_core.inference.checkpoint_model import config_from_flags, load_gpt_from_checkpoint, run_flags
from megatron_core.inference.generation import generate, pipeline_forward, sample_token

__all__ = ["config_from_flags", "load_gpt_from_checkpoint", "run_flags", "generate", "pipeline_forward",
           "sample_token"]
