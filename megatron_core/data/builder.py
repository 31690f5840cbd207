"""Entry point of the training loop: flags -> (train, valid, test) GPT datasets."""
import dataclasses
import logging
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_core.data.blended_dataset import (
    BlendedDataset,
    normalize_weights,
    parse_data_path,
    parse_split,
    samples_per_dataset,
    split_document_ranges,
)
from megatron_core.data.default_corpus import default_corpus_prefix
from megatron_core.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_core.data.indexed_dataset import IndexedDataset
from megatron_core.data.tokenizers import ByteTokenizer, Tokenizer

logger = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")


@dataclasses.dataclass
class GPTDataConfig:
    """Data flags of ``pretrain_gpt.py``.

    Attributes:
        seq_length: tokens per sample (``--seq-length``).
        data_path: ``--data-path``: ``["prefix"]``, weight-prefix pairs ``["0.3", "a", "0.7", "b"]``,
            or None for the built-in default corpus (standard-library sources).
        split: ``--split``, document shares of train/valid/test, e.g. ``"949,50,1"``.
        seed: ``--seed`` of the shuffles.
        tokenizer: used for eod and for building the default corpus; ``ByteTokenizer()`` when None.
        train_samples / valid_samples / test_samples: samples per split; 0 skips the split
            (None: one epoch of an unblended dataset).
        eod_mask_loss: ``--eod-mask-loss``.
        reset_position_ids: ``--reset-position-ids``.
        cache_dir: where the default corpus is cached (None: ``$MEGATRON_CORE_CACHE``).
        index_cache_dir: where sample indices are cached (None: beside the data).
    """

    seq_length: int
    data_path: Optional[List[str]] = None
    split: str = "949,50,1"
    seed: int = 1234
    tokenizer: Optional[Tokenizer] = None
    train_samples: Optional[int] = None
    valid_samples: Optional[int] = None
    test_samples: Optional[int] = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    cache_dir: Optional[str] = None
    index_cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("train_samples", "valid_samples", "test_samples"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        parse_split(self.split)  # validates
        if self.data_path is not None:
            parse_data_path(self.data_path)


def _datasets_for_prefix(prefix: str, config: GPTDataConfig, counts: Sequence[Optional[int]],
                         dataset_config: GPTDatasetConfig) -> List[Optional[GPTDataset]]:
    indexed = IndexedDataset(prefix)
    if config.tokenizer is not None and indexed.dtype == np.uint16 and config.tokenizer.vocab_size > 65536:
        raise ValueError(f"{prefix} holds uint16 tokens but the tokenizer has {config.tokenizer.vocab_size} ids; "
                         "was it preprocessed with another tokenizer?")
    if len(indexed) == 0 and any(count != 0 for count in counts):
        raise ValueError(f"--data-path {prefix} holds 0 documents (0 tokens), so no sample of --seq-length "
                         f"{config.seq_length}; preprocess text into it (tools/preprocess_data.py) or drop it")
    ranges = split_document_ranges(len(indexed), parse_split(config.split))
    datasets: List[Optional[GPTDataset]] = []
    for name, (begin, end), count in zip(SPLIT_NAMES, ranges, counts):
        if name == "train" and count != 0 and end <= begin:
            tokens = int(indexed.sequence_lengths.astype(np.int64).sum())
            raise ValueError(f"--split {config.split} leaves the train split of --data-path {prefix} "
                             f"({len(indexed)} documents, {tokens} tokens) no documents, so no sample of "
                             f"--seq-length {config.seq_length}; give train a larger share or add documents")
        if count == 0 or end <= begin:
            datasets.append(None)
            continue
        datasets.append(GPTDataset(indexed, np.arange(begin, end), count, dataset_config, split_name=name,
                                   cache_dir=config.index_cache_dir))
    return datasets


def build_gpt_datasets(config: GPTDataConfig) -> Tuple[Optional[object], Optional[object], Optional[object]]:
    """Builds the train, valid and test datasets (None where a split is empty or has 0 samples).

    One prefix: ``GPTDataset`` per split. Weighted prefixes: each split is a ``BlendedDataset`` of
    per-prefix ``GPTDataset`` s, each asked for ``samples_per_dataset`` samples (Megatron's 0.5% margin).
    No ``data_path``: the default corpus, built and cached on first use.
    """
    tokenizer = config.tokenizer or ByteTokenizer()
    dataset_config = GPTDatasetConfig(seq_length=config.seq_length, seed=config.seed, eod=tokenizer.eod,
                                      eod_mask_loss=config.eod_mask_loss,
                                      reset_position_ids=config.reset_position_ids)
    counts = (config.train_samples, config.valid_samples, config.test_samples)
    if config.data_path is None:
        prefixes, weights = [default_corpus_prefix(tokenizer, config.cache_dir)], None
    else:
        prefixes, weights = parse_data_path(config.data_path)
    if weights is None and len(prefixes) == 1:
        return tuple(_datasets_for_prefix(prefixes[0], config, counts, dataset_config))
    if weights is None:
        return _unweighted_blend(prefixes, config, counts, dataset_config)
    missing = [n for n, c in zip(SPLIT_NAMES, counts) if c is None]
    if missing:
        raise ValueError(f"blending {len(prefixes)} datasets needs sample counts; set {missing} (e.g. "
                         "train_samples = train_iters * global_batch_size)")
    shares = [samples_per_dataset(weights, c) if c else [0] * len(prefixes) for c in counts]  # [split][dataset]
    per_split = [[None] * len(prefixes) for _ in SPLIT_NAMES]
    for d, prefix in enumerate(prefixes):
        split_counts = [shares[s][d] for s in range(len(SPLIT_NAMES))]
        for s, dataset in enumerate(_datasets_for_prefix(prefix, config, split_counts, dataset_config)):
            per_split[s][d] = dataset
    normalized = normalize_weights(weights)  # megatron-core's builder normalizes; BlendedDataset again
    blends = []
    for name, count, parts in zip(SPLIT_NAMES, counts, per_split):
        if count == 0 or any(p is None for p in parts):
            blends.append(None)
            continue
        size = sum(math.ceil(count * w) for w in normalized)  # megatron-core's size: may exceed count a little
        blends.append(BlendedDataset(parts, normalized, size, cache_dir=config.index_cache_dir
                                     or parts[0].cache_dir, name=name))
    return tuple(blends)


def _unweighted_blend(prefixes: Sequence[str], config: GPTDataConfig, counts: Sequence[Optional[int]],
                      dataset_config: GPTDatasetConfig) -> Tuple[Optional[object], ...]:
    """``--data-path a b`` without weights (Megatron-LM's rule): one epoch of each dataset per split, blended
    with weights equal to their sample counts; a split holds ``min(requested, total)`` samples."""
    per_prefix = [_datasets_for_prefix(p, config, [0 if c == 0 else None for c in counts], dataset_config)
                  for p in prefixes]
    blends = []
    for s, (name, count) in enumerate(zip(SPLIT_NAMES, counts)):
        parts = [datasets[s] for datasets in per_prefix]
        if count == 0 or any(p is None for p in parts):
            blends.append(None)
            continue
        sizes = [len(p) for p in parts]
        if count is None:  # every sample of every dataset once (megatron-core's exhaustive blend)
            blends.append(BlendedDataset(parts, sizes, None, cache_dir=config.index_cache_dir or parts[0].cache_dir,
                                         name=name))
            continue
        blends.append(BlendedDataset(parts, [float(n) for n in sizes], min(count, sum(sizes)),
                                     cache_dir=config.index_cache_dir or parts[0].cache_dir, name=name))
    return tuple(blends)
