"""Files of Megatron-LM checkpoints, read without executing anything from them.

Megatron-LM writes two formats under ``<load>/iter_NNNNNNN`` (or ``<load>/release``), named by
``latest_checkpointed_iteration.txt``:

* ``torch`` (legacy): one ``mp_rank_{tp:02d}/model_optim_rng.pt`` per tensor-parallel rank, or
  ``mp_rank_{tp:02d}_{pp:03d}/`` when pipeline-parallel; each a ``torch.save`` dict with ``args`` (an
  ``argparse.Namespace``), ``iteration``, ``checkpoint_version`` and ``model`` (``model0``, ``model1``, ...
  with virtual pipelining), local layer numbers per stage.
* ``torch_dist``: PyTorch Distributed Checkpoint files (``.metadata``, ``__R_I.distcp``) holding every tensor at
  its global shape, layers stacked along a leading axis; ``common.pt`` holds ``args`` and ``iteration``;
  ``metadata.json`` says ``{"sharded_backend": "torch_dist", ...}``.

``.pt`` files are read with ``torch.load(weights_only=True)``: a class the checkpoint names that torch does not
allow by default (``argparse.Namespace`` aside) becomes an inert ``Opaque`` placeholder, so no code from the
file runs. The DCP ``.metadata`` pickle, which torch itself unpickles with plain ``pickle``, is read here by
an unpickler that only resolves the checkpoint-metadata classes of ``torch.distributed.checkpoint``; before any
tensor is read, every storage entry must name a byte range of a regular file inside the folder (no ``../``,
absolute path or symlink out, no device or FIFO, nothing past a file's end) and every tensor must fit the bytes
its entries hold. A file that fails any of this is an ``InputFileError`` naming the folder, entry and path.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import stat
from typing import Any, Optional

import torch

from megatron_core.utils.errors import InputFileError

LATEST = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?$")


class Opaque:
    """Stands in for a class a checkpoint names but this reader does not trust (e.g. Megatron's enums).

    Unpickling only stores the arguments and state; nothing of the original class runs.
    """

    qualified_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque({self.qualified_name}, args={self.args!r})"


def _placeholder(qualified_name: str) -> type:
    return type(qualified_name.rsplit(".", 1)[-1], (Opaque,), {"qualified_name": qualified_name})


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words ("a FIFO", "a character device", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")


def regular_file_size(path: str) -> int:
    """The size of ``path`` (symlinks followed); anything but a regular file is refused before it is opened
    (reading a device or FIFO would hang or never end)."""
    if not os.path.exists(path):
        raise InputFileError(f"{path} does not exist" + (" (a dangling symlink)" if os.path.islink(path) else ""))
    status = os.stat(path)
    if not stat.S_ISREG(status.st_mode):
        kind = file_kind(status.st_mode)
        target = f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise InputFileError(f"{path}{target} is {kind}, not a regular file: refusing to read it")
    return status.st_size


def resolves_inside(folder: str, path: str) -> bool:
    """Whether ``path``'s real path (symlinks followed) lies inside ``folder``'s real path."""
    root = os.path.realpath(folder)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def file_inside(folder: str, relative: str) -> tuple[str, int]:
    """``(path, size)`` of ``folder/relative``: a regular file whose real path (symlinks followed) lies inside
    ``folder``'s real path; ``../``, an absolute path or a symlink out is refused."""
    path = os.path.join(folder, relative)
    size = regular_file_size(path)
    if not resolves_inside(folder, path):
        raise InputFileError(f"{path} resolves to {os.path.realpath(path)}, outside the checkpoint folder "
                             f"{os.path.realpath(folder)}: refusing to read it")
    return path, size


_TORCH_ADVICE = ("Weights only load failed", "Check the documentation", "Please file an issue", "(1)", "(2)")


def _torch_reason(error: BaseException) -> str:
    """The informative sentence of torch's multi-paragraph load error (its advice to load unsafely left out)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    kept = [line.split("WeightsUnpickler error:")[-1].strip() for line in lines if not line.startswith(_TORCH_ADVICE)]
    reason = ([line for line in kept if line] or lines or [type(error).__name__])[0]
    return reason.split(". Please use")[0].split(". This is an internal")[0].rstrip(".")


def load_pt(path: str) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)`` with ``argparse.Namespace`` allowed and every other
    unknown class replaced by an ``Opaque`` placeholder (tensors stay memory-mapped until used).

    Raises:
        InputFileError: ``path`` is not a regular file, or not a ``torch.save`` zip file torch's weights-only
            unpickler accepts (e.g. one naming a function of a blocked module such as ``os.system``).
    """
    regular_file_size(path)
    try:
        unknown = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        allowed: list = [(argparse.Namespace, "argparse.Namespace")]
        allowed += [(_placeholder(name), name) for name in unknown if name != "argparse.Namespace"]
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        raise InputFileError(f"{path} is not a loadable PyTorch checkpoint: {_torch_reason(error)}; it was refused "
                             "(weights_only=True loads no code)") from error
    except (RuntimeError, EOFError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise InputFileError(f"{path} is not a loadable PyTorch checkpoint: {_torch_reason(error)}") from error


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes a DCP ``.metadata`` file is made of; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES and not name.startswith("__"):
            import importlib
            value = getattr(importlib.import_module(module), name, None)
            if isinstance(value, type):
                return value
        if module == "collections" and name == "OrderedDict":
            import collections
            return collections.OrderedDict
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            import pathlib
            return getattr(pathlib, name)  # the checkpoint id torch records
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"distributed-checkpoint metadata names {module}.{name}, which is not part "
                                     "of torch.distributed.checkpoint's metadata: refusing to load it")


def read_dcp_metadata(folder: str):
    """The ``torch.distributed.checkpoint`` ``Metadata`` of ``folder/.metadata``, read safely and checked: every
    storage entry names a byte range of a regular file inside ``folder``, every tensor fits its entries' bytes.
    Nothing but ``.metadata`` is opened (the files it names are only stat-ed)."""
    path, _ = file_inside(folder, ".metadata")
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, KeyError,
                IndexError) as error:
            raise ValueError(f"{path} is not a readable distributed-checkpoint metadata file: {error}") from error
    held = _check_storage(folder, metadata)
    _check_tensor_sizes(folder, metadata, held)
    return metadata


def _check_storage(folder: str, metadata: Any) -> dict[str, Optional[int]]:
    """Refuses storage entries that are not byte ranges of regular files inside ``folder``; returns the bytes
    the entries of each key hold (None for a key with transformed, e.g. compressed, entries)."""
    where = f"torch_dist checkpoint {folder}: .metadata"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise InputFileError(f"{where} holds a {type(metadata).__name__}, not a distributed-checkpoint Metadata")
    sizes: dict[str, int] = {}
    held: dict[str, Optional[int]] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        relative, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
        if not isinstance(fqn, str) or not isinstance(relative, str) or not all(
                isinstance(value, int) and value >= 0 for value in (offset, length)):
            raise InputFileError(f"{where} has a storage entry that is not (key, relative_path, offset, length): "
                                 f"{index!r}: {info!r}")
        entry = f"{where} entry {fqn!r} names {relative!r}"
        if relative not in sizes:
            try:
                sizes[relative] = file_inside(folder, relative)[1]
            except InputFileError as error:
                raise InputFileError(f"{entry}: {error}") from error
        if offset + length > sizes[relative]:
            raise InputFileError(f"{entry} at bytes [{offset}, {offset + length}), past the end of that file "
                                 f"({sizes[relative]} bytes): refusing to read it")
        transformed = bool(getattr(info, "transform_descriptors", None)) or held.get(fqn, 0) is None
        held[fqn] = None if transformed else held.get(fqn, 0) + length
    return held


def _check_tensor_sizes(folder: str, metadata: Any, held: dict[str, Optional[int]]) -> None:
    """Refuses a tensor whose shape and dtype need more bytes than its storage entries hold (a small file must
    not make the reader allocate a huge tensor)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        shape, dtype = getattr(meta, "size", None), getattr(meta.properties, "dtype", None)
        where = f"torch_dist checkpoint {folder}: .metadata tensor {key!r}"
        if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape) \
                or not isinstance(dtype, torch.dtype):
            raise InputFileError(f"{where} has shape {shape!r} and dtype {dtype!r}: not a tensor's")
        needed = math.prod(shape) * dtype.itemsize
        if held.get(key, 0) is not None and needed > held.get(key, 0):
            raise InputFileError(f"{where} is {list(shape)} {dtype} ({needed} bytes) but its storage entries hold "
                                 f"{held.get(key, 0)} bytes: refusing to read it")


class DcpTensorReader:
    """Reads whole tensors of a torch_dist folder one key at a time (no process group)."""

    def __init__(self, folder: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = folder
        self.metadata = read_dcp_metadata(folder)
        self.tensors = {key: (tuple(meta.size), meta.properties.dtype)
                        for key, meta in self.metadata.state_dict_metadata.items()
                        if isinstance(meta, TensorStorageMetadata)}
        metadata = self.metadata

        class _Reader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any):  # the already (safely) read metadata
                return metadata

        self._reader = _Reader(folder)

    def read(self, key: str) -> torch.Tensor:
        """The full tensor stored under ``key``."""
        import torch.distributed.checkpoint as dcp

        if key not in self.tensors:
            raise ValueError(f"torch_dist checkpoint {self.folder} has no tensor {key!r}")
        from torch.distributed.checkpoint.api import CheckpointException

        shape, dtype = self.tensors[key]
        target = {key: torch.empty(shape, dtype=dtype)}
        try:
            dcp.load(target, storage_reader=self._reader, no_dist=True)
        except CheckpointException as error:  # (a BaseException) wrapping what failed on this process
            failure = next(iter(error.failures.values()), None)
            cause = failure[0] if isinstance(failure, tuple) and isinstance(failure[0], BaseException) else error
            if isinstance(cause, OSError):
                raise cause from error  # the environment's failure (EIO, ...), classified as such
            raise InputFileError(f"torch_dist checkpoint {self.folder}: tensor {key!r} cannot be read from its "
                                 f"files: {type(cause).__name__}: {_torch_reason(cause)}") from cause
        return target[key]


def write_dcp(folder: str, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> None:
    """Writes ``tensors`` (full, global shapes) and ``objects`` (each stored as the ``torch.save`` bytes of a
    one-item list, as megatron-core packs its sharded objects) as a distributed checkpoint in ``folder``."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = dict(tensors)
    state.update({key: [value] for key, value in objects.items()})  # DCP stores non-tensors as torch.save bytes
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, thread_count=1), no_dist=True)


def iteration_folder(load_dir: str) -> tuple[str, int]:
    """``(folder, iteration)`` named by Megatron-LM's ``latest_checkpointed_iteration.txt`` in ``load_dir``
    (``release`` is iteration 0); ``load_dir`` may also be an ``iter_N``/``release`` folder itself."""
    base = os.path.basename(os.path.normpath(load_dir))
    if re.fullmatch(r"iter_\d+", base) or base == "release":
        return load_dir, 0 if base == "release" else int(base[5:])
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.lexists(pointer):
        raise ValueError(f"{load_dir} is not a Megatron-LM checkpoint folder: {LATEST} is missing")
    file_inside(load_dir, LATEST)
    with open(pointer, "rb") as handle:
        text = handle.read(64).decode("utf-8", errors="replace").strip()
    if text == "release":
        return os.path.join(load_dir, "release"), 0
    if not text.isdigit():
        raise ValueError(f"{pointer} holds {text[:40]!r}, not an iteration number or 'release'")
    folder = os.path.join(load_dir, f"iter_{int(text):07d}")
    if not os.path.isdir(folder):
        raise ValueError(f"{pointer} names iteration {int(text)} but {folder} does not exist")
    return folder, int(text)


def detect_format(folder: str) -> Optional[str]:
    """``"torch"``, ``"torch_dist"``, another Megatron-LM format name, or None if ``folder`` is none of them."""
    entries = os.listdir(folder) if os.path.isdir(folder) else []
    if any(_RANK_DIR.match(e) for e in entries):
        return "torch"
    if os.path.lexists(os.path.join(folder, "metadata.json")):
        path, _ = file_inside(folder, "metadata.json")
        try:
            with open(path, encoding="utf-8") as handle:
                backend = json.load(handle).get("sharded_backend")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return None
        return backend if isinstance(backend, str) else None
    return None


def describe_foreign(load_dir: str) -> Optional[str]:
    """A sentence naming ``load_dir`` as a Megatron-LM checkpoint and how to convert it, else None."""
    try:
        folder, _ = iteration_folder(load_dir)
        fmt = detect_format(folder)
    except ValueError:
        return None
    if fmt is None:
        return None
    return (f"{load_dir} is a Megatron-LM checkpoint ({fmt} format), not a megatron_core one; convert it with "
            f"tools/checkpoint_convert.py --model-type GPT --loader core --saver mcore --load-dir {load_dir} "
            "--save-dir <new folder>")


def legacy_rank_files(folder: str) -> dict[tuple[int, int], str]:
    """``{(tp_rank, pp_rank): model_optim_rng.pt path}`` of a torch-format folder (every rank present)."""
    files = {}
    for entry in sorted(os.listdir(folder)):
        match = _RANK_DIR.match(entry)
        if not match:
            continue
        if match.group(3):
            raise ValueError(f"{folder}/{entry}: expert-parallel checkpoints (mp_rank_TT_PPP_EEE) are not supported; "
                             "mixture of experts is not built yet")
        path = os.path.join(folder, entry, "model_optim_rng.pt")
        if not os.path.lexists(path):
            raise ValueError(f"Megatron-LM checkpoint {folder}: {entry}/model_optim_rng.pt is missing")
        file_inside(folder, os.path.join(entry, "model_optim_rng.pt"))
        files[(int(match.group(1)), int(match.group(2) or 0))] = path
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in files]
    if missing:
        raise ValueError(f"Megatron-LM checkpoint {folder} (tp {tp} x pp {pp}) lacks the files of (tp, pp) ranks "
                         f"{missing}")
    return files


def legacy_rank_dir(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron-LM's folder name of one rank's ``model_optim_rng.pt``."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


__all__ = ["Opaque", "file_kind", "resolves_inside", "regular_file_size", "file_inside",
           "load_pt", "read_dcp_metadata", "DcpTensorReader",
           "write_dcp", "iteration_folder", "detect_format", "describe_foreign", "legacy_rank_files",
           "legacy_rank_dir", "LATEST"]
