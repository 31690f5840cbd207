"""Data: tokenizers, Megatron-compatible indexed datasets, GPT samples, blending, splits and sampling.

Typical use by the training loop::

    from megatron_core.data import GPTDataConfig, build_gpt_datasets, MegatronPretrainingSampler
    train, valid, test = build_gpt_datasets(GPTDataConfig(seq_length=1024, data_path=["my_text_document"],
                                                          train_samples=10_000, valid_samples=100, test_samples=0))
"""
from megatron_core.data.blended_dataset import (
    BlendedDataset,
    build_blending_indices,
    parse_data_path,
    parse_split,
    samples_per_dataset,
    split_document_ranges,
)
from megatron_core.data.builder import GPTDataConfig, build_gpt_datasets
from megatron_core.data.default_corpus import default_cache_dir, default_corpus_prefix
from megatron_core.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_core.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    dtype_code,
    optimal_dtype,
)
from megatron_core.data.mock_dataset import MockGPTDataset, MockIndexedDataset
from megatron_core.data.samplers import MegatronPretrainingSampler
from megatron_core.data.tokenizers import (
    ByteTokenizer,
    GPT2BPETokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
)

__all__ = [
    "BlendedDataset", "build_blending_indices", "parse_data_path", "parse_split", "samples_per_dataset",
    "split_document_ranges", "GPTDataConfig", "build_gpt_datasets", "default_cache_dir", "default_corpus_prefix",
    "GPTDataset", "GPTDatasetConfig", "DTYPE_CODES", "IndexedDataset", "IndexedDatasetBuilder", "dtype_code",
    "optimal_dtype", "MockGPTDataset", "MockIndexedDataset", "MegatronPretrainingSampler", "ByteTokenizer",
    "GPT2BPETokenizer", "NullTokenizer", "SentencePieceTokenizer", "Tokenizer", "build_tokenizer",
]
