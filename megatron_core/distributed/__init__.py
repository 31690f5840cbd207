"""Gradient reduction across model- and data-parallel ranks."""
from megatron_core.distributed.finalize_model_grads import (
    allreduce_embedding_grads,
    allreduce_sequence_parallel_grads,
    finalize_model_grads,
)

__all__ = ["finalize_model_grads", "allreduce_sequence_parallel_grads", "allreduce_embedding_grads"]
