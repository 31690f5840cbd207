"""Inference on trained checkpoints: build a model at any tp/pp from a checkpoint, run it stage by stage,
generate text with a key/value cache, and serve many requests at once (``InferenceEngine``: continuous
batching over a paged cache; its HTTP server, ``megatron_core.inference.server``, needs the ``serve`` extra)."""
from megatron_core.inference.checkpoint_model import config_from_flags, load_gpt_from_checkpoint, run_flags
from megatron_core.inference.engine import InferenceEngine, RequestOutput
from megatron_core.inference.generation import generate, pipeline_forward, sample_token
from megatron_core.inference.scheduler import SamplingParams

__all__ = ["config_from_flags", "load_gpt_from_checkpoint", "run_flags", "generate", "pipeline_forward",
           "sample_token", "InferenceEngine", "RequestOutput", "SamplingParams"]
