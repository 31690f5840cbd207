"""Configuration of the data-parallel wrapper (``DistributedDataParallel``)."""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Optional

ZERO_STAGES = (0, 1, 2, 3)
# Megatron's --data-parallel-sharding-strategy names for each ZeRO stage.
SHARDING_STRATEGIES = MappingProxyType({"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3})


@dataclasses.dataclass(kw_only=True)
class DistributedDataParallelConfig:
    """How gradients are reduced over the data-parallel group and what each dp rank keeps.

    Every field is keyword-only; invalid values raise ``ValueError`` naming the value and the fix.
    """

    zero_stage: int = 0
    """0: every dp rank keeps everything and all-reduces grads (Megatron ``no_shard``). 1: the optimizer keeps
    fp32 master weights and states for its 1/dp shard (``--use-distributed-optimizer``, ``optim``); grads
    accumulate in a full buffer and are reduce-scattered, as Megatron's distributed optimizer does.
    2: grads are reduce-scattered after every backward and only the 1/dp shard is kept (``optim_grads``).
    3: parameters are sharded too and all-gathered around each submodule (``optim_grads_params``)."""

    bucket_size: Optional[int] = None
    """Elements per gradient bucket (stages 0-2). None means Megatron's default max(40M, 1M * dp) at stages 0-1,
    where the grad buffer is persistent anyway, and 4M at stage 2, where a full-size bucket exists transiently
    during backward; either capped at a quarter of the model (at least 1M), so small models overlap too. At stage 3 a
    bucket holds the parameters of one submodule instead."""

    overlap_grad_reduce: bool = True
    """Launch each bucket's collective from a backward hook as soon as its grads are ready (else all buckets
    are reduced by ``finish_grad_sync()``). Matters at stages 0-1 only: stages 2-3 always launch from the hooks, since
    their full-size grad buckets are transient (deferred, all of them would exist at once at backward's end)."""

    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce grads in fp32 even for bf16/fp16 parameters (4 bytes/param of grads)."""

    average_in_collective: bool = False
    """True: ReduceOp.AVG inside the collective (NCCL only). False: grads are pre-scaled by 1/dp and summed
    (Megatron's default; works on every backend)."""

    overlap_param_gather: bool = False
    """Stages 1-2 (Megatron's ``--overlap-param-gather``): after the optimizer step the all-gather of the updated
    parameters is only started, per bucket; each module waits for its buckets just before its first use in
    the next forward, so the gather overlaps the forward. (Stage 3 always gathers on demand, with prefetch.)"""

    p2p_collectives: Optional[bool] = None
    """Stages 1-3: each bucket's reduce-scatter and parameter all-gather as one batch of ``isend``/``irecv``
    (``p2p_collectives``): chunk j of the grads goes to rank j and is summed there on arrival; each rank's
    parameter shard goes to every other rank, straight into its slot. None (default) picks them on gloo, whose
    collectives cost several times the same bytes point to point (14 MB over 2 ranks: reduce-scatter 16.0 ms
    wall / 10.1 ms CPU, all-gather 10.3 / 9.1 ms, a pairwise exchange 2.2 / 1.8 ms). A reduce-scatter holds
    (dp - 1)/dp of the bucket in receive buffers while in flight (gloo's and NCCL's own reduce into the rank's
    slice of the bucket: none). NCCL keeps its own collectives. Stage 0 all-reduces with the backend's
    all-reduce either way."""

    reshard_after_forward: bool = True
    """Stage 3: free each unit's gathered parameters after its forward and gather them again for its backward
    (FSDP's ``reshard_after_forward``). False keeps them gathered from forward until their grads are reduced
    (fewer gathers, more memory: FSDP's ZeRO-2-like mode)."""

    def __post_init__(self) -> None:
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage {self.zero_stage!r} is not one of {ZERO_STAGES}: use 0 (no sharding), "
                             "1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)")
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or self.bucket_size <= 0):
            raise ValueError(f"bucket_size {self.bucket_size!r} must be a positive number of elements "
                             "(or None for the default max(40M, 1M * dp))")
        if self.overlap_param_gather and self.zero_stage == 0:
            raise ValueError("overlap_param_gather=True needs the distributed optimizer (zero_stage 1 or 2, "
                             "--use-distributed-optimizer): at zero_stage 0 no parameters are gathered")

    @classmethod
    def from_sharding_strategy(cls, strategy: str, **kwargs) -> "DistributedDataParallelConfig":
        """Builds a config from Megatron's ``--data-parallel-sharding-strategy`` name."""
        if strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy {strategy!r} is not one of "
                             f"{sorted(SHARDING_STRATEGIES)}")
        return cls(zero_stage=SHARDING_STRATEGIES[strategy], **kwargs)

    def resolved_bucket_size(self, dp_size: int, *, total_numel: Optional[int] = None) -> int:
        """The bucket size in elements for a data-parallel group of ``dp_size`` ranks; with ``total_numel`` (the
        parameters to bucket) the default is capped at a quarter of them (at least 1M), so that a small model
        still gets several buckets whose collectives overlap the rest of backward."""
        if self.bucket_size is not None:
            return self.bucket_size
        default = 4_000_000 if self.zero_stage >= 2 else max(40_000_000, 1_000_000 * dp_size)
        if total_numel is not None:
            default = min(default, max(1_000_000, total_numel // 4))
        return default
