"""Hugging Face interop: one adapter per family (a declarative tensor table and a config translation) behind
one registry keyed by config.json's ``model_type``; ``io`` streams tensors through them."""
from megatron_core.models.hf.io import read_hf, write_hf
from megatron_core.models.hf.registry import SUPPORTED, adapter_for_flags, get_adapter

__all__ = ["read_hf", "write_hf", "get_adapter", "adapter_for_flags", "SUPPORTED"]
