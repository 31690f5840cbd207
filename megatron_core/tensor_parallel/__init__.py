"""Tensor parallelism (Megatron-LM): the f/g mappings, parallel layers, vocab-parallel loss and RNG tools."""
from megatron_core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_core.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    model_parallel_seed,
)
from megatron_core.tensor_parallel.utils import check_ids_in_range, divide, vocab_range, vocab_size_with_padding

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "all_to_all", "RNGStatesTracker", "model_parallel_seed",
    "checkpoint", "MODEL_PARALLEL_RNG", "init_method_normal", "scaled_init_method_normal",
    "set_tensor_model_parallel_attributes", "divide", "vocab_range", "vocab_size_with_padding", "check_ids_in_range",
]
