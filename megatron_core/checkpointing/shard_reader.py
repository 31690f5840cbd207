"""Reading a checkpoint's tensors for this rank: only the byte ranges it needs, each file verified once.

``ShardReader.read`` returns a tensor re-split for this rank's tp shard. It reads from the safetensors files
only what that shard needs: at the saved tp size, the one saved shard of this tp rank; at another tp size
with a plain (stride 1) partition, the overlapping slices of the saved shards (``safe_open(...).get_slice``);
a replicated tensor, from one file. Only a strided (fused QKV) or vocab-padded tensor at another tp size
is read whole and re-split. ``verify_once`` splits the sha256 checks of a checkpoint's files over the ranks
of a group (file i on rank i mod size, the failures all-gathered), so each file is hashed once per job
rather than once per rank that reads it.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from typing import Any, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from megatron_core.checkpointing.layout import merge_shards, partition_record, repad_vocab, take_shard
from megatron_core.checkpointing.megatron_lm_io import file_kind, resolves_inside
from megatron_core.parallel_state import ParallelState

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def sha256_file(path: str, *, size: Optional[int] = None) -> str:
    """sha256 of ``path``; with ``size``, of exactly that many bytes (a file of another length is refused)."""
    digest = hashlib.sha256()
    remaining = size
    with open(path, "rb") as f:
        while remaining is None or remaining > 0:
            block = f.read(1 << 20 if remaining is None else min(1 << 20, remaining))
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
        if remaining not in (None, 0) or (size is not None and f.read(1)):
            raise ValueError(f"checkpoint file {path} is not {size} bytes long as metadata.json records: it was "
                             "truncated or extended")
    return digest.hexdigest()


def safe_path(folder: str, file: str) -> str:
    """``folder/file`` for a plain file name from metadata that is a regular file inside the folder: a name
    that could leave it, a symlink whose target leaves it, a device, a FIFO or a folder is refused."""
    if not isinstance(file, str) or not file or file in (".", "..") or os.path.basename(file) != file \
            or "\\" in file or "\0" in file:
        raise ValueError(f"checkpoint {folder} names the file {file!r}, which is not a plain file name inside the "
                         "checkpoint folder: refusing to read it")
    path = os.path.join(folder, file)
    if os.path.islink(path) and not resolves_inside(folder, path):
        raise ValueError(f"checkpoint file {path} is a symlink to {os.path.realpath(path)}, outside the checkpoint "
                         "folder: refusing to read it")
    if os.path.lexists(path):
        mode = os.stat(path).st_mode if os.path.exists(path) else 0
        if not stat.S_ISREG(mode):
            kind = file_kind(mode) if mode else "a dangling link"
            raise ValueError(f"checkpoint file {path} is not a regular file ({kind}): refusing to read it")
    return path


def file_digests(folder: str) -> dict:
    """``{"checksums": {file: sha256}, "sizes": {file: bytes}}`` of every file in ``folder`` (metadata.json
    records both; loading verifies a file's length before its hash)."""
    files = sorted(os.listdir(folder))
    return {"checksums": {f: sha256_file(os.path.join(folder, f)) for f in files},
            "sizes": {f: os.path.getsize(os.path.join(folder, f)) for f in files}}


def open_safetensors(path: str):
    """``safe_open(path)`` whose failure on a damaged file is a ValueError naming it."""
    from safetensors import SafetensorError

    try:
        return safe_open(path, framework="pt")
    except SafetensorError as error:
        raise ValueError(f"checkpoint file {path} is not a readable safetensors file ({error})") from error


def verify_files(folder: str, metadata: dict, files: set[str], *, require_checksums: bool = True) -> None:
    """Raises ValueError naming the first missing file, one that is not a regular file inside the folder, one
    of another size than recorded, one whose sha256 differs from metadata.json, or (``require_checksums``)
    one metadata.json records no sha256 for."""
    for file in sorted(files):
        path = safe_path(folder, file)
        expected = metadata["checksums"].get(file)
        if not os.path.exists(path):
            raise ValueError(f"checkpoint file {path} is missing")
        if expected is None:
            if require_checksums:
                raise ValueError(f"checkpoint file {path} has no sha256 in metadata.json, so it cannot be verified; "
                                 "pass --allow-missing-checksums to load it unverified (older or hand-made "
                                 "checkpoints)")
            continue
        size = metadata.get("sizes", {}).get(file)
        if size is not None and os.path.getsize(path) != size:
            raise ValueError(f"checkpoint file {path} is corrupt: it is {os.path.getsize(path)} bytes long, not the "
                             f"{size} that metadata.json records (truncated or extended)")
        if sha256_file(path, size=size) != expected:
            raise ValueError(f"checkpoint file {path} is corrupt: its sha256 does not match metadata.json")


def tensor_files(metadata: dict) -> set[str]:
    """Every file that holds a tensor of the checkpoint (not the per-rank RNG files)."""
    return {shard["file"] for entry in metadata["tensors"].values() for shard in entry["shards"].values()}


def verify_once(folder: str, metadata: dict, group: Any = None, *, require_checksums: bool = True) -> list[str]:
    """Verifies every tensor file of the checkpoint, each on one rank of ``group`` (collective over it: one
    all_gather_object); raises the same ValueError on every rank if any fails. Returns the files this rank
    hashed. Without a process group, this rank verifies them all."""
    files = sorted(tensor_files(metadata))
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    mine = files[rank::size]
    error = None
    try:
        verify_files(folder, metadata, set(mine), require_checksums=require_checksums)
    except ValueError as failure:
        error = str(failure)
    errors = [error]
    if size > 1:
        errors = [None] * size
        dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e]
    if failed:
        raise ValueError("; ".join(failed))
    return mine


class ShardReader:
    """Reads checkpoint tensors re-split for this rank's tp shard (only the byte ranges it needs).

    Args:
        verified: the files already verified (``verify_once``); any other file is verified here, once, when
            first opened.

    Attributes:
        bytes_read: tensor bytes read from the files so far; ``files_hashed``: the files this reader hashed.
    """

    def __init__(self, folder: str, metadata: dict, state: ParallelState, *, verified: bool = False,
                 require_checksums: bool = True) -> None:
        self.folder, self.metadata, self.state = folder, metadata, state
        self.require_checksums = require_checksums
        self.tensors = metadata["tensors"]
        self.verified = verified
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0
        self.files_hashed: list[str] = []

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def _handle(self, file: str):
        if file not in self._handles:
            if not self.verified:
                verify_files(self.folder, self.metadata, {file}, require_checksums=self.require_checksums)
                self.files_hashed.append(file)
            self._handles[file] = self._stack.enter_context(open_safetensors(safe_path(self.folder, file)))
        return self._handles[file]

    def _get(self, file: str, name: str, index: Optional[tuple] = None) -> torch.Tensor:
        handle = self._handle(file)
        tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read(self, name: str, param: nn.Parameter) -> Optional[torch.Tensor]:
        """Tensor ``name`` as this rank's shard of ``param`` (its partition record and tp-local shape), or None.
        An MoE expert's tensor (``is_expert``) is split over the etp group: its etp rank and size take tp's part,
        so experts saved at one etp load at another."""
        source = _source_name(name, self.tensors)
        if source not in self.tensors:
            return None
        entry = self.tensors[source]
        shards = [s for _, s in sorted(entry["shards"].items(), key=lambda kv: int(kv[0]))]
        dim, stride = partition_record(param)
        tp_rank, tp_size = self.state.tp_rank, self.state.tp_size
        if getattr(param, "is_expert", False):
            tp_rank, tp_size = self.state.etp_rank, self.state.etp_size
        vocab = name.endswith(VOCAB_PARAMS)
        same_split = entry["partition_dim"] == dim and entry["stride"] == stride and len(shards) == tp_size
        if dim is None and entry["partition_dim"] is None:  # replicated: any one file holds it
            shard = self._get(shards[min(tp_rank, len(shards) - 1)]["file"], source)
        elif same_split and (not vocab or tuple(shards[tp_rank]["shape"]) == tuple(param.shape)):
            shard = self._get(shards[tp_rank]["file"], source)  # the saved shard is this rank's
        elif entry["partition_dim"] == dim and entry["stride"] == stride == 1 and not vocab:
            shard = self._read_range(source, shards, dim, tp_rank, tp_size)
        else:  # strided or vocab-padded at another tp size: whole, then re-split
            full = merge_shards([self._get(s["file"], source) for s in shards], entry["partition_dim"],
                                entry["stride"])
            if vocab:  # padded to a multiple that depends on tp: re-pad from the true vocab
                full = repad_vocab(full, self.metadata["true_vocab_size"], param.shape[0] * tp_size)
            shard = take_shard(full, dim, stride, tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shard shape {tuple(shard.shape)} but the model "
                             f"expects a shard of {tuple(param.shape)}: another model shape?")
        return shard

    def _read_range(self, source: str, shards: list[dict], dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's chunk (as ``torch.chunk`` splits the full tensor) from the overlapping saved shards."""
        length = sum(s["shape"][dim] for s in shards)
        size = -(-length // tp_size)
        lo, hi = tp_rank * size, min((tp_rank + 1) * size, length)
        pieces, begin = [], 0
        for s in shards:
            end = begin + s["shape"][dim]
            a, b = max(lo, begin), min(hi, end)
            if a < b:
                index = (slice(None),) * dim + (slice(a - begin, b - begin),)
                pieces.append(self._get(s["file"], source, index))
            begin = end
        return torch.cat(pieces, dim)


def _source_name(name: str, tensors: dict) -> str:
    """A tied output layer saved without its own copy (pipeline size 1) loads from the word embedding."""
    if name.endswith("output_layer.weight") and name not in tensors:
        return name[: -len("output_layer.weight")] + "embedding.word_embeddings.weight"
    return name
