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
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.checkpointing.durable import fsync_write, remove_path, save_file_durably
from megatron_core.checkpointing.host_copy import buffer_copies, host_copies
from megatron_core.checkpointing.layout import (
    global_named_buffers,
    global_named_parameters,
    partition_record,
)
from megatron_core.checkpointing.megatron_lm_io import describe_foreign, resolves_inside
from megatron_core.checkpointing.metadata_schema import validate_metadata
from megatron_core.checkpointing.optimizer_state import collect_optimizer_state
from megatron_core.checkpointing.publication import CheckpointSaveError, agree_on_failure, publish_checkpoint
from megatron_core.checkpointing.shard_reader import (
    file_digests,
    safe_path,
    tensor_files,
    verify_files,
)
from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.utils import accelerator

LATEST = "latest_checkpointed_iteration.txt"
logger = logging.getLogger(__name__)


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

    def finalize(self, error: Optional[BaseException] = None) -> None:
        """Collective: every rank passes the failure of its ``write()`` (or None). If any rank failed, or
        publishing fails, every rank raises ``CheckpointSaveError`` and ``iter_N.partial`` is removed; the
        previous checkpoint and the pointer file are untouched."""
        iteration = self.info["iteration"]
        try:
            agree_on_failure(error, folder=self.partial, what=f"write checkpoint {iteration} to")
            failure = None
            if self.rank == 0:
                try:
                    _write_metadata(self.partial, self.gathered, **self.info)
                    publish_checkpoint(directory=self.directory, partial=self.partial, final=self.final,
                                       iteration=iteration, expected_files=self.expected_files(), pointer=LATEST)
                except (OSError, CheckpointSaveError) as publish_error:
                    failure = publish_error
            agree_on_failure(failure, folder=self.final, what=f"publish checkpoint {iteration} as")
        except CheckpointSaveError:
            if self.rank == 0:
                with contextlib.suppress(OSError):
                    remove_path(self.partial)
            raise

    def expected_files(self) -> set[str]:
        """Every file the ranks write: the tensor files of the records and one RNG file per rank."""
        files = {record["file"] for records in self.gathered for record in records.values()}
        return files | {f"rng_rank{rank:05d}.safetensors" for rank in range(len(self.gathered))}


def save_checkpoint(directory: str, *, iteration: int, model_chunks: Sequence[nn.Module], config: TransformerConfig,
                    state: ParallelState, true_vocab_size: int, consumed_samples: int,
                    optimizer: Optional[Any] = None, scheduler: Optional[Any] = None,
                    run_config: Optional[dict] = None, layout_extra: Optional[dict] = None,
                    tokenizer: Optional[dict] = None) -> str:
    """Writes checkpoint ``iteration`` (collective: every rank calls it). Returns the checkpoint folder.
    ``tokenizer``: the run's tokenizer identity (``training.resume.tokenizer_identity``), checked on resume.
    A failure on any rank raises ``CheckpointSaveError`` on every rank; nothing is published then."""
    pending = prepare_checkpoint(directory, iteration=iteration, model_chunks=model_chunks, config=config,
                                 state=state, true_vocab_size=true_vocab_size, consumed_samples=consumed_samples,
                                 optimizer=optimizer, scheduler=scheduler, run_config=run_config,
                                 layout_extra=layout_extra, tokenizer=tokenizer)
    error = None
    try:
        pending.write()
    except Exception as failure:  # noqa: BLE001 - every rank must learn of it (finalize raises it everywhere)
        error = failure
    pending.finalize(error)
    return pending.final


def prepare_checkpoint(directory: str, *, iteration: int, model_chunks: Sequence[nn.Module],
                       config: TransformerConfig, state: ParallelState, true_vocab_size: int, consumed_samples: int,
                       optimizer: Optional[Any] = None, scheduler: Optional[Any] = None,
                       run_config: Optional[dict] = None, layout_extra: Optional[dict] = None,
                       tokenizer: Optional[dict] = None) -> PendingSave:
    """Copies what this rank writes to the host (its own copies: training may go on; ranks that write no
    shard copy nothing but their RNG states) and gathers every rank's tensor records; collective (ZeRO-3
    gathers one bucket at a time, ZeRO optimizer shards, the records). Nothing is written but the empty
    ``iter_N.partial`` folder."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = os.path.join(directory, f"iter_{iteration:07d}")
    partial = f"{final}.partial"
    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            remove_path(partial)  # a leftover of a crashed save (a planted link is removed, not followed)
            os.mkdir(partial)
        except OSError as failure:
            error = failure
    agree_on_failure(error, folder=partial, what=f"create checkpoint {iteration} as")
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
                layout_extra=layout_extra or {}, optimizer=optimizer_scalars, tokenizer=tokenizer)
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
    expert-dp rank 0 of each ep x pp (x etp) its experts' (stored under global expert ids, whole, or with
    expert tensor parallelism split over the etp group and recorded like tp shards by etp rank) into another; returns
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
        etp_rank = state.etp_rank  # split over the etp group: recorded like tp shards
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
        **({"tokenizer": info["tokenizer"]} if info.get("tokenizer") else {}),
        **file_digests(folder),
    }
    fsync_write(os.path.join(folder, "metadata.json"), json.dumps(metadata, indent=1).encode())  # fsyncs folder


def _rng_tensors(state: ParallelState) -> dict[str, torch.Tensor]:
    tensors = {"cpu": torch.get_rng_state()}
    if state.device.type == "cuda":
        tensors["cuda"] = accelerator.get_rng_state(state.device)
    tensors.update({f"tracker/{name}": t for name, t in state.rng_tracker.get_states().items()})
    return tensors


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration ``latest_checkpointed_iteration.txt`` names (None without one); ValueError naming the
    file if it is not a small regular file holding ASCII digits."""
    path = os.path.join(directory, LATEST)
    if not os.path.lexists(path):
        return None
    safe_path(directory, LATEST)  # a regular file inside the folder (a FIFO or a device would hang the read)
    with open(path, "rb") as handle:
        raw = handle.read(64)
    text = raw.decode("utf-8", errors="replace").strip()
    if not (text.isascii() and text.isdigit()):
        present = sorted(e for e in os.listdir(directory) if e.startswith("iter_") and e[5:].isdigit())
        raise ValueError(f"{path} does not hold an iteration number (got {text[:40]!r}); write the number of a "
                         f"complete checkpoint into it (folders here: {present[-3:] or 'none'})")
    return int(text)


def read_metadata(directory: str, iteration: Optional[int] = None, *, fallback: bool = False,
                  require_checksums: bool = True) -> tuple[str, dict]:
    """``(checkpoint folder, metadata)`` of ``iteration`` (default: the newest complete one).

    With ``fallback``, every file of the checkpoint is verified first and, if one is missing or corrupt, the
    next older complete checkpoint is tried (each failure is logged).
    """
    foreign = describe_foreign(directory)  # (it opens the pointer file only if it is a regular file inside)
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
                _verify(folder, metadata, set(metadata["checksums"]) | tensor_files(metadata),
                        require_checksums=require_checksums)
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
    if os.path.islink(folder) and not resolves_inside(directory, folder):
        raise ValueError(f"checkpoint {folder} is a symlink to {os.path.realpath(folder)}, outside {directory}: "
                         "refusing to read it (link the whole --load folder instead)")
    path = os.path.join(folder, "metadata.json")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint {folder} is incomplete: metadata.json is missing")
    safe_path(folder, "metadata.json")
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"checkpoint metadata {path} is corrupt: {error}") from error
    if not isinstance(metadata, dict) or metadata.get("format") != "megatron_core/1":
        found = metadata.get("format") if isinstance(metadata, dict) else type(metadata).__name__
        raise ValueError(f"{path} is not a megatron_core checkpoint (format {found!r})")
    validate_metadata(path, metadata)
    return folder, metadata


def _verify(folder: str, metadata: dict, files: set[str], *, require_checksums: bool = True) -> None:
    verify_files(folder, metadata, files, require_checksums=require_checksums)
