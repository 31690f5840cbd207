"""Per-rank memory of the model states: ``memory_report`` (the bytes the ZeRO paper counts, next to what a
``LiveMemoryTracker`` measured in a real run) and ``memory_categories`` (which live tensors are which)."""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn

from megatron_core.distributed import DistributedDataParallel
from megatron_core.optimizer.offload.nvme_adam import NvmeAdam
from megatron_core.optimizer.optimizer import MegatronOptimizer
from megatron_core.utils.live_memory import LiveMemoryTracker, peak_rss_bytes

CATEGORIES = ("parameters", "gathered_parameters", "gradients", "grad_buckets", "master_weights",
              "optimizer_states", "offloaded_parameters", "activations")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank. With CPU offload, master weights and optimizer states are on the host; with
    NVMe offload they are in files (``nvme_master_weights``, ``nvme_optimizer_states``) and count zero in
    ``master_weights`` / ``optimizer_states`` (memory); ``tiers`` names where each state lives.

    ``parameters`` ... ``optimizer_states`` are the persistent model states (transient gathered parameters
    and gradient buckets excluded). ``measured_peak`` (when a tracker was given) is the largest live tensor
    total of the tracked run and ``measured_breakdown`` its split over ``CATEGORIES`` at that moment;
    ``measured_peak_by_category`` the largest bytes of each category; ``peak_rss`` the process's peak RSS.
    """

    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    offloaded: bool = False
    nvme_master_weights: int = 0
    nvme_optimizer_states: int = 0
    tiers: Optional[dict[str, str]] = None
    measured_peak: Optional[int] = None
    measured_breakdown: Optional[dict[str, int]] = None
    measured_peak_by_category: Optional[dict[str, int]] = None
    peak_rss: Optional[int] = None

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states


def _chunks(model: Union[nn.Module, Sequence[nn.Module]]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


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


class MemoryCategories:
    """``memory_categories(model, optimizer)`` as a callable for ``LiveMemoryTracker(categories=...)``, with the
    module walks done once: the tracker calls it after every op, and finding the parameters through
    ``nn.Module.parameters()`` each time took a third of a dry run's step. The parameters, buffers, buckets
    and optimizer pieces are fixed for the tracker's life; which of them hold a ``.grad``, a gathered buffer
    or optimizer state is read at every call."""

    def __init__(self, model: Union[nn.Module, Sequence[nn.Module]],
                 optimizer: Optional[MegatronOptimizer] = None) -> None:
        self.chunks = [(chunk, isinstance(chunk, DistributedDataParallel),
                        tuple((chunk.module if isinstance(chunk, DistributedDataParallel) else chunk).parameters()))
                       for chunk in _chunks(model)]
        self.optimizer = optimizer

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for chunk, wrapped, params in self.chunks:
            if wrapped:
                yield from _buffer_categories(chunk)
            for param in params:
                if param.grad is not None:
                    yield ("grad_buckets" if wrapped else "gradients"), param.grad
                if not wrapped and param.numel():
                    yield "parameters", param
        if self.optimizer is not None:
            yield from _optimizer_categories(self.optimizer)


def _buffer_categories(chunk: DistributedDataParallel) -> Iterator[tuple[str, torch.Tensor]]:
    yield from (("parameters", t) for t in chunk.param_buffers.values())
    yield from (("gradients", t) for t in chunk.grad_buffers.values())
    for bucket in chunk.buckets:
        if bucket.shard_home is not None:  # parameter offload: the device copy (freed between uses)
            yield "parameters", bucket.param_shard
            home = getattr(bucket.shard_home, "home", None)
            if home is not None:  # --param-offload cpu: the host copy
                yield "offloaded_parameters", home
        if bucket.shard_params and bucket.param_data is not None:
            yield "gathered_parameters", bucket.param_data
        if bucket.holds_transient_grads:
            yield "grad_buckets", bucket.grad_data


def _optimizer_categories(optimizer: MegatronOptimizer) -> Iterator[tuple[str, torch.Tensor]]:
    for piece in optimizer.pieces:
        if not piece.aliased and piece.master is not None:
            yield "master_weights", piece.master
    if isinstance(optimizer.optimizer, NvmeAdam):  # the ring buffers streaming the files, during step()
        for name, buffer in optimizer.optimizer.live_buffers:
            yield ("master_weights" if name == "master" else "optimizer_states"), buffer
    elif optimizer.optimizer is not None:
        for state in optimizer.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    yield "optimizer_states", value


def memory_categories(model: Union[nn.Module, Sequence[nn.Module]],
                      optimizer: Optional[MegatronOptimizer] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(category, tensor)`` for every model-state tensor alive now (for ``LiveMemoryTracker``): persistent
    buffers, stage-3 gathered parameters, transient grad buckets and autograd's ``.grad`` before it moves
    into a bucket, fp32 masters and optimizer states. Everything else a run holds is activations. A tracker
    that samples often takes ``MemoryCategories(model, optimizer)`` instead (the same, walked once)."""
    return MemoryCategories(model, optimizer)()


def memory_report(model: Union[nn.Module, Sequence[nn.Module]], optimizer: MegatronOptimizer, *,
                  tracker: Optional[LiveMemoryTracker] = None) -> MemoryReport:
    """Per-rank model-state bytes of ``model`` (a module or model chunks, possibly DDP-wrapped) and
    ``optimizer`` (master weights that alias fp32 model storage count as parameters only); with ``tracker``
    (a ``LiveMemoryTracker`` that ran over training steps) also the measured peaks and the peak RSS."""
    params = grads = 0
    for chunk in _chunks(model):
        chunk_params, chunk_grads = _chunk_bytes(chunk)
        params, grads = params + chunk_params, grads + chunk_grads
    measured = {}
    if tracker is not None:
        measured = dict(measured_peak=tracker.peak_total, measured_breakdown=dict(tracker.peak_breakdown),
                        measured_peak_by_category=dict(tracker.peak_by_category), peak_rss=peak_rss_bytes())
    nvme = optimizer.nvme_bytes()
    return MemoryReport(parameters=params, gradients=grads, master_weights=optimizer.master_weight_bytes(),
                        optimizer_states=optimizer.optimizer_state_bytes(),
                        offloaded=optimizer.config.optimizer_cpu_offload or bool(nvme),
                        nvme_master_weights=nvme.get("master_weights", 0),
                        nvme_optimizer_states=nvme.get("optimizer_states", 0), tiers=_tiers(model, optimizer),
                        **measured)


def _tiers(model: Union[nn.Module, Sequence[nn.Module]], optimizer: MegatronOptimizer) -> dict[str, str]:
    """Where each model state lives: ``"cuda"`` / ``"cpu"`` (the device), ``"host"`` (CPU offload: a
    separate host copy, which on a CPU-only machine is the same memory), ``"nvme"`` (files)."""
    chunks = _chunks(model)
    device = next((p.device.type for c in chunks for p in c.parameters() if p.device.type != "meta"), "cpu")
    offload = next((c.param_offload for c in chunks if isinstance(c, DistributedDataParallel)), "none")
    states = "nvme" if optimizer.nvme_bytes() else "host" if optimizer.config.optimizer_cpu_offload else device
    return {"parameters": device if offload == "none" else offload, "gradients": device,
            "master_weights": states, "optimizer_states": states}
