"""Layout-independent names and shards: every parameter is stored under its *global* name (global layer
numbers) with the record of how it is split over tp, so a checkpoint written at one tp/pp layout loads at
another."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside data-parallel (or other) wrappers that expose ``.module``."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def global_named_parameters(chunks: Sequence[nn.Module], config: TransformerConfig,
                            state: ParallelState) -> dict[str, nn.Parameter]:
    """``{global name: parameter}`` of this rank's model chunks: ``decoder.layers.<i>`` uses the global
    0-based layer index, so names are the same at every pipeline layout."""
    named = {}
    for vp, chunk in enumerate(chunks):
        offset = config.pipeline_layer_range(state.pp_rank, vp if state.vpp_size else None)[0]
        for name, param in unwrap(chunk).named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            named[".".join(parts)] = param
    return named


def global_named_buffers(chunks: Sequence[nn.Module], config: TransformerConfig,
                         state: ParallelState) -> dict[str, torch.Tensor]:
    """``{global name: buffer}`` of the persistent buffers of this rank's chunks that are model state (the
    MoE router's ``expert_bias``): replicated over tp, dp and ep, named like parameters (global layer)."""
    named = {}
    for vp, chunk in enumerate(chunks):
        offset = config.pipeline_layer_range(state.pp_rank, vp if state.vpp_size else None)[0]
        module = unwrap(chunk)
        persistent = {name for name, _ in module.named_buffers()} - _non_persistent(module)
        for name, buffer in module.named_buffers():
            if name not in persistent or not name.endswith(STATE_BUFFERS):
                continue
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            named[".".join(parts)] = buffer
    return named


STATE_BUFFERS = ("expert_bias", "fp8_amax_history", "fp8_scale")  # + FP8 delayed scaling (megatron_core.fp8.state)


def _non_persistent(module: nn.Module) -> set[str]:
    names = set()
    for prefix, sub in module.named_modules():
        for name in getattr(sub, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{name}" if prefix else name)
    return names


def partition_record(param: torch.Tensor) -> tuple[Optional[int], int]:
    """``(tp partition dim or None, stride)`` of a parameter."""
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim, getattr(param, "partition_stride", 1)
    return None, 1


def merge_shards(shards: Sequence[torch.Tensor], dim: Optional[int], stride: int) -> torch.Tensor:
    """The full tensor from its tp shards (in tp-rank order), undoing a strided partition."""
    if dim is None:
        return shards[0]
    tp = len(shards)
    blocks = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([blocks[i % tp][i // tp] for i in range(stride * tp)], dim)


def take_shard(full: torch.Tensor, dim: Optional[int], stride: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tp rank's shard of a full tensor (the inverse of ``merge_shards``; ``full`` itself, not a copy,
    when it is not split)."""
    if dim is None or tp_size == 1:
        return full
    blocks = full.chunk(stride * tp_size, dim)
    return torch.cat(blocks[tp_rank::tp_size], dim)


def repad_vocab(full: torch.Tensor, true_vocab: int, padded_vocab: int) -> torch.Tensor:
    """Rows ``[:true_vocab]`` of a vocab-padded weight, padded with zero rows to ``padded_vocab``."""
    if full.shape[0] == padded_vocab:
        return full
    rows = full[:min(true_vocab, padded_vocab)]  # (a smaller target vocab drops the rows it has no ids for)
    padding = torch.zeros((padded_vocab - rows.shape[0], *full.shape[1:]), dtype=full.dtype)
    return torch.cat([rows, padding], 0)
