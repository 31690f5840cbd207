"""The structure of a checkpoint's ``metadata.json``, checked before anything reads it: an error names the key.

    {"format": "megatron_core/1", "iteration": int >= 0, "consumed_samples": int >= 0,
     "true_vocab_size": int >= 1, "layout": {"tp": int >= 1, "pp": ..., "dp": ..., ...},
     "config": {flag: value}, "scheduler": {...} | null, "optimizer": {...} | null,
     "tensors": {name: {"partition_dim": int | null, "stride": int >= 1, "dtype": str,
                        "global_shape": [int >= 0, ...], "shards": {"<tp rank>": {"file": str, "shape": [int]}}}},
     "checksums": {file: 64 hex digits}, "sizes": {file: int >= 0} (absent in older checkpoints),
     "tokenizer": {...} (absent in older checkpoints)}
"""
from __future__ import annotations

import re
from typing import Any

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _fail(path: str, key: str, expected: str, value: Any) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ValueError(f"checkpoint metadata {path} is malformed: {key} must be {expected}, got "
                     f"{type(value).__name__} {shown}")


def _int(path: str, key: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(path, key, f"an integer >= {minimum}", value)


def _object(path: str, key: str, value: Any, *, nullable: bool = False) -> None:
    if not (isinstance(value, dict) or (nullable and value is None)):
        _fail(path, key, "an object" + (" or null" if nullable else ""), value)


def _shape(path: str, key: str, value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in value):
        _fail(path, key, "a list of integers >= 0", value)


def _tensor(path: str, name: str, entry: Any) -> None:
    key = f"tensors[{name!r}]"
    _object(path, key, entry)
    for field in ("partition_dim", "stride", "dtype", "shards", "global_shape"):
        if field not in entry:
            raise ValueError(f"checkpoint metadata {path} is malformed: {key} has no {field!r}")
    dim = entry["partition_dim"]
    if dim is not None:
        _int(path, f"{key}['partition_dim']", dim, 0)
    _int(path, f"{key}['stride']", entry["stride"], 1)
    if not isinstance(entry["dtype"], str):
        _fail(path, f"{key}['dtype']", "a string", entry["dtype"])
    _shape(path, f"{key}['global_shape']", entry["global_shape"])
    shards = entry["shards"]
    _object(path, f"{key}['shards']", shards)
    if not shards:
        raise ValueError(f"checkpoint metadata {path} is malformed: {key}['shards'] is empty")
    for rank, shard in shards.items():
        shard_key = f"{key}['shards'][{rank!r}]"
        if not rank.isascii() or not rank.isdigit():
            _fail(path, f"{key}['shards'] keys", "tp ranks (digits)", rank)
        _object(path, shard_key, shard)
        if not isinstance(shard.get("file"), str):
            _fail(path, f"{shard_key}['file']", "a file name", shard.get("file"))
        _shape(path, f"{shard_key}['shape']", shard.get("shape"))


def validate_metadata(path: str, metadata: Any) -> None:
    """Raises ValueError naming the first key of ``metadata`` (read from ``path``) that is missing or of the
    wrong type or range."""
    _object(path, "the top level", metadata)
    required = ("iteration", "consumed_samples", "true_vocab_size", "layout", "tensors", "checksums")
    for key in required:
        if key not in metadata:
            raise ValueError(f"checkpoint metadata {path} is malformed: the key {key!r} is missing")
    _int(path, "'iteration'", metadata["iteration"], 0)
    _int(path, "'consumed_samples'", metadata["consumed_samples"], 0)
    _int(path, "'true_vocab_size'", metadata["true_vocab_size"], 1)
    layout = metadata["layout"]
    _object(path, "'layout'", layout)
    for axis in ("tp", "pp", "dp"):
        _int(path, f"'layout'[{axis!r}]", layout.get(axis), 1)
    for key in ("config", "tokenizer"):
        if key in metadata:
            _object(path, repr(key), metadata[key], nullable=True)
    for key in ("scheduler", "optimizer"):
        _object(path, repr(key), metadata.get(key), nullable=True)
    _object(path, "'tensors'", metadata["tensors"])
    for name, entry in metadata["tensors"].items():
        _tensor(path, name, entry)
    checksums = metadata["checksums"]
    _object(path, "'checksums'", checksums)
    for file, digest in checksums.items():
        if not isinstance(digest, str) or not _HEX64.match(digest):
            _fail(path, f"'checksums'[{file!r}]", "a sha256 (64 lowercase hex digits)", digest)
    sizes = metadata.get("sizes", {})
    _object(path, "'sizes'", sizes)
    for file, size in sizes.items():
        _int(path, f"'sizes'[{file!r}]", size, 0)


__all__ = ["validate_metadata"]
