"""Sharded, atomic, layout-independent checkpoints: safetensors files and one JSON metadata file, no pickle.

    DIR/latest_checkpointed_iteration.txt      the newest complete checkpoint (updated last, atomically)
    DIR/iter_0000020/metadata.json             iteration, consumed samples, vocab, layout, config, scheduler,
                                               every tensor's global shape and tp partition, file checksums
    DIR/iter_0000020/model_tp00_pp000.safetensors   the tp x pp shard of the weights and of the optimizer
                                                    states ``optim/<state>/<name>`` (written by dp rank 0)
    DIR/iter_0000020/rng_rank00000.safetensors      RNG states of each rank

Saving writes into ``iter_N.partial``, fsyncs every file and the folder, renames it to ``iter_N``, fsyncs
the parent and only then replaces the pointer file (``durable.py``), so a crash or power loss never leaves a
partial checkpoint that looks complete. ``prepare_checkpoint`` + ``PendingSave`` split a save into the host
copy (collective), the file writes (any thread) and the publication (collective) for ``--async-save``. Weights and
optimizer states load at any tp/pp/dp layout and ZeRO stage (shards are merged by their partition record and
re-split; the vocab padding is recomputed from the true vocab size); RNG states at the same layout only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from megatron_core.checkpointing.durable import fsync_write, publish_folder, save_file_durably
from megatron_core.checkpointing.host_copy import buffer_copies, host_copies
from megatron_core.checkpointing.layout import (
    global_named_buffers,
    global_named_parameters,
    partition_record,
)
from megatron_core.checkpointing.megatron_lm_io import describe_foreign
from megatron_core.checkpointing.optimizer_state import collect_optimizer_state, restore_optimizer_state
from megatron_core.checkpointing.shard_reader import (
    ShardReader,
    sha256_file,
    verify_files,
    verify_once,
)
from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState

LATEST = "latest_checkpointed_iteration.txt"
logger = logging.getLogger(__name__)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _layout(state: ParallelState, extra: dict) -> dict:
    extra_axes = {name: size for name, size in (("cp", state.cp_size), ("ep", state.ep_size)) if size > 1}
    # (each absent at size 1, as before the axis existed)
    return {"tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size, "vpp": state.vpp_size, **extra_axes,
            **extra}


@dataclasses.dataclass
class PendingSave:
    """A checkpoint whose tensors are on the host: ``write()`` puts this rank's files on disk (fsynced; may
    run in a background thread, no collective), ``finalize()`` (collective, main thread, after every rank's
    ``write()``) writes metadata.json on rank 0, publishes the folder and moves the pointer file."""

    directory: str
    final: str
    partial: str
    rank: int
    writes: list[tuple[str, dict[str, torch.Tensor]]]
    gathered: list[dict]
    info: dict

    def write(self) -> None:
        for path, tensors in self.writes:
            save_file_durably(tensors, path)

    def finalize(self) -> None:
        _barrier()  # every rank's files are durable
        if self.rank == 0:
            _write_metadata(self.partial, self.gathered, **self.info)
            if os.path.exists(self.final):  # the same iteration again (a resumed run): the complete one stays
                shutil.rmtree(self.partial)
            else:
                publish_folder(self.partial, self.final)
            fsync_write(os.path.join(self.directory, LATEST), str(self.info["iteration"]).encode())
        _barrier()


def save_checkpoint(directory: str, *, iteration: int, model_chunks: Sequence[nn.Module], config: TransformerConfig,
                    state: ParallelState, true_vocab_size: int, consumed_samples: int,
                    optimizer: Optional[Any] = None, scheduler: Optional[Any] = None,
                    run_config: Optional[dict] = None, layout_extra: Optional[dict] = None) -> str:
    """Writes checkpoint ``iteration`` (collective: every rank calls it). Returns the checkpoint folder."""
    pending = prepare_checkpoint(directory, iteration=iteration, model_chunks=model_chunks, config=config,
                                 state=state, true_vocab_size=true_vocab_size, consumed_samples=consumed_samples,
                                 optimizer=optimizer, scheduler=scheduler, run_config=run_config,
                                 layout_extra=layout_extra)
    pending.write()
    pending.finalize()
    return pending.final


def prepare_checkpoint(directory: str, *, iteration: int, model_chunks: Sequence[nn.Module],
                       config: TransformerConfig, state: ParallelState, true_vocab_size: int, consumed_samples: int,
                       optimizer: Optional[Any] = None, scheduler: Optional[Any] = None,
                       run_config: Optional[dict] = None, layout_extra: Optional[dict] = None) -> PendingSave:
    """Copies what this rank writes to the host (its own copies: training may go on; ranks that write no
    shard copy nothing but their RNG states) and gathers every rank's tensor records; collective (ZeRO-3
    gathers one bucket at a time, ZeRO optimizer shards, the records). Nothing is written but the empty
    ``iter_N.partial`` folder."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = os.path.join(directory, f"iter_{iteration:07d}")
    partial = f"{final}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    named = global_named_parameters(model_chunks, config, state)
    tensors = host_copies(model_chunks, named, state)  # what this rank writes; ZeRO-3: bucket by bucket
    # model-state buffers (the router's expert bias): replicated, saved with the dense weights
    tensors.update(buffer_copies(global_named_buffers(model_chunks, config, state), state))
    optimizer_scalars = None
    if optimizer is not None:
        optim_tensors, optimizer_scalars = collect_optimizer_state(optimizer, named, state)
        # copies: without ZeRO these may be views of the live optimizer states
        tensors.update({n: (t.clone(), p) for n, (t, p) in optim_tensors.items()})
    records, writes = _shard_files(partial, tensors, state)
    writes.append((os.path.join(partial, f"rng_rank{rank:05d}.safetensors"),
                   {n: t.clone() for n, t in _rng_tensors(state).items()}))
    gathered = [records]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
    info = dict(iteration=iteration, state=state, true_vocab_size=true_vocab_size, consumed_samples=consumed_samples,
                scheduler=scheduler.state_dict() if scheduler else None, run_config=run_config,
                layout_extra=layout_extra or {}, optimizer=optimizer_scalars)
    return PendingSave(directory=directory, final=final, partial=partial, rank=rank, writes=writes,
                       gathered=gathered, info=info)


@contextlib.contextmanager
def full_parameters(chunks: Sequence[nn.Module]) -> Iterator[None]:
    """Every parameter full inside the block (ZeRO-3 wrappers gather theirs; a no-op otherwise)."""
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            if hasattr(chunk, "gathered_parameters"):
                stack.enter_context(chunk.gathered_parameters())
        yield


def _shard_files(folder: str, tensors: dict[str, tuple[torch.Tensor, nn.Parameter]],
                 state: ParallelState) -> tuple[dict, list[tuple[str, dict[str, torch.Tensor]]]]:
    """dp rank 0 of each tp x pp writes its dense tensors (weights and optimizer states) into one file, and
    expert-dp rank 0 of each ep x pp (x etp) its experts' (stored under global expert ids; replicated over
    tp, or with expert tensor parallelism split over it and recorded like tp shards) into another; returns
    ``({name: record}, [(path, tensors)])`` with each tensor's tp partition (an optimizer
    state shares its parameter's) and the files this rank writes."""
    dense = {n: t for n, t in tensors.items() if not getattr(t[1], "is_expert", False)}
    experts = {n: t for n, t in tensors.items() if getattr(t[1], "is_expert", False)}
    records, writes = {}, []
    if state.dp_rank == 0 and state.cp_rank == 0:
        file = f"model_tp{state.tp_rank:02d}_pp{state.pp_rank:03d}.safetensors"
        records.update(_records(file, dense, tp_rank=state.tp_rank))
        writes.append((os.path.join(folder, file), {name: tensor for name, (tensor, _) in dense.items()}))
    if state.expert_dp_rank == 0 and experts:
        etp_rank = state.tp_rank if state.etp_size > 1 else 0  # split over etp (= tp): recorded like tp shards
        tp_part = f"_tp{etp_rank:02d}" if state.etp_size > 1 else ""
        file = f"experts_ep{state.ep_rank:03d}{tp_part}_pp{state.pp_rank:03d}.safetensors"
        records.update(_records(file, experts, tp_rank=etp_rank))
        writes.append((os.path.join(folder, file), {name: tensor for name, (tensor, _) in experts.items()}))
    return records, writes


def _records(file: str, tensors: dict[str, tuple[torch.Tensor, nn.Parameter]], *, tp_rank: int) -> dict:
    records = {}
    for name, (tensor, param) in tensors.items():
        dim, stride = partition_record(param)
        records[name] = {"file": file, "tp_rank": tp_rank, "local_shape": list(tensor.shape),
                         "partition_dim": dim, "stride": stride, "dtype": str(tensor.dtype)}
    return records


def _write_metadata(folder: str, gathered: list[dict], **info) -> None:
    tensors: dict[str, dict] = {}
    for records in gathered:
        for name, record in records.items():
            entry = tensors.setdefault(name, {"partition_dim": record["partition_dim"], "stride": record["stride"],
                                              "dtype": record["dtype"], "shards": {}})
            entry["shards"][str(record["tp_rank"])] = {"file": record["file"], "shape": record["local_shape"]}
    for entry in tensors.values():
        shapes = [s["shape"] for _, s in sorted(entry["shards"].items(), key=lambda kv: int(kv[0]))]
        dim = entry["partition_dim"]
        entry["global_shape"] = list(shapes[0]) if dim is None else [
            sum(s[d] for s in shapes) if d == dim else shapes[0][d] for d in range(len(shapes[0]))]
    state, scheduler = info["state"], info["scheduler"]
    metadata = {
        "format": "megatron_core/1", "iteration": info["iteration"], "consumed_samples": info["consumed_samples"],
        "true_vocab_size": info["true_vocab_size"], "layout": _layout(state, info["layout_extra"]),
        "config": info["run_config"] or {}, "scheduler": scheduler,
        "optimizer": info["optimizer"], "tensors": tensors,
        "checksums": {f: sha256_file(os.path.join(folder, f)) for f in sorted(os.listdir(folder))},
    }
    fsync_write(os.path.join(folder, "metadata.json"), json.dumps(metadata, indent=1).encode())  # fsyncs folder


def _rng_tensors(state: ParallelState) -> dict[str, torch.Tensor]:
    tensors = {"cpu": torch.get_rng_state()}
    if state.device.type == "cuda":  # CUDA-only path
        tensors["cuda"] = torch.cuda.get_rng_state(state.device)
    tensors.update({f"tracker/{name}": t for name, t in state.rng_tracker.get_states().items()})
    return tensors


def latest_iteration(directory: str) -> Optional[int]:
    path = os.path.join(directory, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} does not hold an iteration number (got {text[:40]!r})")
    return int(text)


def read_metadata(directory: str, iteration: Optional[int] = None, *, fallback: bool = False) -> tuple[str, dict]:
    """``(checkpoint folder, metadata)`` of ``iteration`` (default: the newest complete one).

    With ``fallback``, every file of the checkpoint is verified first and, if one is missing or corrupt, the
    next older complete checkpoint is tried (each failure is logged).
    """
    foreign = describe_foreign(directory)
    if foreign:
        raise ValueError(foreign)
    iteration = latest_iteration(directory) if iteration is None else iteration
    if iteration is None:
        raise ValueError(f"no checkpoint in {directory}: {LATEST} is missing")
    candidates = [iteration] + (sorted(_complete_iterations(directory, below=iteration), reverse=True)
                                if fallback else [])
    errors = []
    for candidate in candidates:
        try:
            folder, metadata = _read_one(directory, candidate)
            if fallback:
                _verify(folder, metadata, set(metadata["checksums"]))
            return folder, metadata
        except ValueError as error:
            errors.append(str(error))
            logger.warning("checkpoint of iteration %d is not loadable: %s", candidate, error)
    raise ValueError("; ".join(errors) + ("" if fallback else " (pass --load-fallback to try older checkpoints)"))


def _complete_iterations(directory: str, *, below: int) -> list[int]:
    found = []
    for entry in os.listdir(directory):
        if entry.startswith("iter_") and entry[5:].isdigit() and int(entry[5:]) < below:
            found.append(int(entry[5:]))
    return found


def _read_one(directory: str, iteration: int) -> tuple[str, dict]:
    folder = os.path.join(directory, f"iter_{iteration:07d}")
    path = os.path.join(folder, "metadata.json")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint {folder} is incomplete: metadata.json is missing")
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"checkpoint metadata {path} is corrupt: {error}") from error
    if metadata.get("format") != "megatron_core/1":
        raise ValueError(f"{path} is not a megatron_core checkpoint (format {metadata.get('format')!r})")
    return folder, metadata


def _verify(folder: str, metadata: dict, files: set[str]) -> None:
    verify_files(folder, metadata, files)


def load_model_weights(folder: str, metadata: dict, *, model_chunks: Sequence[nn.Module], config: TransformerConfig,
                       state: ParallelState, optimizer: Optional[Any] = None, verify_group: Any = None,
                       shared_verify: bool = False) -> ShardReader:
    """Copies every local parameter from the checkpoint, reading only the slices of this rank's tp shards
    (``ShardReader``); with ``optimizer``, also its master weights and states (without it, call
    ``optimizer.reload_model_params()``). With ``shared_verify`` every rank of ``verify_group`` (default:
    all) calls this and the files' sha256 checks are split over them (collective); otherwise this rank
    verifies each file it opens. Collective with ZeRO-3 wrappers (they gather and re-shard). Returns the
    reader (its ``bytes_read`` and ``files_hashed``)."""
    hashed = verify_once(folder, metadata, verify_group) if shared_verify else None
    with full_parameters(model_chunks):
        named = global_named_parameters(model_chunks, config, state)
        with ShardReader(folder, metadata, state, verified=shared_verify) as reader:
            for name, param in named.items():
                shard = reader.read(name, param)
                if shard is None:
                    raise ValueError(f"checkpoint {folder} has no tensor {name!r} (was it written for another "
                                     "model shape?)")
                with torch.no_grad():
                    param.copy_(shard.to(param.dtype))
            for name, buffer in global_named_buffers(model_chunks, config, state).items():
                shard = reader.read(name, buffer)
                if shard is None:  # a checkpoint from before buffers were saved: the buffer keeps its value
                    logger.warning("checkpoint %s has no buffer %r: it keeps its initial value", folder, name)
                    continue
                with torch.no_grad():
                    buffer.copy_(shard.to(buffer.dtype))
            _store_gathered(model_chunks)
            if optimizer is not None:
                if metadata.get("optimizer") is None:
                    raise ValueError(f"checkpoint {folder} holds no optimizer state; pass --no-load-optim")
                restore_optimizer_state(optimizer, {id(p): n for n, p in named.items()}, metadata["optimizer"],
                                        reader.read)
    if hashed is not None:
        reader.files_hashed = hashed
    return reader


def _store_gathered(chunks: Sequence[nn.Module]) -> None:
    """ZeRO-3: writes the loaded full parameters into each rank's persistent shard."""
    for chunk in chunks:
        if getattr(getattr(chunk, "config", None), "zero_stage", 0) == 3:
            for bucket in chunk.buckets:
                for param in bucket.params:
                    bucket.load_full(param, param.data)


def load_rng(folder: str, metadata: dict, *, state: ParallelState, layout_extra: Optional[dict] = None) -> bool:
    """Restores this rank's RNG states when the checkpoint has the same layout; returns whether it did."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if metadata["layout"] != _layout(state, layout_extra or {}):
        return False
    file = f"rng_rank{rank:05d}.safetensors"
    if file not in metadata["checksums"]:  # e.g. a converted checkpoint: no RNG states to restore
        return False
    _verify(folder, metadata, {file})
    with safe_open(os.path.join(folder, file), framework="pt") as handle:
        torch.set_rng_state(handle.get_tensor("cpu"))
        if state.device.type == "cuda" and "cuda" in handle.keys():  # CUDA-only path
            torch.cuda.set_rng_state(handle.get_tensor("cuda"), state.device)
        tracker = {k.split("/", 1)[1]: handle.get_tensor(k) for k in handle.keys() if k.startswith("tracker/")}
        if tracker:
            state.rng_tracker.set_states(tracker)
    return True
