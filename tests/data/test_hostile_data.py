"""Hostile data files: corrupt cached indices, empty document sets and bad batch flags end in one ValueError
naming the file or flag and the fix (``pretrain_gpt.py: error: ...``, exit 2), never an IndexError from inside
a sample lookup or a silently wrong sample."""
import glob
import os

import numpy as np
import pytest

from megatron_core.data import (
    BlendedDataset,
    GPTDataConfig,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    build_gpt_datasets,
)
from tests.data.conftest import REPO, write_dataset
from tests.fork_server import run_python
from tests.integration.test_reliability import TINY

SEQ = 8


def _docs(num_documents: int, length: int = 20):
    return [[(7 * d + j) % 250 for j in range(length)] for d in range(num_documents)]


@pytest.fixture
def prefix(tmp_path):
    return write_dataset(str(tmp_path / "corpus_text_document"), _docs(30))


def _dataset(prefix, num_samples=100):
    indexed = IndexedDataset(prefix)
    return GPTDataset(indexed, np.arange(len(indexed)), num_samples, GPTDatasetConfig(seq_length=SEQ))


def _cache_file(prefix, name):
    (path,) = glob.glob(os.path.join(os.path.dirname(prefix), "cache", "GPTDataset_indices", f"*-{name}.npy"))
    return path


def _cached(prefix, name):
    """(path, writable copy) of a cached index after a first build wrote it."""
    built = _dataset(prefix)
    assert built.built_indices
    path = _cache_file(prefix, name)
    return path, np.load(path).copy()


def _assert_names(error, path, fragment):
    message = str(error.value)
    assert path in message and fragment in message, message
    assert f"delete the cache folder {os.path.dirname(path)} to rebuild it" in message, message


def test_shuffle_index_sample_id_out_of_range(prefix):
    path, shuffle = _cached(prefix, "shuffle_index")
    shuffle[3] = 99999
    np.save(path, shuffle)
    with pytest.raises(ValueError) as error:
        _dataset(prefix)
    _assert_names(error, path, f"sample id 99999 at position 3 out of range [0, {len(shuffle)})")


def test_document_index_id_out_of_range(prefix):
    path, documents = _cached(prefix, "document_index")
    documents[-1] = -5
    np.save(path, documents)
    with pytest.raises(ValueError) as error:
        _dataset(prefix)
    _assert_names(error, path, "document id -5")


def test_sample_index_offset_past_its_document(prefix):
    path, rows = _cached(prefix, "sample_index")
    rows[4, 1] = 20  # every document holds 20 tokens: offsets lie in [0, 20)
    np.save(path, rows)
    with pytest.raises(ValueError) as error:
        _dataset(prefix)
    _assert_names(error, path, "token offset 20 at position 4 out of range [0, 20)")


def test_sample_index_out_of_order(prefix):
    path, rows = _cached(prefix, "sample_index")
    rows[5] = rows[2]
    np.save(path, rows)
    with pytest.raises(ValueError) as error:
        _dataset(prefix)
    _assert_names(error, path, "sample row 5")


@pytest.mark.parametrize("name", ["document_index", "sample_index", "shuffle_index"])
def test_wrong_dtype(prefix, name):
    path, array = _cached(prefix, name)
    np.save(path, array.astype(np.float64))
    with pytest.raises(ValueError) as error:
        _dataset(prefix)
    _assert_names(error, path, "dtype float64 is not an integer type")


@pytest.mark.parametrize("name", ["document_index", "sample_index", "shuffle_index"])
def test_wrong_shape(prefix, name):
    path, array = _cached(prefix, name)
    np.save(path, array.reshape(-1)[:-2])
    with pytest.raises(ValueError) as error:
        _dataset(prefix)
    _assert_names(error, path, "expected (")


@pytest.mark.parametrize("damage", ["truncated", "empty", "object array"])
def test_file_numpy_refuses(prefix, damage):
    path, array = _cached(prefix, "sample_index")
    if damage == "truncated":
        data = open(path, "rb").read()
        open(path, "wb").write(data[:-16])
    elif damage == "empty":
        open(path, "wb").close()
    else:
        np.save(path, np.array([{"row": 1}, 2], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError) as error:
        _dataset(prefix)
    _assert_names(error, path, "numpy cannot load it")


def test_intact_cache_loads(prefix):
    first = _dataset(prefix)
    second = _dataset(prefix)
    assert not second.built_indices
    assert np.array_equal(first.sample_tokens(7), second.sample_tokens(7))


def _blend(folder, sizes=(30, 20)):
    datasets = [[{"n": i} for i in range(n)] for n in sizes]
    return BlendedDataset(datasets, [0.6, 0.4], 40, cache_dir=str(folder), name="train")


@pytest.mark.parametrize("case", ["dataset id", "sample id", "length"])
def test_blended_cache(tmp_path, case):
    _blend(tmp_path)
    name = "dataset_index" if case == "dataset id" else "dataset_sample_index"
    (path,) = glob.glob(str(tmp_path / f"*-{name}.npy"))
    array = np.load(path).copy()
    if case == "dataset id":
        array[6] = 2
        fragment = "dataset id 2 at position 6 out of range [0, 2)"
    elif case == "sample id":
        array[0] = 99999  # sample 0 comes from dataset 0, of 30 samples
        fragment = "sample id 99999 at position 0 out of range [0, 30)"
    else:
        array = array[:-1]
        fragment = "shape (39,), expected (40,)"
    np.save(path, array)
    with pytest.raises(ValueError) as error:
        _blend(tmp_path)
    _assert_names(error, path, fragment)


def test_empty_document_set_is_named(tmp_path):
    empty = write_dataset(str(tmp_path / "empty_text_document"), [])
    config = GPTDataConfig(seq_length=SEQ, data_path=[empty], train_samples=8, valid_samples=0, test_samples=0)
    with pytest.raises(ValueError, match=f"--data-path {empty} holds 0 documents .* --seq-length {SEQ}"):
        build_gpt_datasets(config)


def test_too_few_tokens_names_the_counts(tmp_path):
    short = write_dataset(str(tmp_path / "short_text_document"), [[1, 2, 3]] * 2)
    config = GPTDataConfig(seq_length=SEQ, data_path=[short], split="1,0,0", train_samples=8)
    with pytest.raises(ValueError, match=f"{short} \\(2 documents, 6 tokens\\) holds no sample of --seq-length 8"):
        build_gpt_datasets(config)


def test_split_leaving_train_no_documents(prefix):
    config = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="0,50,50", train_samples=8)
    with pytest.raises(ValueError, match="--split 0,50,50 leaves the train split of --data-path .* no documents"):
        build_gpt_datasets(config)


@pytest.mark.parametrize("value", ["0", "-4"])
def test_global_batch_size_below_one(capsys, value):
    from megatron_core.training.arguments import parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--global-batch-size", value])
    assert exit_info.value.code == 2
    assert f"--global-batch-size must be >= 1, got {value}" in capsys.readouterr().err


def _pretrain(*flags):
    """pretrain_gpt.py in a process of its own from the repository root (``tests.fork_server``): (exit status,
    stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_python(["pretrain_gpt.py", *TINY, "--train-iters", "2", *flags], cwd=REPO, env=env, timeout=300)
    return proc.returncode, proc.stderr


def _run_cache(prefix):
    """Writes the index cache a ``_pretrain("--data-path", prefix)`` run loads (the run's own data path)."""
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.data import build_datasets, build_run_tokenizer
    args = parse_args([*TINY, "--train-iters", "2", "--data-path", prefix])
    train, _, _ = build_datasets(args, build_run_tokenizer(args), args.global_batch_size)
    assert train.built_indices
    return train


def test_entry_point_names_a_corrupt_cached_sample_id(tmp_path):
    prefix = write_dataset(str(tmp_path / "corpus_text_document"), _docs(40, 50))
    train = _run_cache(prefix)
    (path,) = glob.glob(os.path.join(train.cache_dir, "*-train-shuffle_index.npy"))
    shuffle = np.load(path).copy()
    shuffle[0] = 99999
    np.save(path, shuffle)
    status, err = _pretrain("--data-path", prefix)
    assert status == 2, err
    assert "Traceback" not in err, err
    assert f"pretrain_gpt.py: error: cached index {path} is corrupt: sample id 99999" in err, err
    assert "delete the cache folder" in err, err


def test_entry_point_names_an_empty_document_set(tmp_path):
    empty = write_dataset(str(tmp_path / "empty_text_document"), [])
    status, err = _pretrain("--data-path", empty)
    assert status == 2, err
    assert "Traceback" not in err, err
    assert f"--data-path {empty} holds 0 documents (0 tokens), so no sample of --seq-length 32" in err, err


def test_entry_point_names_a_negative_global_batch_size():
    status, err = _pretrain("--global-batch-size", "-4")
    assert status == 2, err
    assert "Traceback" not in err, err
    assert "--global-batch-size must be >= 1, got -4" in err, err
