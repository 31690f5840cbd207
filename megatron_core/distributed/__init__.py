"""Data-parallel gradient reduction (bucketed, overlapped, ZeRO 0-3) and the model-parallel grad reductions."""
from megatron_core.distributed.ddp_config import DistributedDataParallelConfig
from megatron_core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_core.distributed.finalize_model_grads import (
    allreduce_embedding_grads,
    allreduce_sequence_parallel_grads,
    finalize_model_grads,
)

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads",
           "allreduce_sequence_parallel_grads", "allreduce_embedding_grads"]
