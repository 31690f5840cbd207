"""Atomic file writes: write to a temporary file beside the target, fsync it, ``os.replace`` it into place,
then fsync the folder (so the rename survives a power loss too).

A reader never sees a half-written file, and two processes building the same cache file at once
(data-parallel ranks, say) both end with one complete copy.
"""
import contextlib
import os
import tempfile
from typing import Iterator

import numpy as np


def make_temp_file(folder: str, name: str) -> str:
    """Creates an empty temporary file in ``folder`` with the usual (umask) permissions; returns its path."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return tmp


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path in ``path``'s folder; on success it is renamed to ``path``.

    Args:
        path: the final file path. Its folder is created if missing.

    Yields:
        A path to write to. On an exception the temporary file is removed and ``path`` is untouched.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = make_temp_file(folder, os.path.basename(path))
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(folder)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def atomic_save_npy(path: str, array: np.ndarray) -> None:
    """Saves ``array`` to ``path`` (a ``.npy`` file) atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)


def atomic_write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` atomically (UTF-8)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
