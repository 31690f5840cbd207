"""Atomic file writes of the data pipeline (index caches, corpus descriptions), through the one durable-write
helper ``megatron_core.utils.durable``: a reader never sees a half-written file, and two processes building
the same cache file at once (data-parallel ranks, say) both end with one complete copy."""
from megatron_core.utils.durable import save_npy_atomically as atomic_save_npy
from megatron_core.utils.durable import write_text_atomically as atomic_write_text

__all__ = ["atomic_save_npy", "atomic_write_text"]
