"""Megatron's memory-mapped indexed dataset: a ``.bin`` file of tokens and a ``.idx`` file that indexes it.

Layout of ``{prefix}.idx`` (all little-endian), byte-compatible with Megatron-LM's
``megatron/core/datasets/indexed_dataset.py``::

    b"MMIDIDX\\x00\\x00"      9 bytes, magic
    version                 uint64, always 1
    dtype code              uint8, see ``DTYPE_CODES`` (token dtype of the .bin file)
    sequence count  n       uint64
    document count  d       uint64 (number of entries of document_indices, i.e. documents + 1)
    sequence_lengths        n x int32, tokens per sequence
    sequence_pointers       n x int64, byte offset of each sequence in the .bin file
    document_indices        d x int64, starts at 0; entry k+1 is one past document k's last sequence
    [sequence_modes]        n x int8, only in Megatron's multimodal files (accepted, ignored)

``{prefix}.bin`` is the sequences' tokens back to back, in that dtype.
"""
import contextlib
import logging
import os
import struct
from types import MappingProxyType
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from megatron_core.utils.durable import atomic_file, write_atomically

logger = logging.getLogger(__name__)

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
DTYPE_CODES: Dict[int, type] = MappingProxyType({
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
})
_CHUNK = 1 << 20  # elements per chunk when validating large index arrays


def dtype_code(dtype: type) -> int:
    """Megatron's numeric code for a numpy token dtype (e.g. 8 for ``np.uint16``)."""
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"token dtype {np.dtype(dtype)} has no Megatron dtype code; use one of "
                     f"{[np.dtype(t).name for t in DTYPE_CODES.values()]}")


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """Token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, int32 otherwise."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    """``{prefix}.bin``."""
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    """``{prefix}.idx``."""
    return prefix + ".idx"


def index_bytes(dtype: type, sequence_lengths: Sequence[int], document_indices: Sequence[int]) -> bytes:
    """The bytes of a ``.idx`` file for these sequences (pointers are derived from the lengths).

    Args:
        dtype: token dtype of the matching ``.bin`` file.
        sequence_lengths: tokens per sequence.
        document_indices: starts with 0, one entry past each document's last sequence.
    """
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1] * np.dtype(dtype).itemsize, out=pointers[1:])
    doc_idx = np.asarray(document_indices, dtype=np.int64)
    header = INDEX_MAGIC + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", dtype_code(dtype))
    header += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    return header + lengths.astype(np.int32).tobytes() + pointers.tobytes() + doc_idx.tobytes()


class IndexedDatasetBuilder:
    """Streams documents into ``{prefix}.bin`` and writes ``{prefix}.idx`` on ``finalize``.

    Both files are written under temporary names and renamed into place at the end, so an
    interrupted run leaves no half-written dataset. Memory grows with the number of documents
    (one int per document), never with the number of tokens.

    Args:
        prefix: output path without extension.
        dtype: token dtype, usually ``optimal_dtype(tokenizer.vocab_size)``.
    """

    def __init__(self, prefix: str, dtype: type = np.int32) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validates
        folder = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(folder, exist_ok=True)
        # the .bin streams into a fresh temporary file (utils/durable.py) renamed into place by finalize()
        self._files = contextlib.ExitStack()
        self._bin = self._files.enter_context(atomic_file(data_file_path(prefix)))
        self._lengths: list = []
        self._document_indices: list = [0]
        self._max_token = np.iinfo(self.dtype).max if self.dtype.kind in "iu" else None

    def add_document(self, tokens: Iterable[int]) -> None:
        """Appends one document as one sequence (what ``tools/preprocess_data.py`` writes)."""
        self.add_sentences([tokens])

    def add_sentences(self, sentences: Iterable[Iterable[int]]) -> None:
        """Appends one document as several sequences (``--split-sentences``: one per sentence)."""
        for tokens in sentences:
            array = np.asarray(tokens)
            if self._max_token is not None and array.size and (
                    array.max() > self._max_token or array.min() < np.iinfo(self.dtype).min):
                raise ValueError(f"token ids in [{array.min()}, {array.max()}] do not fit {self.dtype.name} "
                                 f"for {self.prefix}; build the dataset with a wider dtype (np.int32)")
            self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
            self._lengths.append(int(array.size))
        self._document_indices.append(len(self._lengths))

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._document_indices) - 1

    def finalize(self) -> None:
        """Writes the index and renames both files into place (the .bin first, each fsynced)."""
        data = index_bytes(self.dtype.type, self._lengths, self._document_indices)
        self._files.close()  # fsync and rename of the .bin
        write_atomically(index_file_path(self.prefix), data)

    def abort(self) -> None:
        """Closes and removes the temporary data file; nothing is written at ``prefix``."""
        self._files.__exit__(RuntimeError, RuntimeError("aborted"), None)  # atomic_file removes its temp file

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of a Megatron ``.bin``/``.idx`` pair through ``np.memmap``.

    Opening validates the header and sizes (wrong magic, version or dtype code, counts that overrun
    the file, document indices out of order, pointers past the end of the ``.bin``) and raises a
    ``ValueError`` that names the file. Memory use does not depend on the file sizes: arrays are views
    of the mapped files, and validation walks them in fixed-size chunks.

    Args:
        path_prefix: path without the ``.bin``/``.idx`` extension.
    """

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file {path} does not exist; pass the path "
                                        "prefix without extension (e.g. 'data/my_text_document')")
        self.dtype, n_seq, n_doc = _read_header(idx_path)
        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx_map, np.int32, n_seq, offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(self._idx_map, np.int64, n_seq, offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(self._idx_map, np.int64, n_doc, offset)
        bin_size = os.path.getsize(bin_path)
        self._bin_map = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)
        _validate_arrays(self, idx_path, bin_path, bin_size)
        logger.debug("opened %s: %d sequences, %d documents, %s", path_prefix, n_seq, n_doc - 1, self.dtype)

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(document_indices) - 1``)."""
        return len(self.document_indices) - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        """Tokens of sequence ``idx`` (a read-only array view of the mapped file)."""
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {self.path_prefix} with {n} sequences")
        idx = int(idx) % n
        seq_len = int(self.sequence_lengths[idx])
        length = seq_len - offset if length is None else int(length)
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                             f"of length {seq_len} in {self.path_prefix}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, self.dtype, length, start)


def _read_header(idx_path: str):
    """Returns (dtype, sequence count, document count) after checking magic, version, code, size."""
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if head[:9] != INDEX_MAGIC:
        raise ValueError(f"{idx_path} is not a Megatron index file: magic {head[:9]!r} != {INDEX_MAGIC!r}")
    if len(head) < HEADER_SIZE:
        raise ValueError(f"{idx_path} is truncated: {size} bytes, the header alone needs {HEADER_SIZE}")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != INDEX_VERSION:
        raise ValueError(f"{idx_path} has index version {version}; only version {INDEX_VERSION} is supported")
    code = head[17]
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_path} has dtype code {code}; valid codes are {sorted(DTYPE_CODES)}")
    n_seq, n_doc = struct.unpack("<QQ", head[18:34])
    expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc
    if size not in (expected, expected + n_seq):  # + n_seq: Megatron's multimodal sequence modes
        raise ValueError(f"{idx_path} is truncated or corrupt: {n_seq} sequences and {n_doc} document "
                         f"indices need {expected} bytes, the file has {size}")
    return np.dtype(DTYPE_CODES[code]), n_seq, n_doc


def _validate_arrays(ds: IndexedDataset, idx_path: str, bin_path: str, bin_size: int) -> None:
    """Checks lengths, pointers and document indices chunk by chunk (constant memory)."""
    doc = ds.document_indices
    n_seq = len(ds.sequence_lengths)
    if len(doc) == 0 or doc[0] != 0 or doc[-1] != n_seq:
        first, last = (int(doc[0]), int(doc[-1])) if len(doc) else (None, None)
        raise ValueError(f"{idx_path} is corrupt: document_indices must start at 0 and end at the sequence "
                         f"count {n_seq}, got first={first} last={last}")
    for start in range(0, len(doc), _CHUNK):
        chunk = doc[max(start - 1, 0): start + _CHUNK]
        if np.any(np.diff(chunk) < 0):
            raise ValueError(f"{idx_path} is corrupt: document_indices decrease near entry {start}")
    itemsize = ds.dtype.itemsize
    for start in range(0, n_seq, _CHUNK):
        lengths = ds.sequence_lengths[start: start + _CHUNK]
        pointers = ds.sequence_pointers[start: start + _CHUNK]
        if lengths.min() < 0 or pointers.min() < 0:
            raise ValueError(f"{idx_path} is corrupt: negative sequence length or pointer near sequence {start}")
        ends = pointers + lengths.astype(np.int64) * itemsize
        if ends.max() > bin_size:
            bad = int(np.argmax(ends > bin_size))
            raise ValueError(f"{bin_path} is truncated: sequence {start + bad} ends at byte {int(ends[bad])} but the "
                             f"file has {bin_size} bytes (re-run preprocessing or copy the file again)")
