"""The built-in default corpus: standard-library sources, tokenized once and cached."""
import os

from megatron_core.data import ByteTokenizer, GPTDataConfig, IndexedDataset, build_gpt_datasets, default_corpus_prefix
from megatron_core.data.default_corpus import gather_documents, stdlib_source_files


def test_default_corpus_builds_once_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_CORE_CACHE", str(tmp_path))
    prefix = default_corpus_prefix(max_bytes=200_000)
    assert prefix.startswith(str(tmp_path))
    ds = IndexedDataset(prefix)
    docs = gather_documents(200_000)
    assert len(ds) == len(docs) and ds.sequence_lengths.sum() >= 200_000
    tok = ByteTokenizer()
    assert ds[0][-1] == tok.eod and tok.decode(ds[0][:-1]) == docs[0]
    mtime = os.stat(prefix + ".bin").st_mtime_ns
    assert default_corpus_prefix(max_bytes=200_000) == prefix
    assert os.stat(prefix + ".bin").st_mtime_ns == mtime  # reused, not rebuilt
    assert default_corpus_prefix(max_bytes=100_000) != prefix  # another configuration, another file


def test_stdlib_sources_exclude_tests_and_site_packages():
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 100
    assert not any(f"{os.sep}site-packages{os.sep}" in f or f"{os.sep}test{os.sep}" in f for f in files)


def test_build_gpt_datasets_without_data_path_uses_default_corpus(tmp_path):
    config = GPTDataConfig(seq_length=64, data_path=None, cache_dir=str(tmp_path), train_samples=500,
                           valid_samples=20, test_samples=0)
    train, valid, test = build_gpt_datasets(config)
    assert len(train) == 500 and len(valid) == 20 and test is None
    assert train[0]["tokens"].shape == (64,) and int(train[0]["tokens"].max()) <= 256
