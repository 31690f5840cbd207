"""GPTDataset: Megatron's index semantics, determinism, epoch coverage, caching, masks; splits; mock data."""
import os

import numpy as np
import pytest
import torch

from megatron_core.data import (
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    MockGPTDataset,
    parse_split,
    split_document_ranges,
)
from megatron_core.data.gpt_dataset import build_sample_index
from tests.data.conftest import random_documents, write_dataset


def reference_sample_index(sizes, doc_idx, seq_length):
    """A line-by-line Python port of Megatron-LM's C++ ``build_sample_idx`` (extra token, drop last)."""
    num_samples = (int(sizes[doc_idx].sum()) - 1) // seq_length
    rows = [(0, 0)]
    doc_idx_index, doc_offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        rows.append((doc_idx_index, doc_offset))
    return np.array(rows)


@pytest.fixture
def dataset_prefix(tmp_path):
    return write_dataset(str(tmp_path / "corpus_text_document"), random_documents(200, seed=3))


def make(prefix, num_samples=None, seed=1234, seq_length=16, cache_dir=None, documents=None, **kw):
    ds = IndexedDataset(prefix)
    docs = np.arange(len(ds)) if documents is None else documents
    return GPTDataset(ds, docs, num_samples, GPTDatasetConfig(seq_length=seq_length, seed=seed, **kw),
                      cache_dir=cache_dir)


@pytest.mark.parametrize("seq_length", [1, 7, 16, 50])
def test_sample_index_matches_megatron_loop(seq_length):
    rng = np.random.RandomState(seq_length)
    sizes = rng.randint(0, 30, size=60).astype(np.int32)  # includes empty documents
    doc_idx = np.tile(np.arange(60, dtype=np.int32), 3)
    rng.shuffle(doc_idx)
    np.testing.assert_array_equal(build_sample_index(sizes, doc_idx, seq_length),
                                  reference_sample_index(sizes, doc_idx, seq_length))


def test_same_seed_same_order_and_other_seed_differs(dataset_prefix, tmp_path):
    a = make(dataset_prefix, 300, cache_dir=str(tmp_path / "ca"))
    b = make(dataset_prefix, 300, cache_dir=str(tmp_path / "cb"))
    c = make(dataset_prefix, 300, seed=99, cache_dir=str(tmp_path / "cc"))
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert any(not torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(20))


def test_one_epoch_covers_every_token(dataset_prefix):
    docs = random_documents(200, seed=3)
    ds = make(dataset_prefix, num_samples=None, seq_length=16)
    assert sorted(ds.document_index.tolist()) == list(range(200))  # each document once
    stream = np.concatenate([docs[d] for d in ds.document_index])
    seen = np.zeros(len(stream), dtype=bool)
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        np.testing.assert_array_equal(ds.sample_tokens(i), stream[j * 16: j * 16 + 17])
        seen[j * 16: j * 16 + 17] = True
    assert len(ds) == (len(stream) - 1) // 16
    assert seen[: len(ds) * 16 + 1].all()  # all but the < seq_length tokens of the dropped partial sample
    assert len(stream) - seen.sum() < 16


def test_multi_epoch_separate_final_epoch(dataset_prefix):
    one_epoch = len(make(dataset_prefix))
    ds = make(dataset_prefix, num_samples=2 * one_epoch + 3)  # a tiny third epoch -> shuffled apart
    assert len(ds.document_index) == 3 * 200
    assert sorted(ds.document_index[-200:].tolist()) == list(range(200))
    sizes = IndexedDataset(dataset_prefix).sequence_lengths
    np.testing.assert_array_equal(ds.sample_index, reference_sample_index(sizes, ds.document_index, 16))
    first = ((2 * int(sizes.sum())) - 1) // 16
    assert sorted(ds.shuffle_index[:first].tolist()) == list(range(first))
    assert len(ds) == 2 * one_epoch + 3


def test_items_are_megatron_dicts(dataset_prefix):
    item = make(dataset_prefix, 10)[3]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert item["tokens"].dtype == torch.int64 and item["labels"].dtype == torch.int64
    assert item["loss_mask"].dtype == torch.float32 and item["tokens"].shape == (16,)
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    assert torch.equal(item["position_ids"], torch.arange(16))


def test_eod_mask_and_position_reset(tmp_path):
    prefix = write_dataset(str(tmp_path / "e"), [[1, 2, 9], [3, 4, 5, 9], [6, 9]])
    ds = make(prefix, seq_length=8, eod=9, eod_mask_loss=True, reset_position_ids=True)
    item = ds[0]
    eod_at = item["tokens"] == 9
    assert (item["loss_mask"][eod_at] == 0).all() and (item["loss_mask"][~eod_at] == 1).all()
    pos, tok = item["position_ids"].tolist(), item["tokens"].tolist()
    for k in range(1, 8):
        assert pos[k] == (0 if tok[k - 1] == 9 else pos[k - 1] + 1)


def test_index_cache_is_reused(dataset_prefix):
    first = make(dataset_prefix, 100)
    assert first.built_indices
    cache = os.path.join(os.path.dirname(dataset_prefix), "cache", "GPTDataset_indices")
    files = sorted(f for f in os.listdir(cache) if f.endswith(".npy"))
    assert len(files) == 3
    mtimes = [os.stat(os.path.join(cache, f)).st_mtime_ns for f in files]
    second = make(dataset_prefix, 100)
    assert not second.built_indices
    assert [os.stat(os.path.join(cache, f)).st_mtime_ns for f in files] == mtimes
    assert torch.equal(first[5]["tokens"], second[5]["tokens"])
    assert make(dataset_prefix, 101).built_indices  # another config, another key


def test_too_few_tokens(tmp_path):
    prefix = write_dataset(str(tmp_path / "t"), [[1, 2]])
    with pytest.raises(ValueError, match="fewer than seq_length"):
        make(prefix, seq_length=8)


def test_split_ranges_like_megatron():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert split_document_ranges(1000, parse_split("949,50,1")) == [(0, 949), (949, 999), (999, 1000)]
    assert split_document_ranges(10, parse_split("98,2,0")) == [(0, 10), (10, 10), (10, 10)]
    # megatron-core's book-ends: round(7/3) = 2, round(14/3) = 5 (the legacy running sum of rounded shares
    # gave (0, 3), (3, 5), (5, 7))
    assert split_document_ranges(7, parse_split("1,1,1")) == [(0, 2), (2, 5), (5, 7)]
    assert split_document_ranges(230, parse_split("90,5,5")) == [(0, 207), (207, 219), (219, 230)]  # 0.9 + 0.05 > 0.95
    assert parse_split("100") == [1.0, 0.0, 0.0]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


def test_mock_dataset_is_deterministic():
    a, b = MockGPTDataset(50, 32, seed=7), MockGPTDataset(50, 32, seed=7)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(50))
    assert len(a) == 50 and a[0]["tokens"].shape == (32,)
    assert not torch.equal(a[0]["tokens"], MockGPTDataset(50, 32, seed=8)[0]["tokens"])
