"""DeepSpeed's ``deepspeed.checkpointing`` (activation checkpointing), as ``megatron_core.engine.checkpointing``.

``checkpoint(function, *args)`` recomputes ``function``'s forward during backward instead of keeping its
activations: ``torch.utils.checkpoint.checkpoint`` without reentrance (the RNG state is restored for the
recompute, so dropout masks repeat). It works at every ZeRO stage: at stage 3 the recomputing forward
gathers each unit again (a reentrant checkpoint is not supported there: its backward recomputes outside the
gather hooks). ``configure`` takes DeepSpeed's options; none changes anything here (the engine has no
tensor parallelism to partition activations over, and keeps them where they are).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable

import torch.utils.checkpoint

from megatron_core.engine.schema import warn_unused

_OPTIONS = MappingProxyType({"partition_activations": "no tensor parallelism in the engine: nothing to partition over",
            "contiguous_checkpointing": "recompute frees activations; no contiguous buffer",
            "num_checkpoints": "each checkpoint() call is one segment",
            "checkpoint_in_cpu": "checkpointed inputs stay where they are",
            "synchronize": "no device synchronization is needed", "profile": "no recompute profiler"})


def configure(mpu_: Any = None, deepspeed_config: Any = None, **options: Any) -> None:
    """Accepts DeepSpeed's arguments (``partition_activations``, ``checkpoint_in_cpu``, ...): each set one
    warns once that it has no effect here."""
    del mpu_, deepspeed_config
    for name, value in options.items():
        if name not in _OPTIONS:
            raise ValueError(f"checkpointing.configure() got an unknown option {name!r}; DeepSpeed's are "
                             f"{sorted(_OPTIONS)}")
        if value:
            warn_unused(f"checkpointing.configure({name}=...)", _OPTIONS[name])


def is_configured() -> bool:
    return True


def checkpoint(function: Callable, *args: Any) -> Any:
    """``function(*args)``, recomputed in backward (``torch.utils.checkpoint`` with ``use_reentrant=False``)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


__all__ = ["checkpoint", "configure", "is_configured"]
