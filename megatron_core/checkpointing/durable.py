"""Durable checkpoint writes: a file is on disk (fsynced) before anything points at it.

The order that survives a power loss at any moment (ext4/xfs semantics), every file created through
``megatron_core.utils.durable`` (new files only, ``O_EXCL | O_NOFOLLOW``: nothing planted in the folder is
written through):

1. write every shard and RNG file new, ``fsync`` each (``save_file_durably``);
2. write ``metadata.json`` the same way, then ``fsync`` the ``iter_N.partial`` folder (its entries);
3. rename ``iter_N.partial`` to ``iter_N`` and ``fsync`` the parent folder (the rename itself)
   (``publish_folder``);
4. replace the pointer file atomically and ``fsync`` the parent again (``fsync_write``).
"""
from __future__ import annotations

import os

import torch

from megatron_core.checkpointing.streaming import StreamingSafetensorsWriter
from megatron_core.utils.durable import fsync_path, remove_path, write_atomically

fsync_write = write_atomically  # the name the checkpoint code has always used


def save_file_durably(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Writes ``tensors`` as a new safetensors file at ``path`` (``O_EXCL | O_NOFOLLOW``: an existing name
    is an error), one tensor at a time, and fsyncs it."""
    writer = StreamingSafetensorsWriter(path, [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()],
                                        atomic=False)
    try:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        writer.close()
    except OSError as error:  # (a failed write names no file: name it)
        writer.abort()
        if error.filename is None:
            raise OSError(error.errno, error.strerror, path) from error
        raise
    except BaseException:
        writer.abort()
        raise


def publish_folder(partial: str, final: str) -> None:
    """Renames the complete folder ``partial`` to ``final`` durably (fsync of it, rename, fsync of the parent).
    ``final`` must not exist (a rename onto a non-empty folder fails)."""
    fsync_path(partial)
    os.replace(partial, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))


__all__ = ["fsync_path", "fsync_write", "save_file_durably", "publish_folder", "remove_path"]
