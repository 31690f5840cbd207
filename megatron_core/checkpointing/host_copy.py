"""The host copies a save takes: only the tensors this rank writes, and with ZeRO-3 one bucket gathered at a
time.

A checkpoint file per tp x pp is written by dp rank 0 (and cp rank 0) of that tp x pp, the experts' file per
ep x pp by expert-dp rank 0; every other rank writes only its RNG file, so it copies no weight to the host.
With ZeRO-3 the full parameters exist only while gathered: ``DistributedDataParallel.gathered_buckets``
gathers one bucket (collective over dp, every rank takes part, writer or not), the writers copy what they
write from it, and it is released before the next one, so a save never holds the whole model gathered.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from megatron_core.parallel_state import ParallelState


def writes_dense(state: ParallelState) -> bool:
    """Whether this rank writes its tp x pp shard file (dense weights, their optimizer states, buffers)."""
    return state.dp_rank == 0 and state.cp_rank == 0


def writes_experts(state: ParallelState) -> bool:
    """Whether this rank writes its ep x pp experts file."""
    return state.expert_dp_rank == 0


def _writes(param: nn.Parameter, state: ParallelState) -> bool:
    return writes_experts(state) if getattr(param, "is_expert", False) else writes_dense(state)


def host_copies(chunks: Sequence[nn.Module], named: dict[str, nn.Parameter],
                state: ParallelState) -> dict[str, tuple[torch.Tensor, nn.Parameter]]:
    """``{global name: (host copy, parameter)}`` of the parameters this rank writes (an own copy: training
    may go on while a background writer holds it). Collective with ZeRO-3 wrappers (one all-gather per
    bucket over dp, on every rank)."""
    names = {id(param): name for name, param in named.items()}
    copies: dict[str, tuple[torch.Tensor, nn.Parameter]] = {}
    for chunk in chunks:
        groups = chunk.gathered_buckets() if hasattr(chunk, "gathered_buckets") else [list(chunk.parameters())]
        for params in groups:
            for param in params:
                name = names.get(id(param))
                if name is not None and name not in copies and _writes(param, state):
                    copies[name] = (param.detach().to("cpu", copy=True).contiguous(), param)
    return copies


def buffer_copies(buffers: dict[str, torch.Tensor],
                  state: ParallelState) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Host copies of the model-state buffers (replicated; written with the dense weights)."""
    if not writes_dense(state):
        return {}
    return {name: (buffer.detach().to("cpu", copy=True).contiguous(), buffer) for name, buffer in buffers.items()}
