"""Same samples in the same order as megatron-core 0.16.1's GPTDataset / BlendedDataset.

Both sides read the same ``.bin/.idx`` files. megatron-core's datasets are built by its
``BlendedMegatronDatasetBuilder`` (with its compiled index helpers) and ours by the training loop's
``build_datasets`` for the same ``--data-path``, ``--split``, ``--seq-length``, ``--seed`` and global batch
(sample counts from Megatron-LM's ``train_val_test_num_samples`` formula). Every item's tokens, labels, loss
mask and position ids must be equal, over several epochs, with eod-terminated documents of random lengths.
"""
import warnings

import numpy as np
import pytest
import torch

from megatron_core.data import GPTDataConfig, IndexedDatasetBuilder, NullTokenizer, build_gpt_datasets
from megatron_core.training.arguments import parse_args
from megatron_core.training.data import build_datasets

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mcore_builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    mcore_gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    mcore_utils = pytest.importorskip("megatron.core.datasets.utils")

VOCAB = 99  # NullTokenizer(99): ids 0..98, eod 99
KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class _MegatronTokenizer:
    """What megatron-core's GPTDataset reads from a tokenizer: eod, vocab_size, its cache-key identity."""

    def __init__(self) -> None:
        self.eod, self.vocab_size = VOCAB, VOCAB + 1
        self.unique_identifiers = {"class": "NullTokenizer", "vocab_size": VOCAB}


def _write(prefix: str, num_documents: int, seed: int) -> str:
    """Documents of 1-30 random tokens, each ending in eod (as preprocess_data --append-eod writes)."""
    rng = np.random.RandomState(seed)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(num_documents):
            builder.add_document(rng.randint(0, VOCAB, size=int(rng.randint(1, 31))).tolist() + [VOCAB])
    return prefix


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("megatron_order")
    # 600 documents: the 969,30,1 split leaves test 1 document (megatron-core hangs on an empty split)
    return _write(str(folder / "a_text_document"), 600, 0), _write(str(folder / "b_text_document"), 230, 1)


def _megatron_datasets(data_path, split, seq_length, seed, sizes, *, eod_mask_loss=False,
                       reset_position_ids=False):
    config = mcore_gpt.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=mcore_utils.get_blend_from_list(data_path),
        split=split, tokenizer=_MegatronTokenizer(), reset_position_ids=reset_position_ids,
        reset_attention_mask=False, eod_mask_loss=eod_mask_loss, create_attention_mask=False,
        path_to_cache=None)  # its BlendedDataset caches only under torch.distributed; its GPTDataset caches
    # beside the data (the module's own tmp folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mcore_builder.BlendedMegatronDatasetBuilder(mcore_gpt.GPTDataset, sizes, lambda: True, config).build()


def _megatron_lm_counts(train_iters: int, eval_interval: int, eval_iters: int, global_batch: int):
    """Megatron-LM's train_val_test_num_samples (megatron/training/training.py)."""
    return [train_iters * global_batch, (train_iters // eval_interval + 1) * eval_iters * global_batch,
            eval_iters * global_batch]


def _assert_same(theirs, ours, name: str) -> None:
    if theirs is None or len(theirs) == 0:
        assert ours is None, f"{name}: megatron-core has no dataset, we have {len(ours)} samples"
        return
    assert ours is not None, f"{name}: megatron-core has {len(theirs)} samples, we have no dataset"
    # megatron-core's GPTDataset is as long as all samples of the epochs it built, ours as the samples asked
    # for (what a run reads); its BlendedDataset and ours have the same length
    count = len(ours) if hasattr(ours, "shuffle_index") else len(theirs)
    assert len(ours) == count <= len(theirs), (name, len(theirs), len(ours))
    for i in range(count):
        a, b = theirs[i], ours[i]
        for key in KEYS:
            assert torch.equal(a[key].to(b[key].dtype), b[key]), f"{name} sample {i}: {key} differs"
        if "dataset_id" in a:
            assert int(a["dataset_id"]) == int(b["dataset_id"]), f"{name} sample {i}: dataset_id differs"


def _run_args(data_path, split, seq_length, seed, train_iters, eval_interval, eval_iters, cache, eod=False):
    """The data flags of ``pretrain_gpt.py`` (parsed by its own parser)."""
    argv = ["--data-path", *data_path, "--split", split, "--seq-length", str(seq_length), "--seed", str(seed),
            "--train-iters", str(train_iters), "--eval-interval", str(eval_interval), "--eval-iters",
            str(eval_iters), "--data-cache-path", cache] + (["--eod-mask-loss", "--reset-position-ids"] if eod else [])
    return parse_args(argv)


@pytest.mark.parametrize("blend", ["one", "weighted", "unweighted"])
def test_run_datasets_match_megatron_core(prefixes, tmp_path, blend):
    """Train/valid/test of a run, one prefix or a blend, several epochs (train and valid), as megatron-core."""
    a, b = prefixes
    data_path, split = {"one": ([a], "969,30,1"), "weighted": (["0.3", a, "0.7", b], "90,5,5"),
                        "unweighted": ([a, b], "90,5,5")}[blend]
    # a holds ~1150 samples of 8 tokens per epoch, b ~390: 2500 train samples are 3 epochs of a (the last
    # epoch shuffled apart, under 80% used) and 2+ epochs of b in the weighted blend
    train_iters, eval_interval, eval_iters, global_batch, seq_length, seed = 250, 100, 2, 10, 8, 1234
    counts = _megatron_lm_counts(train_iters, eval_interval, eval_iters, global_batch)
    theirs = _megatron_datasets(data_path, split, seq_length, seed, counts)
    args = _run_args(data_path, split, seq_length, seed, train_iters, eval_interval, eval_iters,
                     str(tmp_path / "ours"))
    ours = build_datasets(args, NullTokenizer(VOCAB), global_batch)
    for name, t, o in zip(("train", "valid", "test"), theirs, ours):
        _assert_same(t, o, f"{blend} {name}")
    if blend == "one":
        assert max(theirs[0].document_index.shape[0] // 581, 1) == 3  # three epochs of the 581 train documents


def test_eod_mask_loss_and_reset_position_ids_match(prefixes, tmp_path):
    """--eod-mask-loss and --reset-position-ids give megatron-core's loss mask and positions."""
    a, _ = prefixes
    counts = _megatron_lm_counts(30, 100, 2, 10)
    theirs = _megatron_datasets([a], "1,1,1", 16, 7, counts, eod_mask_loss=True, reset_position_ids=True)
    args = _run_args([a], "1,1,1", 16, 7, 30, 100, 2, str(tmp_path / "ours"), eod=True)
    ours = build_datasets(args, NullTokenizer(VOCAB), 10)
    assert float(ours[0][0]["loss_mask"].min()) == 0.0 and int(ours[0][0]["position_ids"][-1]) < 15
    for name, t, o in zip(("train", "valid", "test"), theirs, ours):
        _assert_same(t, o, f"eod {name}")


def test_unweighted_blend_without_sizes_is_exhaustive_as_megatron_core(prefixes, tmp_path):
    """``--data-path a b`` with no sample counts: every sample of each dataset once, megatron-core's order."""
    a, b = prefixes
    theirs = _megatron_datasets([a, b], "90,5,5", 8, 3, [None, None, None])
    ours = build_gpt_datasets(GPTDataConfig(seq_length=8, data_path=[a, b], split="90,5,5", seed=3,
                                            tokenizer=NullTokenizer(VOCAB), index_cache_dir=str(tmp_path / "ours")))
    for name, t, o in zip(("train", "valid", "test"), theirs, ours):
        _assert_same(t, o, f"exhaustive {name}")
        np.testing.assert_array_equal(np.asarray(t.dataset_index), o.dataset_index)
