"""Keep glibc from holding on to freed tensor memory in tools that stream large tensors one at a time.

glibc serves an allocation above its mmap threshold with its own ``mmap`` (unmapped again on free), and below
it from the heap, whose freed blocks mostly stay mapped. The threshold starts at 128 KiB but rises to the size
of each mmapped block freed (up to 32 MiB), so a converter that reads, concatenates and frees tensors of tens
of MiB ends up with them on the heap, fragmented: its resident memory grows with every layer although only
one tensor is alive. A fixed threshold turns the dynamic rise off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def mmap_large_allocations(threshold_bytes: int = 1 << 20) -> bool:
    """Allocations of at least ``threshold_bytes`` get their own mapping, returned to the system on free
    (glibc only: ``mallopt(M_MMAP_THRESHOLD, threshold)``). Returns whether it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))


__all__ = ["mmap_large_allocations"]
