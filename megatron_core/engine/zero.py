"""DeepSpeed's ``deepspeed.zero`` namespace: ``Init`` (sharded construction, see ``zero_init``) and
``GatheredParameters`` (full ZeRO-3 parameters inside a block, e.g. to read or change weights).

At ZeRO-3 every parameter of the engine's model is an empty tensor outside forward and backward; its
1/dp shard lives in a bucket of the ``DistributedDataParallel`` wrapper (``param.zero_bucket()`` returns it).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.distributed import DistributedDataParallel
from megatron_core.engine.zero_init import Init


def register_zero3_buckets(ddp: DistributedDataParallel) -> None:
    """Gives every stage-3 parameter of ``ddp`` a ``zero_bucket`` (a weak reference to its bucket)."""
    if ddp.config.zero_stage != 3:
        return
    for bucket in ddp.buckets:
        for param in bucket.params:
            param.zero_bucket = weakref.ref(bucket)


def _bucket_of(param: torch.Tensor) -> Any:
    ref = getattr(param, "zero_bucket", None)
    return ref() if ref is not None else None


class GatheredParameters:
    """Inside the block the given ZeRO-3 parameters are full on every rank (DeepSpeed's context of that name).

    Args:
        params: a parameter or an iterable of them (others than ZeRO-3 ones are left alone, as DeepSpeed).
        modifier_rank: None to read only; a global rank whose changes to the parameters are broadcast to
            every rank on exit and written into each rank's shard (with fp32 parameters the shard is the
            optimizer's master; for fp16/bf16 models reload the masters with
            ``engine.optimizer.reload_model_params()``).
        fwd_module: accepted for DeepSpeed's signature (no external-parameter registry here).
        enabled: False makes the block a no-op.
    Collectives: an all-gather over dp of each parameter's bucket on entry, and with ``modifier_rank`` a
    broadcast of each parameter on exit; every dp rank must enter with the same parameters.
    """

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter]], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[nn.Module] = None, enabled: bool = True) -> None:
        del fwd_module
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        self.params = list(dict.fromkeys(p for p in params if _bucket_of(p) is not None)) if enabled else []
        self.buckets = list(dict.fromkeys(_bucket_of(p) for p in self.params))
        self.modifier_rank = modifier_rank
        self._was_gathered: list[bool] = []

    def __enter__(self) -> None:
        self._was_gathered = [bucket.gathered for bucket in self.buckets]
        for bucket in self.buckets:
            bucket.start_gather()
        for bucket in self.buckets:
            bucket.wait_gather()

    def __exit__(self, *exc: Any) -> None:
        if self.modifier_rank is not None and exc[0] is None:
            with torch.no_grad():
                for param in self.params:
                    bucket = _bucket_of(param)
                    if bucket.dp_group is not None and dist.get_world_size(bucket.dp_group) > 1:
                        dist.broadcast(param.data, src=self.modifier_rank, group=bucket.dp_group)
                    bucket.load_full(param, param.data)
        for bucket, was_gathered in zip(self.buckets, self._was_gathered):
            if not was_gathered:
                bucket.release_params()


__all__ = ["GatheredParameters", "Init", "register_zero3_buckets"]
