"""``offload_parameters``: ZeRO-3 parameter shards that live on the host or in NVMe files (``--param-offload``,
DeepSpeed's ``offload_param: {device: cpu|nvme}``), brought into device memory only while used.

Each bucket of a stage-3 ``DistributedDataParallel`` gets a *home* (``HostHome`` or ``NvmeHome``) holding its
shard; the device copy of the shard is freed. ``Bucket.start_gather`` fetches the shard from its home just
before the all-gather (the ZeRO-3 gatherer starts the gather of the next unit one unit ahead, so the fetch is
prefetched with it) and frees it again as soon as the gather completes; the optimizer step fetches every
shard, updates it and writes it back home. The fetch is synchronous (a host copy or a file read), issued when
the gather is started.

On a CPU-only machine the "device" is host memory too, so ``cpu`` keeps a second host copy and measures only
the copying; ``nvme`` really moves the shards out of memory.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_core.distributed import DistributedDataParallel
from megatron_core.optimizer.offload.state_files import StateFiles

PARAM_OFFLOAD = ("none", "cpu", "nvme")


class HostHome:
    """A bucket's shard kept in host memory (pinned when the device is CUDA)."""

    tier = "cpu"

    def __init__(self, shard: torch.Tensor) -> None:
        self.home = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=shard.device.type == "cuda")
        self.home.copy_(shard)

    def load_into(self, shard: torch.Tensor) -> None:
        shard.copy_(self.home, non_blocking=shard.device.type == "cuda")

    def store_from(self, shard: torch.Tensor) -> None:
        self.home.copy_(shard)


class NvmeHome:
    """A bucket's shard kept in ``files`` under ``name``."""

    tier = "nvme"

    def __init__(self, shard: torch.Tensor, files: StateFiles, name: str) -> None:
        self.files, self.name = files, name
        self.store_from(shard)

    def load_into(self, shard: torch.Tensor) -> None:
        # through a staging copy: file I/O exposes a tensor's bytes to numpy, which makes its storage
        # non-resizable, and the shard's storage is freed and reallocated
        staging = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=shard.device.type == "cuda")
        self.files.read(self.name, 0, staging)
        shard.copy_(staging)

    def store_from(self, shard: torch.Tensor) -> None:
        self.files.write(self.name, 0, shard.detach().to("cpu", copy=True))


def offload_parameters(ddp: DistributedDataParallel, tier: str, *, directory: Optional[str] = None,
                       rank: int = 0) -> None:
    """Moves the parameter shards of a stage-3 ``ddp`` to ``tier`` (``"cpu"`` or ``"nvme"``; ``"none"`` does
    nothing). Call it before ``get_optimizer`` (the optimizer keeps views of the shards).

    Raises:
        ValueError: an unknown tier, a stage other than 3, or ``nvme`` without ``directory``.
    """
    if tier not in PARAM_OFFLOAD:
        raise ValueError(f"--param-offload {tier!r} is not one of {PARAM_OFFLOAD}")
    if tier == "none":
        return
    if ddp.config.zero_stage != 3:
        raise ValueError(f"--param-offload {tier} needs ZeRO stage 3 (got {ddp.config.zero_stage}): parameters "
                         "are only sharded there (--zero-stage 3)")
    if tier == "nvme" and directory is None:
        raise ValueError("--param-offload nvme needs a folder: pass --param-nvme-offload-dir (or "
                         "--optimizer-nvme-offload-dir)")
    files = None
    if tier == "nvme":
        sizes = {f"param{b.index}": b.shard_size * b.kind.param_dtype.itemsize for b in ddp.buckets}
        files = StateFiles(directory, rank=rank, sizes=sizes, flag="--param-nvme-offload-dir")
    ddp.offload_param_shards(lambda bucket: HostHome(bucket.param_shard) if files is None else
                             NvmeHome(bucket.param_shard, files, f"param{bucket.index}"), tier=tier)
