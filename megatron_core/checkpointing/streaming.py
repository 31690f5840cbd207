"""Write a safetensors file tensor by tensor: the header (every name, dtype and shape) goes first, then each
tensor's bytes are appended as they are produced, so a writer never holds more than one tensor in memory.
The files are ordinary safetensors files (``safe_open`` / ``load_file`` read them). The writer hashes what it
writes, so the sha256 and length metadata.json records need no second read of the file."""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from types import MappingProxyType
from typing import Sequence

import torch

from megatron_core.utils.durable import fsync_path, open_new

_DTYPES = MappingProxyType({torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"})


def parse_dtype(text: str) -> torch.dtype:
    """``"torch.float32"`` (as metadata.json records it) -> ``torch.float32``."""
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
        raise ValueError(f"unsupported tensor dtype {text!r} (known: {sorted(str(d) for d in _DTYPES)})")
    return dtype


class StreamingSafetensorsWriter:
    """A safetensors file whose tensors are declared up front and then written one at a time, in order.

    Args:
        path: the file to write.
        tensors: ``[(name, dtype, shape)]`` in the order ``write`` will receive them.
        atomic: write a fresh temporary file beside ``path`` (random name, ``O_EXCL | O_NOFOLLOW``) that
            ``close`` fsyncs and renames into place; without it, ``path`` itself is created new
            (``O_EXCL | O_NOFOLLOW``: for files inside a fresh folder that is published as a whole).

    After ``close``, ``sha256`` (hex) and ``size`` (bytes) describe the file written.
    """

    def __init__(self, path: str, tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], *,
                 atomic: bool = True) -> None:
        self.path, self._order, self._next = path, [name for name, _, _ in tensors], 0
        header, offset = {}, 0
        self._expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name, dtype, shape in tensors:
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._expected[name] = (dtype, tuple(shape))
            offset += size
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        if atomic:
            fd, self._tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                             dir=os.path.dirname(os.path.abspath(path)))
            self._file = os.fdopen(fd, "wb")
        else:
            self._tmp, self._file = None, open_new(path)
        self._digest, self.size, self.sha256 = hashlib.sha256(), 0, None
        self._append(len(encoded).to_bytes(8, "little") + encoded)

    def _append(self, data) -> None:
        self._file.write(data)
        self._digest.update(data)
        self.size += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Appends ``tensor`` (must be the next declared name, with its dtype and shape)."""
        expected_name = self._order[self._next] if self._next < len(self._order) else None
        dtype, shape = self._expected.get(name, (None, None))
        if name != expected_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: expected tensor {expected_name!r} next as {dtype} {shape}, got {name!r} "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._append(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        """Checks every declared tensor was written, fsyncs and renames the file into place."""
        if self._next != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._next} declared tensors were never written "
                             f"(first: {self._order[self._next]!r})")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.sha256 = self._digest.hexdigest()
        if self._tmp is not None:
            os.replace(self._tmp, self.path)
            fsync_path(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Closes and removes the unfinished file (after a failed write)."""
        try:
            self._file.close()
        except OSError:
            pass
        try:
            os.remove(self._tmp if self._tmp is not None else self.path)
        except OSError:
            pass


__all__ = ["StreamingSafetensorsWriter", "parse_dtype"]
