"""Synthetic, deterministic data for tests: no files, same tokens for the same seed on every machine."""
from typing import Optional

import numpy as np

from megatron_core.data.gpt_dataset import GPTDataset, GPTDatasetConfig


class MockIndexedDataset:
    """In-memory stand-in for ``IndexedDataset``: documents of seeded random lengths.

    Document ``d`` holds ``(d * 7919 + j) % (vocab_size - 1)`` for ``j < length - 1`` followed by eod
    (``vocab_size - 1``), so every token is known without storing anything per token.

    Args:
        num_documents: how many documents.
        vocab_size: ids are below this; the last id is eod.
        seed: seed of the document lengths.
        mean_length: average document length in tokens.
    """

    def __init__(self, num_documents: int = 1000, vocab_size: int = 1024, seed: int = 0,
                 mean_length: int = 64) -> None:
        if num_documents <= 0 or vocab_size < 2 or mean_length < 1:
            raise ValueError(f"MockIndexedDataset needs num_documents > 0, vocab_size >= 2 and mean_length >= 1, "
                             f"got {num_documents}, {vocab_size}, {mean_length}")
        rng = np.random.RandomState(seed)
        self.vocab_size, self.eod = vocab_size, vocab_size - 1
        self.sequence_lengths = rng.randint(1, 2 * mean_length, size=num_documents).astype(np.int32)
        self.document_indices = np.arange(num_documents + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx``."""
        seq_len = int(self.sequence_lengths[idx])
        length = seq_len - offset if length is None else length
        positions = np.arange(offset, offset + length, dtype=np.int64)
        tokens = (idx * 7919 + positions) % (self.vocab_size - 1)
        tokens[positions == seq_len - 1] = self.eod
        return tokens

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)


class MockGPTDataset(GPTDataset):
    """``GPTDataset`` over a ``MockIndexedDataset`` (indices built in memory, never cached).

    Args:
        num_samples: samples wanted (None: one epoch).
        seq_length: tokens per sample.
        seed: seed of the shuffles and of the mock document lengths.
        num_documents: documents in the mock corpus.
        vocab_size: vocabulary size (eod = vocab_size - 1).
    """

    def __init__(self, num_samples: Optional[int], seq_length: int, *, seed: int = 1234,
                 num_documents: int = 1000, vocab_size: int = 1024) -> None:
        data = MockIndexedDataset(num_documents, vocab_size, seed)
        config = GPTDatasetConfig(seq_length=seq_length, seed=seed, eod=data.eod)
        super().__init__(data, np.arange(num_documents), num_samples, config, split_name="mock")
