"""``StateFiles``: one rank's fp32 optimizer tensors (master weights, Adam moments) as flat files on a local
disk (NVMe), read and written in element ranges with ``os.preadv`` / ``os.pwrite`` (which release the GIL, so
a thread pool overlaps them with the update).

Each optimizer gets its own folder ``DIR/rank<r>-<pid>-<n>/`` holding ``<state>.bin`` (``numel`` fp32 values
each); it is removed when the optimizer is garbage-collected or ``close()`` is called. The files are scratch
space: checkpoints carry the states (through the optimizer's state accessors), never these files.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import weakref
from typing import Sequence

import torch

FP32_BYTES = 4
_counter = itertools.count()


def check_offload_dir(directory: str, needed_bytes: int) -> None:
    """Raises ``ValueError`` naming ``directory`` unless it is (or can be made) a writable folder with at
    least ``needed_bytes`` free."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--optimizer-nvme-offload-dir {directory!r} cannot be created ({error}): pass a folder "
                         "on a local disk this user may write") from error
    if not os.path.isdir(directory):
        raise ValueError(f"--optimizer-nvme-offload-dir {directory!r} is not a folder")
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise ValueError(f"--optimizer-nvme-offload-dir {directory!r} is not readable and writable by this "
                         "user: fix its permissions or pass another folder")
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise ValueError(f"--optimizer-nvme-offload-dir {directory!r} has {free / 2**30:.2f} GiB free, this "
                         f"rank's optimizer states need {needed_bytes / 2**30:.2f} GiB: free space or pass a "
                         "larger disk")


class StateFiles:
    """Flat fp32 files, one per state name, under a fresh per-rank folder in ``directory``.

    Args:
        directory: the offload folder (``--optimizer-nvme-offload-dir``); checked, created if missing.
        rank: this process's global rank (in the folder name).
        names: the states, e.g. ``("master", "exp_avg", "exp_avg_sq")``.
        numel: fp32 elements in each file.
    """

    def __init__(self, directory: str, *, rank: int, names: Sequence[str], numel: int) -> None:
        check_offload_dir(directory, needed_bytes=len(names) * numel * FP32_BYTES)
        self.folder = tempfile.mkdtemp(prefix=f"rank{rank}-{os.getpid()}-{next(_counter)}-", dir=directory)
        self.numel, self.names = numel, tuple(names)
        self.paths = {name: os.path.join(self.folder, f"{name}.bin") for name in self.names}
        self.fds: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _remove, self.folder, self.fds)
        for name, path in self.paths.items():
            self.fds[name] = _open_sized(path, numel * FP32_BYTES)

    def read(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fills the contiguous fp32 ``out`` with elements ``[start, start + out.numel())`` of ``name``."""
        view = memoryview(out.numpy()).cast("B")
        offset, done = start * FP32_BYTES, 0
        while done < len(view):
            count = os.preadv(self.fds[name], [view[done:]], offset + done)
            if count <= 0:
                raise OSError(f"short read of {self.paths[name]} at byte {offset + done}")
            done += count

    def write(self, name: str, start: int, values: torch.Tensor) -> None:
        """Writes the contiguous fp32 ``values`` at element ``start`` of ``name``."""
        view = memoryview(values.numpy()).cast("B")
        offset, done = start * FP32_BYTES, 0
        while done < len(view):
            done += os.pwrite(self.fds[name], view[done:], offset + done)

    def file_bytes(self) -> int:
        """The bytes the files hold on disk now."""
        return sum(os.path.getsize(path) for path in self.paths.values())

    def close(self) -> None:
        """Closes and removes the files (also done at garbage collection)."""
        self._finalizer()


def _open_sized(path: str, nbytes: int) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as error:
        raise ValueError(f"cannot create the optimizer state file {path!r} ({error})") from error
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserves the space now (reads as zeros), so a full disk fails here
    except OSError as error:
        os.close(fd)
        raise ValueError(f"cannot reserve {nbytes} bytes for {path!r} ({error}): free space on that disk or "
                         "pass another --optimizer-nvme-offload-dir") from error
    return fd


def _remove(folder: str, fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(folder, ignore_errors=True)
