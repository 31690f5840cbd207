"""The CUDA runtime calls megatron_core makes, behind one small interface that a dry run can answer.

Everything outside a code path that runs only on a CUDA device goes through here instead of ``torch.cuda``:
whether CUDA is there, the current device, its name, compute capability and SM count, its peak allocated
bytes, its RNG state and the cache flush. On a real machine each function is the ``torch.cuda`` call. In a
dry-run process (``tools/dry_run.py``: fake CUDA tensors on a machine without a GPU, see
``megatron_core.dryrun``) the environment variable ``MEGATRON_CORE_FAKE_CUDA`` names the simulated target
(``sm_80``, ``sm_90``, ``sm_100``) and the answers are that GPU's: its name, capability and SM count, and no
memory calls (the dry run measures live tensor bytes itself).
"""
from __future__ import annotations

import dataclasses
import os
from types import MappingProxyType
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from megatron_core.dryrun.fake_cuda import TARGET_ENV as FAKE_CUDA_ENV

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class SimulatedGPU:
    """The GPU a dry run stands in for: what its runtime would report."""

    name: str
    capability: tuple[int, int]
    multi_processor_count: int
    total_memory: int


SIMULATED_GPUS = MappingProxyType({
    "sm_80": SimulatedGPU("NVIDIA A100-SXM4-80GB", (8, 0), 108, 80 * GIB),
    "sm_89": SimulatedGPU("NVIDIA L40S", (8, 9), 142, 48 * GIB),
    "sm_90": SimulatedGPU("NVIDIA H100 80GB HBM3", (9, 0), 132, 80 * GIB),
    "sm_100": SimulatedGPU("NVIDIA B200", (10, 0), 148, 180 * GIB),
})


def simulated_gpu() -> Optional[SimulatedGPU]:
    """The GPU this dry-run process simulates, or None in a real run; ValueError for an unknown target."""
    target = os.environ.get(FAKE_CUDA_ENV)
    if not target:
        return None
    if target not in SIMULATED_GPUS:
        raise ValueError(f"{FAKE_CUDA_ENV}={target!r} is not a simulated target; use one of {list(SIMULATED_GPUS)}")
    return SIMULATED_GPUS[target]


def is_dry_run() -> bool:
    return simulated_gpu() is not None


def cuda_available() -> bool:
    """Whether CUDA devices are there (a dry run's simulated ones count)."""
    return is_dry_run() or torch.cuda.is_available()


def is_device_backend(backend: Optional[str]) -> bool:
    """Whether a process-group backend moves CUDA tensors: nccl, and torch's ``fake`` backend of a dry run
    (which stands in for nccl when code picks its path)."""
    return backend in ("nccl", "fake")


def current_device() -> int:
    return 0 if is_dry_run() else torch.cuda.current_device()


def set_device(index: int) -> None:
    if not is_dry_run():
        torch.cuda.set_device(index)


def device_count() -> int:
    return 8 if is_dry_run() else torch.cuda.device_count()


def device_name(device=None) -> str:
    gpu = simulated_gpu()
    return gpu.name if gpu else torch.cuda.get_device_name(device)


def device_capability(device=None) -> tuple[int, int]:
    gpu = simulated_gpu()
    return gpu.capability if gpu else tuple(torch.cuda.get_device_capability(device))


def multi_processor_count(device=None) -> int:
    gpu = simulated_gpu()
    return gpu.multi_processor_count if gpu else torch.cuda.get_device_properties(device).multi_processor_count


def max_memory_allocated(device=None) -> Optional[int]:
    """Peak allocated bytes of ``device``; None in a dry run (its tensors allocate nothing)."""
    return None if is_dry_run() else int(torch.cuda.max_memory_allocated(device))


def empty_cache() -> None:
    if not is_dry_run():
        torch.cuda.empty_cache()


def record_memory_history() -> None:
    """Starts CUDA's allocation history (``--record-memory-history``); nothing in a dry run (no allocator)."""
    if not is_dry_run():
        torch.cuda.memory._record_memory_history()


def dump_memory_snapshot(path: str) -> None:
    if not is_dry_run():
        torch.cuda.memory._dump_snapshot(path)


def get_rng_state(device=None) -> torch.Tensor:
    """The device generator's state (a dry run's: a fixed 16-byte state, as a CUDA generator's seed + offset)."""
    if is_dry_run():
        return torch.zeros(16, dtype=torch.uint8)
    return torch.cuda.get_rng_state(device)


def set_rng_state(state: torch.Tensor, device=None) -> None:
    if not is_dry_run():
        torch.cuda.set_rng_state(state, device)


def seeded_rng_state(device: torch.device, seed: int) -> torch.Tensor:
    """The state of a new generator of ``device`` seeded with ``seed`` (any device type; a dry run's CUDA
    generator: its fixed state, as ``get_rng_state``)."""
    if device.type == "cuda" and is_dry_run():
        return get_rng_state(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator.get_state()


def seeded_generator(device: torch.device, seed: int) -> Optional[torch.Generator]:
    """A new generator of ``device`` seeded with ``seed``; None for a dry run's CUDA (a CPU build has no CUDA
    generator, and a draw on fake tensors needs none: it has no values)."""
    if device.type == "cuda" and is_dry_run():
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def holds_no_data(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has shape but no values: on the meta device, or a dry run's fake tensor (writing
    values into it would only cost time)."""
    return tensor.is_meta or is_fake(tensor)
