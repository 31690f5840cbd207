"""Loading a checkpoint into this rank's model chunks (and optimizer), strictly by default.

Before anything is read, the checkpoint's tensors are compared with the model's on every rank
(``compatibility.tensor_mismatches``): a tensor missing, an extra one or one of another shape is an error that
lists them all. With ``strict=False`` (``--finetune --ignore-mismatched-sizes``) the tensors that fit are
loaded, the others keep their initialization, and a vocab of another size keeps the checkpoint's rows for
the ids both vocabularies have (new rows keep their initialization; a smaller vocab drops the extra rows).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.checkpointing.checkpoint import _layout, _verify, full_parameters
from megatron_core.checkpointing.compatibility import TensorMismatches, model_global_shapes, tensor_mismatches
from megatron_core.checkpointing.layout import global_named_buffers, global_named_parameters
from megatron_core.checkpointing.optimizer_state import restore_optimizer_state
from megatron_core.checkpointing.shard_reader import VOCAB_PARAMS, ShardReader, open_safetensors, verify_once
from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.utils import accelerator

logger = logging.getLogger(__name__)


def check_model_matches(folder: str, metadata: dict, named: dict, buffers: dict, *, config: TransformerConfig,
                        state: ParallelState, true_vocab_size: int, strict: bool) -> TensorMismatches:
    """Collective: raises ValueError listing every mismatch under ``strict``; returns them otherwise."""
    shapes = model_global_shapes({**named, **buffers}, state.tp_size, etp_size=state.etp_size)
    mismatches = tensor_mismatches(metadata, shapes, optional=set(buffers),
                                   tied_output=not config.untie_embeddings_and_output_weights,
                                   true_vocab_size=true_vocab_size)
    if mismatches and strict:
        raise ValueError(mismatches.describe(folder) + ". Resume with the model the checkpoint was written for, "
                         "or pass --finetune --ignore-mismatched-sizes to load what fits on purpose")
    if mismatches and state.rank == 0:
        print(f" --ignore-mismatched-sizes: {mismatches.describe(folder)}; those tensors keep their "
              "initialization (a vocab of another size keeps the rows both vocabularies have)", flush=True)
    return mismatches


def load_model_weights(folder: str, metadata: dict, *, model_chunks: Sequence[nn.Module], config: TransformerConfig,
                       state: ParallelState, optimizer: Optional[Any] = None, verify_group: Any = None,
                       shared_verify: bool = False, require_checksums: bool = True, strict: bool = True,
                       true_vocab_size: Optional[int] = None) -> ShardReader:
    """Copies every local parameter from the checkpoint, reading only the slices of this rank's tp shards
    (``ShardReader``); with ``optimizer``, also its master weights and states (without it, call
    ``optimizer.reload_model_params()``). With ``shared_verify`` every rank of ``verify_group`` (default:
    all) calls this and the files' sha256 checks are split over them (collective); otherwise this rank
    verifies each file it opens. The tensor check is collective over every rank, and so are ZeRO-3 wrappers
    (they gather and re-shard). ``true_vocab_size``: the run's (default: the checkpoint's). Returns the
    reader (its ``bytes_read`` and ``files_hashed``)."""
    true_vocab = metadata["true_vocab_size"] if true_vocab_size is None else true_vocab_size
    with full_parameters(model_chunks):
        named = global_named_parameters(model_chunks, config, state)
        buffers = global_named_buffers(model_chunks, config, state)
        mismatches = check_model_matches(folder, metadata, named, buffers, config=config, state=state,
                                         true_vocab_size=true_vocab, strict=strict)
        skip = set(mismatches.missing) | {n for n, (saved, ours) in mismatches.reshaped.items()
                                          if not n.endswith(VOCAB_PARAMS) or saved[1:] != ours[1:]}
        hashed = verify_once(folder, metadata, verify_group, require_checksums=require_checksums) \
            if shared_verify else None
        with ShardReader(folder, metadata, state, verified=shared_verify,
                         require_checksums=require_checksums) as reader:
            for name, param in named.items():
                if name in skip:
                    continue
                shard = reader.read(name, param)
                if shard is None:
                    raise ValueError(f"checkpoint {folder} has no tensor {name!r} (was it written for another "
                                     "model shape?)")
                if name in mismatches.reshaped:  # a vocab of another size (non-strict): the shared rows only
                    shard = _shared_vocab_rows(shard, param, metadata["true_vocab_size"], state.tp_rank)
                with torch.no_grad():
                    param.copy_(shard.to(param.dtype))
            _load_buffers(reader, buffers, folder)
            _store_gathered(model_chunks)
            if optimizer is not None:
                if metadata.get("optimizer") is None:
                    raise ValueError(f"checkpoint {folder} holds no optimizer state; pass --no-load-optim")
                restore_optimizer_state(optimizer, {id(p): n for n, p in named.items()}, metadata["optimizer"],
                                        reader.read)
    if hashed is not None:
        reader.files_hashed = hashed
    return reader


def _load_buffers(reader: ShardReader, buffers: dict[str, torch.Tensor], folder: str) -> None:
    for name, buffer in buffers.items():
        shard = reader.read(name, buffer)
        if shard is None:  # a checkpoint from before buffers were saved: the buffer keeps its value
            logger.warning("checkpoint %s has no buffer %r: it keeps its initial value", folder, name)
            continue
        with torch.no_grad():
            buffer.copy_(shard.to(buffer.dtype))


def _shared_vocab_rows(shard: torch.Tensor, param: torch.Tensor, saved_vocab: int, tp_rank: int) -> torch.Tensor:
    """This rank's vocab shard (``[V/tp, h]``) with the rows of ids the checkpoint does not have taken from
    the parameter's initialization."""
    rows = param.shape[0]
    global_ids = torch.arange(tp_rank * rows, (tp_rank + 1) * rows)
    merged = param.detach().clone()
    keep = global_ids < saved_vocab
    merged[keep] = shard[keep].to(merged.dtype)
    return merged


def _store_gathered(chunks: Sequence[nn.Module]) -> None:
    """ZeRO-3: writes the loaded full parameters into each rank's persistent shard."""
    for chunk in chunks:
        if getattr(getattr(chunk, "config", None), "zero_stage", 0) == 3:
            for bucket in chunk.buckets:
                for param in bucket.params:
                    bucket.load_full(param, param.data)


def load_rng(folder: str, metadata: dict, *, state: ParallelState, layout_extra: Optional[dict] = None,
             require_checksums: bool = True) -> bool:
    """Restores this rank's RNG states when the checkpoint has the same layout; returns whether it did."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if metadata["layout"] != _layout(state, layout_extra or {}):
        return False
    file = f"rng_rank{rank:05d}.safetensors"
    if file not in metadata["checksums"]:  # e.g. a converted checkpoint: no RNG states to restore
        return False
    _verify(folder, metadata, {file}, require_checksums=require_checksums)
    with open_safetensors(os.path.join(folder, file)) as handle:
        torch.set_rng_state(handle.get_tensor("cpu"))
        if state.device.type == "cuda" and "cuda" in handle.keys():
            accelerator.set_rng_state(handle.get_tensor("cuda"), state.device)
        tracker = {k.split("/", 1)[1]: handle.get_tensor(k) for k in handle.keys() if k.startswith("tracker/")}
        if tracker:
            state.rng_tracker.set_states(tracker)
    return True


__all__ = ["load_model_weights", "load_rng", "check_model_matches"]
