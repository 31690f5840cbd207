"""Blending (Megatron's greedy interleave), --data-path parsing, the resumable pretraining sampler."""
import numpy as np
import pytest
import torch

from megatron_core.data import (
    BlendedDataset,
    GPTDataConfig,
    MegatronPretrainingSampler,
    MockGPTDataset,
    NullTokenizer,
    build_blending_indices,
    build_gpt_datasets,
    parse_data_path,
    samples_per_dataset,
)
from tests.data.conftest import random_documents, write_dataset


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="weight-prefix pairs"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ValueError, match="'a' .* is not a number"):
        parse_data_path(["a", "0.3", "b", "0.7"])
    with pytest.raises(ValueError, match=">= 0"):
        parse_data_path(["-1", "a", "2", "b"])


@pytest.mark.parametrize("weights", [[0.3, 0.7], [2, 3, 5], [1, 1, 1, 7]])
def test_blending_proportions_within_one_percent(weights):
    size = 10_000
    mocks = [MockGPTDataset(n, 8, seed=i, num_documents=50) for i, n in
             enumerate(samples_per_dataset(weights, size))]
    blend = BlendedDataset(mocks, weights, size)
    counts = np.bincount(blend.dataset_index, minlength=len(weights)) / size
    np.testing.assert_allclose(counts, np.array(weights) / sum(weights), atol=0.01)
    for d in range(len(weights)):  # each dataset is read in order 0, 1, 2, ...
        taken = blend.dataset_sample_index[blend.dataset_index == d]
        np.testing.assert_array_equal(taken, np.arange(len(taken)))
    item = blend[17]
    d = int(blend.dataset_index[17])
    assert int(item["dataset_id"]) == d
    assert torch.equal(item["tokens"], mocks[d][int(blend.dataset_sample_index[17])]["tokens"])


def test_blending_indices_match_megatron_greedy_rule():
    index, sample = build_blending_indices([0.5, 0.25, 0.25], 8)
    assert index.tolist() == [0, 1, 2, 0, 0, 1, 2, 0]
    assert sample.tolist() == [0, 0, 0, 1, 2, 1, 1, 3]


def test_blend_rejects_short_dataset():
    with pytest.raises(ValueError, match="needs .* samples from dataset 1"):
        BlendedDataset([MockGPTDataset(100, 8), MockGPTDataset(10, 8)], [0.5, 0.5], 100)


def test_build_gpt_datasets_blends_prefixes(tmp_path):
    a = write_dataset(str(tmp_path / "a_text_document"), random_documents(300, seed=1, vocab=50))
    b = write_dataset(str(tmp_path / "b_text_document"), [[d + 60 for d in doc] for doc in
                                                           random_documents(300, seed=2, vocab=40)])
    config = GPTDataConfig(seq_length=8, data_path=["0.3", a, "0.7", b], split="90,10,0", seed=5,
                           tokenizer=NullTokenizer(127), train_samples=2000, valid_samples=100, test_samples=0)
    train, valid, test = build_gpt_datasets(config)
    assert test is None and len(train) == 2000 and len(valid) == 100
    from_b = np.mean([bool((train[i]["tokens"] >= 60).all()) for i in range(2000)])
    assert abs(from_b - 0.7) < 0.01
    again, _, _ = build_gpt_datasets(config)
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, 2000, 97))


def stream(sampler):
    return [list(batch) for batch in sampler]


def test_sampler_splits_global_batches_across_ranks():
    batches = [stream(MegatronPretrainingSampler(20, 0, 2, rank, 3)) for rank in range(3)]
    assert batches[0][:2] == [[0, 1], [6, 7]] and batches[2][:2] == [[4, 5], [10, 11]]
    assert all(len(b) == 3 for b in batches)  # 20 // 6 full global batches, remainder dropped
    last = stream(MegatronPretrainingSampler(20, 0, 2, 0, 3, drop_last=False))[-1]
    assert last == [18, 19]


def test_sampler_resume_continues_the_same_stream():
    full = stream(MegatronPretrainingSampler(1000, 0, 4, 1, 2))
    consumed = 7 * 4 * 2  # seven global batches done before the checkpoint
    resumed = stream(MegatronPretrainingSampler(1000, consumed, 4, 1, 2))
    assert resumed == full[7:]


@pytest.mark.parametrize("args, match", [
    ((0, 0, 1, 0, 1), "total_samples"), ((10, 10, 1, 0, 1), "consumed_samples"),
    ((10, 0, 0, 0, 1), "micro_batch_size"), ((10, 0, 1, 2, 2), "data_parallel_rank"),
])
def test_sampler_errors(args, match):
    with pytest.raises(ValueError, match=match):
        MegatronPretrainingSampler(*args)
