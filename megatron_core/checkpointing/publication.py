"""Publishing a checkpoint without ever losing one: the pointer moves only to a folder verified complete, a
stale ``iter_N`` is moved aside (never trusted), and a failure on any rank is known to every rank.

* ``agree_on_failure`` (collective) replaces the barriers of a save: every rank says whether its part
  failed; if any did, every rank raises the same ``CheckpointSaveError`` naming the folder, the rank and the
  errno, so no rank waits on a barrier the failed one never reaches.
* ``publish_checkpoint`` (rank 0) renames ``iter_N.partial`` to ``iter_N``. An ``iter_N`` already there is
  handled by what it is: incomplete (no valid ``metadata.json``: an older crash, a copy, a link) it is
  renamed to ``iter_N.stale-<time>`` and reported; complete (a re-save of the same iteration, e.g. with
  ``--finetune``) it is swapped with the new one (``renameat2(RENAME_EXCHANGE)`` on Linux: at every moment
  ``iter_N`` is a complete checkpoint) and then deleted. The new folder must hold every file the ranks
  wrote and a ``metadata.json`` that reads back before the pointer file is replaced.
* ``check_save_folder`` (collective) runs before the first iteration: ``--save`` is created and a probe
  file written and removed in it, so a read-only mount or a missing permission ends the run at once, not at
  the first save; leftover ``iter_*.partial`` folders of a crashed run are removed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import time
from typing import Iterable, Optional

import torch.distributed as dist

from megatron_core.checkpointing.durable import fsync_path, fsync_write, publish_folder, remove_path
from megatron_core.utils.durable import open_new
from megatron_core.utils.errors import EnvironmentFailure, describe

logger = logging.getLogger(__name__)


class CheckpointSaveError(EnvironmentFailure):
    """A checkpoint could not be written (exit status 1): the previous one and the pointer are untouched."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


NOT_SAVED = ("The checkpoint was not saved; the previous checkpoint and latest_checkpointed_iteration.txt are "
             "unchanged. Free space, fix the mount or permissions, or choose another --save folder")


def agree_on_failure(error: Optional[BaseException], *, folder: str, what: str, consequence: str = NOT_SAVED) -> None:
    """Collective over every rank (one ``all_gather_object``; without a process group, local): raises
    ``CheckpointSaveError`` on every rank if ``error`` is set on any, naming each failed rank's error."""
    mine = None if error is None else f"rank {_rank()}: {describe(error)}"
    failures = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, mine)
    failed = [f for f in failures if f]
    if failed:
        raise CheckpointSaveError(f"could not {what} {folder}: {'; '.join(failed)}. {consequence}") from error


def read_complete_metadata(folder: str) -> Optional[dict]:
    """``folder``'s metadata if it is a real folder (not a link) with a ``metadata.json`` that parses as a
    megatron_core checkpoint's and names files that all exist; else None."""
    if os.path.islink(folder) or not os.path.isdir(folder):
        return None
    path = os.path.join(folder, "metadata.json")
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            metadata = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(metadata, dict) or metadata.get("format") != "megatron_core/1":
        return None
    checksums = metadata.get("checksums")
    if not isinstance(checksums, dict) or not all(
            isinstance(f, str) and os.path.isfile(os.path.join(folder, os.path.basename(f))) for f in checksums):
        return None
    return metadata


def publish_checkpoint(*, directory: str, partial: str, final: str, iteration: int, expected_files: Iterable[str],
                       pointer: str) -> None:
    """Rank 0: verifies ``partial`` holds ``expected_files`` and a readable metadata.json, moves it to
    ``final`` (a stale ``final`` aside, a complete one swapped out) and only then replaces the pointer."""
    missing = sorted(f for f in expected_files if not os.path.isfile(os.path.join(partial, f)))
    if missing or read_complete_metadata(partial) is None:
        raise CheckpointSaveError(f"checkpoint {partial} is incomplete after every rank wrote its files "
                                  f"(missing: {missing or ['a readable metadata.json']}): not published")
    if os.path.lexists(final):
        if read_complete_metadata(final) is not None:
            _replace_complete(partial, final)
        else:
            aside = f"{final}.stale-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            os.rename(final, aside)  # a link is renamed itself, never followed
            logger.warning("checkpoint folder %s was incomplete (no valid metadata.json): moved aside to %s", final,
                           aside)
            print(f" warning: {final} was an incomplete checkpoint (no valid metadata.json); moved it aside to "
                  f"{aside}", flush=True)
            publish_folder(partial, final)
    else:
        publish_folder(partial, final)
    if not os.path.isfile(os.path.join(final, "metadata.json")):  # (its content was verified in partial)
        raise CheckpointSaveError(f"checkpoint {final} is not in place after publication: {pointer} was not moved")
    fsync_write(os.path.join(directory, pointer), str(iteration).encode())


def _replace_complete(partial: str, final: str) -> None:
    """Swaps the new ``partial`` with the complete ``final`` (atomic where the kernel can), deletes the old."""
    fsync_path(partial)
    if _exchange(partial, final):
        fsync_path(os.path.dirname(os.path.abspath(final)))
        remove_path(partial)  # now the old checkpoint
        return
    old = f"{final}.old-{os.getpid()}"
    os.rename(final, old)
    publish_folder(partial, final)
    remove_path(old)


def _exchange(a: str, b: str) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)``: swaps two paths atomically. False where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    number = ctypes.get_errno()
    raise OSError(number, os.strerror(number), a, None, b)


def check_save_folder(directory: str) -> None:
    """Collective: rank 0 creates ``directory``, writes and removes a probe file in it and removes stale
    ``iter_*.partial`` folders; every rank raises ``CheckpointSaveError`` if that failed."""
    error = None
    if _rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".write_probe.{os.getpid()}")
            with open_new(probe) as handle:
                handle.write(b"megatron_core write probe\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.unlink(probe)
            for entry in sorted(os.listdir(directory)):
                if entry.startswith("iter_") and entry.endswith(".partial"):
                    remove_path(os.path.join(directory, entry))
                    print(f" removed {os.path.join(directory, entry)}: a partial checkpoint of an earlier run "
                          "that did not finish its save", flush=True)
        except OSError as failure:
            error = failure
    agree_on_failure(error, folder=directory, what="write checkpoints to --save",
                     consequence="Nothing was trained: make the folder writable or choose another --save folder")


__all__ = ["CheckpointSaveError", "agree_on_failure", "read_complete_metadata", "publish_checkpoint",
           "check_save_folder"]
