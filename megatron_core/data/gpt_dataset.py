"""GPT pretraining samples over an indexed dataset, with Megatron-LM's GPTDataset semantics.

The documents of a split are shuffled and concatenated, epoch after epoch, into one token stream;
sample ``i`` is the ``seq_length + 1`` tokens starting at ``i * seq_length`` (consecutive samples share
one token: the last label of one is the first input of the next). Three index arrays describe this:

* document index: the split's document ids for every epoch, shuffled with ``RandomState(seed)``;
  when the final epoch is needed for under 80% of its samples it is shuffled separately.
* sample index: ``(num_samples + 1, 2)`` rows of (position in the document index, token offset).
* shuffle index: a permutation of the samples (again the final partial epoch separately).

They are built with numpy (no C++ helpers), identical to Megatron's for the same inputs, and cached
beside the data as ``.npy`` files named by an MD5 of the configuration. A cached file is checked against
what the configuration implies (dtype, shape, ids in range, sample offsets inside their documents and in
order) before use; a file that fails names itself in a ``ValueError`` with the fix (delete the cache folder).
"""
import dataclasses
import hashlib
import json
import logging
import os
from typing import Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_core.data.io_utils import atomic_save_npy, atomic_write_text

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GPTDatasetConfig:
    """What defines a GPT dataset's samples (everything here enters the cache key).

    Attributes:
        seq_length: tokens per sample fed to the model; each sample reads ``seq_length + 1`` tokens.
        seed: seed of the document and sample shuffles.
        eod: end-of-document id, used by ``eod_mask_loss`` and ``reset_position_ids``.
        eod_mask_loss: zero the loss mask where the input token is eod.
        reset_position_ids: restart position ids after each eod.
    """

    seq_length: int
    seed: int = 1234
    eod: Optional[int] = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False

    def __post_init__(self) -> None:
        if self.seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {self.seq_length}")
        if (self.eod_mask_loss or self.reset_position_ids) and self.eod is None:
            raise ValueError("eod_mask_loss/reset_position_ids need the tokenizer's eod id; set eod=tokenizer.eod")


_CHUNK = 1 << 22  # rows per chunk when checking cached indices (bounded memory on memory-mapped files)


def _cache_error(path: str, problem: str, cache_dir: str) -> ValueError:
    return ValueError(f"cached index {path} is corrupt: {problem}; delete the cache folder {cache_dir} to "
                      "rebuild it")


def load_cached_index(path: str, cache_dir: str) -> np.ndarray:
    """``np.load(path)`` memory-mapped, without pickles; a file numpy refuses (truncated, an object array)
    raises a ValueError naming it."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as err:
        raise _cache_error(path, f"numpy cannot load it ({err})", cache_dir) from err
    if not isinstance(array, np.ndarray):  # an .npz archive under the .npy name
        array.close()
        raise _cache_error(path, f"it holds a {type(array).__name__}, not one .npy array", cache_dir)
    return array


def check_index_shape(array: np.ndarray, shape: Tuple[int, ...], path: str, cache_dir: str, *,
                      why: str) -> None:
    """An integer array of exactly ``shape`` (``why`` says where the shape comes from)."""
    if array.dtype.kind not in "iu":
        raise _cache_error(path, f"dtype {array.dtype} is not an integer type", cache_dir)
    if array.shape != shape:
        raise _cache_error(path, f"shape {array.shape}, expected {shape} ({why})", cache_dir)


def chunks(length: int) -> Iterator[slice]:
    """Consecutive slices of at most ``_CHUNK`` rows covering ``range(length)``."""
    for start in range(0, length, _CHUNK):
        yield slice(start, min(start + _CHUNK, length))


def check_ids_in_range(values: np.ndarray, low: int, high: int, path: str, cache_dir: str, *, what: str) -> None:
    """Every entry of ``values`` (a memory-mapped array is read chunk by chunk) lies in ``[low, high)``."""
    for part in chunks(len(values)):
        check_chunk_in_range(np.asarray(values[part]), low, high, path, cache_dir, what=what, start=part.start)


def check_chunk_in_range(chunk: np.ndarray, low: int, high, path: str, cache_dir: str, *, what: str,
                         start: int) -> None:
    """Every ``chunk[i]`` in ``[low, high)`` (``high`` an int or one bound per entry); ``start`` is the chunk's
    position in the file, for the message."""
    bad = np.flatnonzero((chunk < low) | (chunk >= high))
    if len(bad):
        i = int(bad[0])
        bound = high if np.isscalar(high) else high[i]
        raise _cache_error(path, f"{what} {int(chunk[i])} at position {start + i} out of range [{low}, {int(bound)})",
                           cache_dir)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Document ids repeated for ``num_epochs`` and shuffled (Megatron's ``_build_document_index``)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """``(num_samples + 1, 2)`` int64 rows of (document index position, offset) where samples begin.

    Same values as Megatron's ``helpers.build_sample_idx`` with ``add_extra_token_to_sequence=True``
    and partial last samples dropped; computed with ``searchsorted`` instead of a C++ loop. Row ``i``
    locates token ``i * seq_length`` of the concatenated stream; empty documents are skipped.
    """
    doc_lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(doc_lengths)
    total = int(ends[-1]) if len(ends) else 0
    num_samples = (total - 1) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[doc_pos] - doc_lengths[doc_pos])
    return np.stack([doc_pos, offsets], axis=1)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def _num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
    """Fewest epochs whose tokens give ``num_samples`` samples (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def _separate_final_epoch(num_epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int) -> bool:
    """Megatron's rule: shuffle the last epoch apart when it supplies < 80% of an epoch's samples."""
    if num_epochs == 1 or num_samples is None:
        return False
    before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_final = num_samples - before_final
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return from_final < int(0.80 * per_epoch)


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from a split of an indexed dataset.

    ``len`` is ``num_samples`` (one epoch's samples when None). Items are dicts of torch tensors, each of shape
    ``(seq_length,)``: ``tokens`` and ``labels`` (int64,
    labels are tokens shifted by one), ``loss_mask`` (float32) and ``position_ids`` (int64).

    Args:
        indexed_dataset: an ``IndexedDataset`` (or anything with ``sequence_lengths`` and
            ``get(idx, offset, length)``); each sequence is one document, as preprocess_data writes.
        documents: the split's document ids (e.g. ``np.arange(begin, end)``).
        num_samples: samples wanted; more epochs are added to reach it. None: exactly one epoch.
        config: sequence length, seed and mask options.
        split_name: "train", "valid" or "test"; part of the cache key and file names.
        cache_dir: where the index ``.npy`` files go. Default: ``cache/GPTDataset_indices`` beside the
            data when ``indexed_dataset`` has a ``path_prefix``; no caching otherwise.
    """

    def __init__(self, indexed_dataset, documents: np.ndarray, num_samples: Optional[int],
                 config: GPTDatasetConfig, *, split_name: str = "train", cache_dir: Optional[str] = None) -> None:
        self.dataset = indexed_dataset
        self.documents = np.asarray(documents, dtype=np.int64)
        self.num_samples = num_samples
        self.config = config
        self.split_name = split_name
        if len(self.documents) == 0:
            raise ValueError(f"{split_name} split of {self._path()} has no documents; change --split or add data")
        num_sequences = len(indexed_dataset.sequence_lengths)
        if self.documents.min() < 0 or self.documents.max() >= num_sequences:
            raise ValueError(f"document ids [{self.documents.min()}, {self.documents.max()}] out of range for "
                             f"{self._path()} with {num_sequences} documents")
        prefix = getattr(indexed_dataset, "path_prefix", None)
        if cache_dir is None and prefix is not None:
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")
        self.cache_dir = cache_dir
        self.built_indices = False  # True when this instance computed (rather than loaded) the indices
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build_indices()

    def _path(self) -> str:
        return str(getattr(self.dataset, "path_prefix", type(self.dataset).__name__))

    def cache_key(self) -> Tuple[str, str]:
        """(MD5 hex digest, JSON description) identifying this dataset's indices."""
        description = json.dumps({
            "class": "GPTDataset", "path_prefix": self._path(), "split": self.split_name,
            "sequences": int(len(self.dataset.sequence_lengths)),
            "documents_md5": hashlib.md5(self.documents.tobytes()).hexdigest(),
            "num_samples": self.num_samples, **dataclasses.asdict(self.config),
        }, indent=2, sort_keys=True)
        return hashlib.md5(description.encode()).hexdigest(), description

    def _load_or_build_indices(self):
        names = ("document_index", "sample_index", "shuffle_index")
        digest, description = self.cache_key()
        paths = [os.path.join(self.cache_dir, f"{digest}-GPTDataset-{self.split_name}-{n}.npy")
                 for n in names] if self.cache_dir else []
        tokens_per_epoch, num_epochs, separate = self._epochs()
        if paths and all(os.path.isfile(p) for p in paths):
            logger.info("loading %s %s indices from %s", self._path(), self.split_name, self.cache_dir)
            indices = tuple(load_cached_index(p, self.cache_dir) for p in paths)
            self._check_cached_indices(paths, indices, num_epochs=num_epochs, tokens_per_epoch=tokens_per_epoch)
            return indices
        indices = self._build_indices(tokens_per_epoch, num_epochs, separate)
        self.built_indices = True
        if paths:
            for path, array in zip(paths, indices):
                atomic_save_npy(path, array)
            atomic_write_text(os.path.join(self.cache_dir, f"{digest}-GPTDataset-{self.split_name}-description.txt"),
                              description)
        return indices

    def _epochs(self) -> Tuple[int, int, bool]:
        """(tokens per epoch, epochs, whether the final epoch is shuffled apart) for ``num_samples``."""
        seq_length = self.config.seq_length
        tokens_per_epoch = int(self.dataset.sequence_lengths[self.documents].astype(np.int64).sum())
        if tokens_per_epoch <= seq_length:
            raise ValueError(f"{self.split_name} split of {self._path()} ({len(self.documents)} documents, "
                             f"{tokens_per_epoch} tokens) holds no sample of --seq-length {seq_length}: it has "
                             f"fewer than seq_length + 1 = {seq_length + 1} tokens; lower --seq-length, change "
                             "--split or add data")
        num_epochs = _num_epochs(tokens_per_epoch, seq_length, self.num_samples)
        return tokens_per_epoch, num_epochs, _separate_final_epoch(num_epochs, tokens_per_epoch, seq_length,
                                                                   self.num_samples)

    def _build_indices(self, tokens_per_epoch: int, num_epochs: int, separate: bool):
        seq_length, lengths = self.config.seq_length, self.dataset.sequence_lengths
        rng = np.random.RandomState(self.config.seed)
        document_index = build_document_index(self.documents, num_epochs, rng, separate)
        sample_index = build_sample_index(lengths, document_index, seq_length)
        total = len(sample_index) - 1
        shuffled = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
        shuffle_index = build_shuffle_index(shuffled, total, rng)
        logger.info("built %s %s indices: %d epochs, %d samples", self._path(), self.split_name, num_epochs, total)
        return document_index, sample_index, shuffle_index

    def _check_cached_indices(self, paths: Sequence[str], indices: Sequence[np.ndarray], *, num_epochs: int,
                              tokens_per_epoch: int) -> None:
        """Raises ValueError naming the first cached file that is not what this configuration builds: integer
        arrays of the implied shapes, document ids of the split, sample rows inside their documents and in
        stream order, shuffle ids below the number of samples."""
        document_index, sample_index, shuffle_index = indices
        folder, seq_length = self.cache_dir, self.config.seq_length
        num_documents, total = len(self.documents), (num_epochs * tokens_per_epoch - 1) // seq_length
        check_index_shape(document_index, (num_epochs * num_documents,), paths[0], folder,
                          why=f"{num_epochs} epochs x {num_documents} documents")
        low, high = int(self.documents.min()), int(self.documents.max()) + 1
        check_ids_in_range(document_index, low, high, paths[0], folder, what="document id")
        check_index_shape(sample_index, (total + 1, 2), paths[1], folder,
                          why=f"{total} samples of --seq-length {seq_length} + 1 rows")
        self._check_sample_rows(sample_index, document_index, paths[1])
        check_index_shape(shuffle_index, (total,), paths[2], folder, why=f"{total} samples")
        check_ids_in_range(shuffle_index, 0, total, paths[2], folder, what="sample id")

    def _check_sample_rows(self, sample_index: np.ndarray, document_index: np.ndarray, path: str) -> None:
        """Rows (document index position, offset): positions in range, offsets inside that document, and
        every row after the previous one in the token stream (chunks overlap by one row)."""
        lengths, folder = self.dataset.sequence_lengths, self.cache_dir
        for part in chunks(len(sample_index)):
            begin = max(part.start - 1, 0)
            rows = np.asarray(sample_index[begin:part.stop])
            positions, offsets = rows[:, 0], rows[:, 1]
            check_chunk_in_range(positions, 0, len(document_index), path, folder,
                                 what="document index position", start=begin)
            doc_lengths = lengths[document_index[positions]]
            check_chunk_in_range(offsets, 0, doc_lengths, path, folder, what="token offset", start=begin)
            step, advance = np.diff(positions), np.diff(offsets)
            back = np.flatnonzero((step < 0) | ((step == 0) & (advance <= 0)))
            if len(back):
                i = begin + int(back[0]) + 1
                raise _cache_error(path, f"sample row {i} ({int(rows[i - begin, 0])}, {int(rows[i - begin, 1])}) "
                                         f"does not come after row {i - 1} in the token stream", folder)

    def __len__(self) -> int:
        return len(self.shuffle_index) if self.num_samples is None else self.num_samples

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` (after the shuffle)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.split_name} dataset of {len(self)} samples")
        i = int(self.shuffle_index[idx])
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[i], self.sample_index[i + 1]
        get, doc_ids = self.dataset.get, self.document_index
        if doc_beg == doc_end:
            return np.array(get(int(doc_ids[doc_beg]), int(off_beg), int(off_end - off_beg + 1)), dtype=np.int64)
        parts = [get(int(doc_ids[doc_beg]), int(off_beg))]
        parts += [get(int(doc_ids[j])) for j in range(int(doc_beg) + 1, int(doc_end))]
        parts.append(get(int(doc_ids[doc_end]), 0, int(off_end) + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        text = torch.from_numpy(self.sample_tokens(idx))
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
        position_ids = torch.arange(tokens.numel(), dtype=torch.int64)
        if self.config.eod_mask_loss:
            loss_mask[tokens == self.config.eod] = 0.0
        if self.config.reset_position_ids:
            position_ids = _reset_positions(tokens, self.config.eod)
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def _reset_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Position ids that restart at 0 on the token after each eod (Megatron's reset_position_ids)."""
    n = tokens.numel()
    positions = torch.arange(n, dtype=torch.int64)
    starts = torch.zeros(n, dtype=torch.int64)
    after_eod = (tokens[:-1] == eod).nonzero().flatten() + 1
    starts[after_eod] = after_eod
    starts = torch.cummax(starts, dim=0).values
    return positions - starts
