"""Every file megatron_core writes goes through here: created new, never through a link, renamed into place.

* ``open_new(path)`` creates a file with ``O_CREAT | O_EXCL | O_NOFOLLOW``: it fails if anything, a file or
  a symlink planted there, already has the name, so a write never lands outside the folder it names.
* ``atomic_file(path)`` writes to a fresh temporary file beside ``path`` (a random name made with
  ``O_EXCL | O_NOFOLLOW`` by ``tempfile.mkstemp``; a planted ``path.tmp`` is never touched), fsyncs it,
  ``os.replace``s it into place (the rename replaces a link at ``path``, it does not follow it) and fsyncs
  the folder, so the rename survives a power loss too. On an exception the temporary file is removed and
  ``path`` is untouched.
* ``remove_path(path)`` deletes a file, a link (not its target) or a folder tree.

Checkpoints use these in the order that survives a crash at any moment (ext4/xfs semantics): every shard
and RNG file written new into a fresh ``iter_N.partial`` folder and fsynced, then ``metadata.json``, the
folder fsynced and renamed to ``iter_N``, the parent fsynced, and only then the pointer file replaced
(``megatron_core/checkpointing/durable.py``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from typing import BinaryIO, Iterator

_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def fsync_path(path: str) -> None:
    """``fsync`` of a file or a folder (a folder's fsync makes its entries, e.g. a rename, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_new(path: str, mode: int = 0o666) -> BinaryIO:
    """A new file at ``path`` opened for binary writing; ``FileExistsError`` if the name exists (a file, a
    folder or a symlink, which is never followed). ``mode`` is masked by the umask, as ``open`` does."""
    return os.fdopen(os.open(path, _NEW_FILE_FLAGS, mode), "wb")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_file(path: str, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Yields a binary file to write ``path``'s new content to; on success it replaces ``path`` atomically.

    Args:
        path: the final file path. Its folder is created if missing.
        durable: fsync the file before the rename and the folder after it.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 -> what open() would have given
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_path(folder)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_atomically(path: str, data: bytes, *, durable: bool = True) -> None:
    """Replaces ``path``'s content with ``data`` atomically (and durably)."""
    with atomic_file(path, durable=durable) as handle:
        handle.write(data)


def write_text_atomically(path: str, text: str) -> None:
    """Replaces ``path``'s content with ``text`` (UTF-8) atomically and durably."""
    write_atomically(path, text.encode("utf-8"))


def save_npy_atomically(path: str, array) -> None:
    """Saves a numpy ``array`` to ``path`` (a ``.npy`` file, no pickle) atomically and durably."""
    import numpy as np

    with atomic_file(path) as handle:
        np.save(handle, array, allow_pickle=False)


def remove_path(path: str) -> None:
    """Removes ``path`` whatever it is (a link is removed, never followed); nothing if it does not exist."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


__all__ = ["fsync_path", "open_new", "atomic_file", "write_atomically", "write_text_atomically",
           "save_npy_atomically", "remove_path"]
