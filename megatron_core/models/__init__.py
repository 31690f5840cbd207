"""Models assembled from the transformer blocks."""
from megatron_core.models.gpt import GPTModel
from megatron_core.models.llama import llama_config, llama_layer_spec, llama_model

__all__ = ["GPTModel", "llama_config", "llama_layer_spec", "llama_model"]
