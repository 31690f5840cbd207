"""``StateFiles``: one rank's offloaded tensors (fp32 master weights and Adam moments, or ZeRO-3 parameter
shards) as flat files on a local disk (NVMe), read and written in element ranges with ``os.preadv`` /
``os.pwrite`` (which release the GIL, so a thread pool overlaps them with the update).

Each owner gets its own folder ``DIR/rank<r>-<pid>-<n>/`` holding ``<name>.bin``; it is removed when the owner
is garbage-collected or ``close()`` is called, and folders left by a killed process (its pid no longer alive)
are removed when the next one opens. The files are scratch space: checkpoints carry the states (through the
optimizer's per-piece state accessors), never these files.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch

FP32_BYTES = 4



def check_offload_dir(directory: str, needed_bytes: int, *, flag: str = "--optimizer-nvme-offload-dir") -> None:
    """Raises ``ValueError`` naming ``directory`` unless it is (or can be made) a writable folder with at
    least ``needed_bytes`` free."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {directory!r} cannot be created ({error}): pass a folder "
                         "on a local disk this user may write") from error
    if not os.path.isdir(directory):
        raise ValueError(f"{flag} {directory!r} is not a folder")
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {directory!r} is not readable and writable by this "
                         "user: fix its permissions or pass another folder")
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise ValueError(f"{flag} {directory!r} has {free / 2**30:.2f} GiB free, this "
                         f"rank's offloaded tensors need {needed_bytes / 2**30:.2f} GiB: free space or pass a "
                         "larger disk")


class StateFiles:
    """Flat files, one per name, under a fresh per-rank folder in ``directory``.

    Args:
        directory: the offload folder; checked, created if missing.
        rank: this process's global rank (in the folder name).
        sizes: bytes of each file by name, e.g. ``{"master": 4 * n, "exp_avg": 4 * n, "exp_avg_sq": 4 * n}``.
        flag: the command-line flag that named ``directory`` (for error messages).
    """

    def __init__(self, directory: str, *, rank: int, sizes: dict[str, int],
                 flag: str = "--optimizer-nvme-offload-dir") -> None:
        _remove_stale(directory, rank)
        check_offload_dir(directory, needed_bytes=sum(sizes.values()), flag=flag)
        self.folder = tempfile.mkdtemp(prefix=f"rank{rank}-{os.getpid()}-", dir=directory)
        self.sizes = dict(sizes)
        self.paths = {name: os.path.join(self.folder, f"{name}.bin") for name in self.sizes}
        self.fds: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _remove, self.folder, self.fds)
        for name, path in self.paths.items():
            self.fds[name] = _open_sized(path, self.sizes[name])

    def read(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fills the contiguous host tensor ``out`` with elements ``[start, start + out.numel())`` of ``name``
        (elements of ``out``'s dtype)."""
        view = _bytes(out)
        offset, done = start * out.element_size(), 0
        while done < len(view):
            count = os.preadv(self.fds[name], [view[done:]], offset + done)
            if count <= 0:
                raise OSError(f"short read of {self.paths[name]} at byte {offset + done}")
            done += count

    def write(self, name: str, start: int, values: torch.Tensor) -> None:
        """Writes the contiguous host tensor ``values`` at element ``start`` of ``name``."""
        view = _bytes(values)
        offset, done = start * values.element_size(), 0
        while done < len(view):
            done += os.pwrite(self.fds[name], view[done:], offset + done)

    def file_bytes(self) -> int:
        """The bytes the files hold on disk now."""
        return sum(os.path.getsize(path) for path in self.paths.values())

    def close(self) -> None:
        """Closes and removes the files (also done at garbage collection)."""
        self._finalizer()


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor of any dtype (bf16 included), without a copy. Its storage
    becomes non-resizable (numpy holds it): pass buffers of your own, never a storage that is freed later."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"offload I/O needs a contiguous host tensor, got {tensor.device} "
                         f"contiguous={tensor.is_contiguous()}")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _open_sized(path: str, nbytes: int) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as error:
        raise ValueError(f"cannot create the optimizer state file {path!r} ({error})") from error
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)  # reserves the space now (reads as zeros), so a full disk fails here
    except OSError as error:
        os.close(fd)
        raise ValueError(f"cannot reserve {nbytes} bytes for {path!r} ({error}): free space on that disk or "
                         "pass another --optimizer-nvme-offload-dir") from error
    return fd


def _remove_stale(directory: str, rank: int) -> None:
    """Removes ``rank<rank>-<pid>-*`` folders of processes that are gone (a run killed mid-training)."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != f"rank{rank}" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _remove(folder: str, fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(folder, ignore_errors=True)
