"""A dependency-free RGB PNG encoder and atomic file writes (for schedule pictures and loss curves)."""
from __future__ import annotations

import os
import struct
import zlib

Pixel = tuple[int, int, int]


def encode_png(pixels: list[list[Pixel]]) -> bytes:
    """PNG bytes of an RGB image given as rows of (r, g, b) pixels."""
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def atomic_write(path: str, data: bytes) -> None:
    """Writes ``data`` to a temporary file beside ``path`` and renames it into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
