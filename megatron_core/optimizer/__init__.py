"""Mixed-precision and distributed (ZeRO 1-3) optimizer, loss scaling, clipping, CPU offload, memory report."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from torch import nn

from megatron_core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_core.optimizer.memory import MemoryReport, memory_report
from megatron_core.optimizer.optimizer import MegatronOptimizer
from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.parallel_state import ParallelState


def get_optimizer(config: OptimizerConfig, model: Union[nn.Module, Sequence[nn.Module]], *,
                  parallel_state: Optional[ParallelState] = None,
                  no_weight_decay_cond: Optional[Callable[[nn.Parameter], bool]] = None) -> MegatronOptimizer:
    """The optimizer over ``model`` (a module or a list of model chunks, each possibly wrapped in
    ``DistributedDataParallel``; stages 1-3 of the wrapper make it a distributed optimizer).

    ``parallel_state`` is needed for the grad norm under tensor or pipeline parallelism (None: neither).
    ``no_weight_decay_cond(param)`` True exempts a parameter from weight decay (Megatron-LM's argument of that
    name, given the parameter only); None means Megatron's default: parameters with fewer than 2 dims.
    """
    if not isinstance(config, OptimizerConfig):
        raise ValueError(f"config must be an OptimizerConfig, got {type(config).__name__}")
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise ValueError(f"model must be a module or a non-empty list of modules, got {model!r}")
    return MegatronOptimizer(config, chunks, parallel_state=parallel_state,
                             no_weight_decay_cond=no_weight_decay_cond)


__all__ = ["ConstantGradScaler", "DynamicGradScaler", "MegatronOptimizer", "MemoryReport", "OptimizerConfig",
           "get_optimizer", "memory_report"]
