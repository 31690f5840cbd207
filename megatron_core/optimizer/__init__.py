"""Mixed-precision and distributed (ZeRO 1-3) optimizer, loss scaling, clipping, CPU offload, memory report."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from torch import nn

from megatron_core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_core.optimizer.memory import MemoryReport, memory_report
from megatron_core.optimizer.optimizer import MegatronOptimizer
from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.parallel_state import ParallelState


def get_optimizer(config: OptimizerConfig, model: Union[nn.Module, Sequence[nn.Module]], *,
                  parallel_state: Optional[ParallelState] = None) -> MegatronOptimizer:
    """The optimizer over ``model`` (a module or a list of model chunks, each possibly wrapped in
    ``DistributedDataParallel``; stages 1-3 of the wrapper make it a distributed optimizer).

    ``parallel_state`` is needed for the grad norm under tensor or pipeline parallelism (None: neither).
    """
    if not isinstance(config, OptimizerConfig):
        raise ValueError(f"config must be an OptimizerConfig, got {type(config).__name__}")
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise ValueError(f"model must be a module or a non-empty list of modules, got {model!r}")
    return MegatronOptimizer(config, chunks, parallel_state=parallel_state)


__all__ = ["ConstantGradScaler", "DynamicGradScaler", "MegatronOptimizer", "MemoryReport", "OptimizerConfig",
           "get_optimizer", "memory_report"]
