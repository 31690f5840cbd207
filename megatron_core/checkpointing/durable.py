"""Durable file writes for checkpoints: a file is on disk (fsynced) before anything points at it.

The order that survives a power loss at any moment (ext4/xfs semantics):

1. write every shard and RNG file, ``fsync`` each (``save_file_durably``);
2. write ``metadata.json`` the same way, then ``fsync`` the ``iter_N.partial`` folder (its entries);
3. rename ``iter_N.partial`` to ``iter_N`` and ``fsync`` the parent folder (the rename itself)
   (``publish_folder``);
4. replace the pointer file atomically and ``fsync`` the parent again (``fsync_write``).
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file


def fsync_path(path: str) -> None:
    """``fsync`` of a file or a folder (a folder's fsync makes its entries, e.g. a rename, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_write(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically and durably (temporary file, fsync, rename, fsync of the folder)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def save_file_durably(tensors: dict[str, torch.Tensor], path: str) -> None:
    """``safetensors.torch.save_file`` followed by an fsync of the file."""
    save_file(tensors, path)
    fsync_path(path)


def publish_folder(partial: str, final: str) -> None:
    """Renames the complete folder ``partial`` to ``final`` durably (fsync of it, rename, fsync of the parent)."""
    fsync_path(partial)
    os.replace(partial, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
