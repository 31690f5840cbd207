"""``--async-save``: checkpoint files written by a background thread while the step loop continues.

A save copies this rank's tensors to the host in the step loop (``prepare_checkpoint``, collective), then a
writer thread writes and fsyncs the files (no collective runs in it: the process group is only used from the
main thread). Publication (metadata.json, the folder rename, the pointer file) is collective and happens in
the main thread once every rank's writer is done: checked after each iteration by ``poll()`` (one tiny
all-reduce while a save is in flight), forced by the next save and at the end of training (``finish()``).
So the pointer file never names a checkpoint whose files are not all durable, and at most one save is in
flight.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_core.checkpointing.checkpoint import PendingSave

logger = logging.getLogger(__name__)


class AsyncCheckpointWriter:
    """At most one checkpoint in flight: its files written by a daemon thread, published by the main thread.

    Args:
        device: where the "every rank is done" flag is reduced (the backend's device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: Optional[PendingSave] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def submit(self, prepare: Callable[[], PendingSave]) -> None:
        """Publishes the previous save (waiting for its writer), then prepares the next (collective, in this
        thread: host copies) and starts writing it in the background."""
        self.finish()
        self._pending = prepare()
        self._error = None
        self._thread = threading.Thread(target=self._write, args=(self._pending,), name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _write(self, pending: PendingSave) -> None:
        try:
            pending.write()
        except BaseException as error:  # every rank learns of it in finish() (PendingSave.finalize)
            self._error = error

    def poll(self) -> Optional[str]:
        """Publishes the save in flight if every rank's writer is done (collective while one is in flight:
        every rank has the same one). Returns the published folder, or None."""
        if self._pending is None:
            return None
        done = torch.tensor([0.0 if self._thread.is_alive() else 1.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.finish() if done.item() == 1.0 else None

    def finish(self) -> Optional[str]:
        """Waits for the writer of the save in flight and publishes it (collective); returns its folder. A
        failed writer on any rank raises ``CheckpointSaveError`` on every rank (nothing is published)."""
        if self._pending is None:
            return None
        begin = time.perf_counter()
        self._thread.join()
        pending, self._pending, self._thread = self._pending, None, None
        error, self._error = self._error, None
        if error is not None:
            logger.error("the background writer of checkpoint %s failed on rank %d: %s", pending.final, pending.rank,
                         error)
        pending.finalize(error)
        logger.debug("published %s (waited %.3f s)", pending.final, time.perf_counter() - begin)
        return pending.final
