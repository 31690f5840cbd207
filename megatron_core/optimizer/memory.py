"""``memory_report``: per-rank bytes of the model states (parameters, gradients, master weights, optimizer
states), the quantities the ZeRO paper counts (transient gathered parameters and grad buckets excluded)."""
from __future__ import annotations

import dataclasses
from typing import Sequence, Union

from torch import nn

from megatron_core.distributed import DistributedDataParallel
from megatron_core.optimizer.optimizer import MegatronOptimizer


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank. With CPU offload, master weights and optimizer states are on the host."""

    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    offloaded: bool = False

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states


def _chunk_bytes(chunk: nn.Module) -> tuple[int, int]:
    if isinstance(chunk, DistributedDataParallel):
        params = sum(t.numel() * t.element_size() for t in chunk.param_buffers.values())
        grads = sum(t.numel() * t.element_size() for t in chunk.grad_buffers.values())
        in_buffers = {p for b in chunk.buckets for p in b.params}
        frozen = [p for p in chunk.module.parameters() if p not in in_buffers]
        return params + sum(p.numel() * p.element_size() for p in frozen), grads
    unique = list(dict.fromkeys(chunk.parameters()))
    params = sum(p.numel() * p.element_size() for p in unique)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in unique if p.grad is not None)
    return params, grads


def memory_report(model: Union[nn.Module, Sequence[nn.Module]], optimizer: MegatronOptimizer) -> MemoryReport:
    """Per-rank model-state bytes of ``model`` (a module or model chunks, possibly DDP-wrapped) and
    ``optimizer`` (master weights that alias fp32 model storage count as parameters only)."""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    params = grads = 0
    for chunk in chunks:
        chunk_params, chunk_grads = _chunk_bytes(chunk)
        params, grads = params + chunk_params, grads + chunk_grads
    return MemoryReport(parameters=params, gradients=grads, master_weights=optimizer.master_weight_bytes(),
                        optimizer_states=optimizer.optimizer_state_bytes(),
                        offloaded=optimizer.config.optimizer_cpu_offload)
