"""A corpus every machine with Python has: the standard library's own ``.py`` sources.

With no ``--data-path`` the training loop trains on this. The sources are read in sorted path order
(``site-packages`` and test folders excluded) until ``max_bytes``, each file one document ending in
eod, tokenized once and cached as a Megatron ``.bin``/``.idx`` pair under
``$MEGATRON_CORE_CACHE/default_corpus`` (default ``~/.cache/megatron_core``). The cache key covers the
tokenizer, the Python version and the size cap, so a change of any rebuilds it.
"""
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from typing import List, Optional

from megatron_core.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path, optimal_dtype
from megatron_core.data.io_utils import atomic_write_text
from megatron_core.data.tokenizers import ByteTokenizer, Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 3_000_000
CACHE_ENV_VAR = "MEGATRON_CORE_CACHE"
_FORMAT_VERSION = 1
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"})


def default_cache_dir() -> str:
    """``$MEGATRON_CORE_CACHE`` if set, else ``~/.cache/megatron_core``."""
    return os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "megatron_core")


def stdlib_source_files(stdlib_dir: Optional[str] = None) -> List[str]:
    """Sorted ``.py`` files under the standard library folder, test and third-party folders excluded."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _EXCLUDED_DIRS)
        files.extend(os.path.join(folder, n) for n in sorted(names) if n.endswith(".py"))
    return sorted(files)


def gather_documents(max_bytes: int = DEFAULT_MAX_BYTES, stdlib_dir: Optional[str] = None) -> List[str]:
    """Texts of standard-library sources, in path order, until ``max_bytes`` UTF-8 bytes are gathered.

    Raises:
        ValueError: no readable source was found (a Python install without its ``.py`` files).
    """
    documents, total = [], 0
    for path in stdlib_source_files(stdlib_dir):
        if total >= max_bytes:
            break
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            documents.append(text)
            total += len(text.encode("utf-8"))
    if not documents:
        raise ValueError(f"no Python sources found under {stdlib_dir or sysconfig.get_paths()['stdlib']}; "
                         "pass --data-path to train on your own data")
    return documents


def _cache_key(tokenizer: Tokenizer, max_bytes: int) -> str:
    description = {"format": _FORMAT_VERSION, "tokenizer": tokenizer.describe(), "max_bytes": max_bytes,
                   "python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"]}
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def default_corpus_prefix(tokenizer: Optional[Tokenizer] = None, cache_dir: Optional[str] = None,
                          max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Path prefix of the cached default corpus, building it on first use.

    Args:
        tokenizer: tokenizer to encode with; ``ByteTokenizer()`` when None (needs no file).
        cache_dir: cache root; ``default_cache_dir()`` when None.
        max_bytes: cap on the source text gathered (about 3 MB: builds in a few seconds).

    Returns:
        A prefix for ``IndexedDataset``; the files are written atomically, so concurrent builders
        (several ranks) are safe.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    tokenizer = tokenizer or ByteTokenizer()
    folder = os.path.join(cache_dir or default_cache_dir(), "default_corpus")
    prefix = os.path.join(folder, f"stdlib_{_cache_key(tokenizer, max_bytes)}_text_document")
    if os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix)):
        return prefix
    start = time.perf_counter()
    documents = gather_documents(max_bytes)
    tokens = 0
    with IndexedDatasetBuilder(prefix, optimal_dtype(tokenizer.vocab_size)) as builder:
        for text in documents:
            ids = tokenizer.encode(text)
            ids.append(tokenizer.eod)
            builder.add_document(ids)
            tokens += len(ids)
    atomic_write_text(prefix + ".json", json.dumps({"documents": len(documents), "tokens": tokens,
                                                    "tokenizer": tokenizer.describe()}, indent=2))
    logger.info("built the default corpus (%d stdlib sources, %d tokens) at %s in %.1f s",
                len(documents), tokens, prefix, time.perf_counter() - start)
    return prefix
