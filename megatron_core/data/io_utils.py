"""Atomic file writes of the data pipeline (index caches, corpus descriptions), through the one durable-write
helper ``megatron_core.utils.durable``: a reader never sees a half-written file, and two processes building
the same cache file at once (data-parallel ranks, say) both end with one complete copy."""
import os
import tempfile

from megatron_core.utils.durable import save_npy_atomically as atomic_save_npy
from megatron_core.utils.durable import write_text_atomically as atomic_write_text


def make_temp_file(folder: str, name: str) -> str:
    """Creates an empty temporary file in ``folder`` (``O_EXCL | O_NOFOLLOW``, a random name) with the usual
    (umask) permissions, for a writer that renames it into place itself; returns its path."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    os.close(fd)
    return tmp


__all__ = ["atomic_save_npy", "atomic_write_text", "make_temp_file"]
