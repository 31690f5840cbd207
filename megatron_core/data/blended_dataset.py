"""Weighted blends of datasets (``--data-path 0.3 a 0.7 b``) and document splits (``--split 949,50,1``)."""
import hashlib
import json
import logging
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_core.data.gpt_dataset import (
    check_chunk_in_range,
    check_ids_in_range,
    check_index_shape,
    chunks,
    load_cached_index,
)
from megatron_core.data.io_utils import atomic_save_npy

logger = logging.getLogger(__name__)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """Splits Megatron's ``--data-path`` list into prefixes and weights.

    ``["a"]`` -> ``(["a"], None)``; ``["0.3", "a", "0.7", "b"]`` -> ``(["a", "b"], [0.3, 0.7])``;
    ``["a", "b"]`` (no item is a number) -> ``(["a", "b"], None)``: unweighted, blended by their sizes as
    in Megatron-LM. Weights are returned as given (``BlendedDataset`` normalizes them).

    Raises:
        ValueError: an odd-length weighted list, a weight that is not a number, or a negative weight.
    """
    data_path = [str(p) for p in data_path]
    if not data_path:
        raise ValueError("--data-path is empty; give a prefix, or weight-prefix pairs like 0.3 a 0.7 b")
    if len(data_path) == 1 or not any(_is_number(item) for item in data_path):
        return data_path, None
    if len(data_path) % 2:
        raise ValueError(f"--data-path with several datasets must be weight-prefix pairs, got {len(data_path)} "
                         f"items: {data_path}")
    weights, prefixes = [], []
    for weight, prefix in zip(data_path[0::2], data_path[1::2]):
        try:
            value = float(weight)
        except ValueError as err:
            raise ValueError(f"--data-path weight {weight!r} (before {prefix!r}) is not a number; write pairs "
                             "like 0.3 a 0.7 b") from err
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"--data-path weight {weight} for {prefix!r} must be a finite number >= 0")
        weights.append(value)
        prefixes.append(prefix)
    return prefixes, weights


def normalize_weights(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum in float64 (megatron-core's ``normalize``, bit for bit).

    Raises:
        ValueError: when the sum is not positive.
    """
    array = np.asarray(weights, dtype=np.float64)
    total = float(np.sum(array))
    if total <= 0:
        raise ValueError(f"blend weights {list(weights)} sum to {total}; at least one must be positive")
    return (array / np.sum(array)).tolist()


def parse_split(split: str) -> List[float]:
    """``"949,50,1"`` -> normalized ``[0.949, 0.05, 0.001]`` (missing entries are 0, as in Megatron)."""
    try:
        values = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except ValueError as err:
        raise ValueError(f"--split {split!r} must be comma-separated numbers like 949,50,1") from err
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r} must be 1 to 3 non-negative numbers, not all 0, like 949,50,1")
    values += [0.0] * (3 - len(values))
    return normalize_weights(values)


def split_document_ranges(num_documents: int, split: Sequence[float]) -> List[Tuple[int, int]]:
    """[begin, end) document ranges for train/valid/test, as megatron-core's ``BlendedMegatronDatasetBuilder``.

    The normalized weights are turned into book-ends by a running float sum (megatron-core's
    ``convert_split_vector_to_split_matrix``: ``[0.9, 0.05, 0.05] -> (0, 0.9), (0.9, 0.95), (0.95, 1.0)``) and
    each book-end becomes ``int(round(bound * num_documents))``. A split of weight 0 is the empty range
    ``(end, end)`` (megatron-core builds no dataset for it).
    """
    weights = normalize_weights(split)
    bounds = [0.0]
    for weight in weights:
        bounds.append(bounds[-1] + weight)
    ranges = []
    for weight, low, high in zip(weights, bounds[:-1], bounds[1:]):
        end = int(round(high * float(num_documents)))
        ranges.append((end, end) if weight <= 0 else (int(round(low * float(num_documents))), end))
    return ranges


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy interleaving: sample ``i`` goes to the dataset furthest behind its share.

    The same loop as megatron-core's ``helpers.build_blending_indices``; like it, the weights are used as
    given (pass normalized weights, e.g. ``normalize_weights(w)``).

    Returns:
        (dataset_index int16, dataset_sample_index int64), each of length ``size``.
    """
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    pairs = list(enumerate(weights))
    for i in range(size):
        scale = max(float(i), 1.0)
        best, best_error = 0, weights[0] * scale - counts[0]
        for d, weight in pairs[1:]:
            error = weight * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Takes exactly ``sizes[d]`` samples from each dataset ``d``, interleaved by the greedy rule.

    megatron-core's ``helpers.build_exhaustive_blending_indices`` (a blend of unweighted prefixes with no
    requested size): the weights are ``sizes / sum(sizes)`` and a dataset leaves the race once it has given
    all its samples.

    Returns:
        (dataset_index int16, dataset_sample_index int64), each of length ``sum(sizes)``.
    """
    sizes = [int(n) for n in sizes]
    total = sum(sizes)
    weights = [n / float(total) for n in sizes]
    counts = [0] * len(sizes)
    unspent = [d for d, n in enumerate(sizes) if n > 0]
    dataset_index = np.empty(total, dtype=np.int16)
    dataset_sample_index = np.empty(total, dtype=np.int64)
    for i in range(total):
        scale = max(float(i), 1.0)
        best = max(unspent, key=lambda d: (weights[d] * scale - counts[d], -d))  # first of equal errors wins
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, dataset_sample_index


def samples_per_dataset(weights: Sequence[float], size: int) -> List[int]:
    """Samples to request from each blended dataset: ``ceil(ceil(size * w) * 1.005)`` as in Megatron."""
    return [int(math.ceil(math.ceil(size * w) * 1.005)) for w in normalize_weights(weights)]


class BlendedDataset(torch.utils.data.Dataset):
    """Samples drawn from ``datasets`` in proportion to ``weights`` (megatron-core's ``BlendedDataset``).

    The order is deterministic (no randomness): see ``build_blending_indices``. Items are the
    sub-dataset's dict plus ``dataset_id``.

    Args:
        datasets: the datasets to blend; each must hold at least the samples the blend takes from it.
        weights: non-negative weights, normalized here; with ``size=None``, the whole number of samples to
            take from each dataset.
        size: number of samples; None: exactly ``weights[d]`` samples of each dataset ``d``
            (``build_exhaustive_blending_indices``).
        cache_dir: where to cache the two index arrays as ``.npy`` (None: no caching).
        name: used in the cache key and messages.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: Optional[int], *,
                 cache_dir: Optional[str] = None, name: str = "train") -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(datasets)} datasets and "
                             f"{len(weights)} weights")
        if size is None and any(float(w) != int(w) or w < 0 for w in weights):
            raise ValueError(f"BlendedDataset with size=None takes whole sample counts as weights, got {list(weights)}")
        if size is not None and size <= 0:
            raise ValueError(f"BlendedDataset size must be positive, got {size}")
        self.datasets, self.name = list(datasets), name
        self.weights = normalize_weights(weights) if size is not None else [int(w) for w in weights]
        self.size = size if size is not None else sum(self.weights)
        self.dataset_index, self.dataset_sample_index = self._load_or_build(cache_dir, exhaustive=size is None)
        for d, dataset in enumerate(self.datasets):
            taken = self.dataset_sample_index[self.dataset_index == d]
            if len(taken) and int(taken.max()) >= len(dataset):
                raise ValueError(f"blend '{name}' needs {int(taken.max()) + 1} samples from dataset {d} but it has "
                                 f"{len(dataset)}; build it with num_samples >= samples_per_dataset(weights, size)")

    def _load_or_build(self, cache_dir: Optional[str], *, exhaustive: bool):
        key = json.dumps({"class": "BlendedDataset", "name": self.name, "weights": self.weights, "size": self.size,
                          "exhaustive": exhaustive, "datasets": [_describe(d) for d in self.datasets]},
                         sort_keys=True)
        digest = hashlib.md5(key.encode()).hexdigest()
        paths = [os.path.join(cache_dir, f"{digest}-BlendedDataset-{self.name}-{n}.npy")
                 for n in ("dataset_index", "dataset_sample_index")] if cache_dir else []
        if paths and all(os.path.isfile(p) for p in paths):
            arrays = tuple(load_cached_index(p, cache_dir) for p in paths)
            self._check_cached(paths, arrays, cache_dir)
            return arrays
        if exhaustive:
            arrays = build_exhaustive_blending_indices(self.weights)
        else:
            arrays = build_blending_indices(self.weights, self.size)
        for path, array in zip(paths, arrays):
            atomic_save_npy(path, array)
        return arrays

    def _check_cached(self, paths: Sequence[str], arrays: Sequence[np.ndarray], cache_dir: str) -> None:
        """Raises ValueError naming a cached file that is not this blend's: integer arrays of ``size`` entries,
        dataset ids below the number of datasets, sample ids below the size of their dataset."""
        dataset_index, dataset_sample_index = arrays
        for path, array in zip(paths, arrays):
            check_index_shape(array, (self.size,), path, cache_dir, why=f"blend '{self.name}' of {self.size} samples")
        check_ids_in_range(dataset_index, 0, len(self.datasets), paths[0], cache_dir, what="dataset id")
        sizes = np.array([len(d) for d in self.datasets], dtype=np.int64)
        for part in chunks(self.size):
            check_chunk_in_range(np.asarray(dataset_sample_index[part]), 0, sizes[dataset_index[part]], paths[1],
                                 cache_dir, what="sample id", start=part.start)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for blend '{self.name}' of {self.size} samples")
        d = int(self.dataset_index[idx])
        item = dict(self.datasets[d][int(self.dataset_sample_index[idx])])
        item["dataset_id"] = torch.tensor(d, dtype=torch.int64)
        return item


def _describe(dataset) -> str:
    """Cache-key text of a sub-dataset (its own cache key when it has one)."""
    key = getattr(dataset, "cache_key", None)
    return key()[0] if callable(key) else f"{type(dataset).__name__}:{len(dataset)}"
