"""A catalogue of bad inputs to pretrain_gpt.py and the tools: each exits non-zero with one clear paragraph
naming the value (never a hang, a traceback from inside torch, or a modified checkpoint)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.integration.test_reliability import TINY, _files_digest, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAG_CASES = {
    "negative layers": (["--num-layers", "-1"], "num_layers must be >= 1, got -1"),
    "zero hidden size": (["--hidden-size", "0"], "hidden_size must be >= 1, got 0"),
    "heads not dividing hidden": (["--num-attention-heads", "3"],
                                  "hidden_size 32 is not divisible by num_attention_heads 3"),
    "tp larger than the world": (["--tensor-model-parallel-size", "2"],
                                 "world_size 1 is not divisible by tensor_model_parallel_size 2"),
    "zero tp": (["--tensor-model-parallel-size", "0"], "tensor_model_parallel_size must be >= 1, got 0"),
    "pp larger than layers": (["--pipeline-model-parallel-size", "8"],
                              "num_layers 2 is not divisible by pipeline_model_parallel_size 8"),
    "vpp without pp": (["--num-layers-per-virtual-pipeline-stage", "1"], "needs --pipeline-model-parallel-size > 1"),
    "zero bubble without pp": (["--enable-zero-bubble"],
                               "--enable-zero-bubble needs --pipeline-model-parallel-size > 1"),
    "zero bubble split without zero bubble": (["--zero-bubble-defer", "all"],
                                              "--zero-bubble-defer all needs --enable-zero-bubble"),
    "zero bubble with ZeRO-3": (["--enable-zero-bubble", "--pipeline-model-parallel-size", "2", "--zero-stage", "3"],
                                "--enable-zero-bubble cannot run with ZeRO-3"),
    "bf16 and fp16": (["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive"),
    "micro batch not dividing global batch": (["--micro-batch-size", "3", "--global-batch-size", "4"],
                                              "--global-batch-size 4 is not divisible by --micro-batch-size 3"),
    "zero micro batch": (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    "zero sequence length": (["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    "zero train iters": (["--train-iters", "0"], "--train-iters must be >= 1, got 0"),
    "query groups without GQA flag": (["--num-query-groups", "2"],
                                      "--num-query-groups 2 needs --group-query-attention"),
    "query groups not dividing heads": (["--group-query-attention", "--num-query-groups", "3"],
                                        "num_query_groups 3 does not divide num_attention_heads 4"),
    "full recompute without method": (["--recompute-granularity", "full"],
                                      "recompute_granularity='full' needs recompute_method"),
    "recompute method alone": (["--recompute-method", "uniform"], "only apply to recompute_granularity='full'"),
    "retain interval below 1": (["--save-retain-interval", "0"], "--save-retain-interval must be >= 1, got 0"),
    "min lr above lr": (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1.0 is larger than --lr 0.1"),
    "warmup longer than decay": (["--lr-warmup-iters", "50", "--train-iters", "10"],
                                 "--lr-warmup-iters 50 is larger than --lr-decay-iters 10"),
    "conflicting ZeRO flags": (["--zero-stage", "1", "--data-parallel-sharding-strategy", "optim_grads"], "disagree"),
    "ZeRO stage 4": (["--zero-stage", "4"], "invalid choice: 4"),
    "unknown position embedding": (["--position-embedding-type", "alibi"], "invalid choice: 'alibi'"),
    "misspelt flag": (["--tensor-model-paralel-size", "2"], "did you mean --tensor-model-parallel-size?"),
    "dropout of 1.5": (["--hidden-dropout", "1.5"], "hidden_dropout must lie in [0, 1), got 1.5"),
    "sequence longer than positions": (["--max-position-embeddings", "16"],
                                       "--seq-length 32 is longer than --max-position-embeddings 16"),
    "unknown tokenizer": (["--tokenizer-type", "NoSuchTokenizer"], "unknown tokenizer type 'NoSuchTokenizer'"),
    "sentencepiece without a model": (["--tokenizer-type", "SentencePieceTokenizer"], "tokenizer"),
    "missing data prefix": (["--data-path", "/nonexistent/corpus_text_document"], "/nonexistent/corpus_text_document"),
}


@pytest.mark.parametrize("name", list(FLAG_CASES))
def test_bad_flag(distributed, name):
    argv, fragment = FLAG_CASES[name]
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "2", *argv])[0]
    assert status == 2, err
    assert fragment in err, err
    assert "Traceback" not in err


def _train_capturing_stdout(argv):
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status, err = run_main(argv)
    return status, err, out.getvalue()


def test_load_from_a_folder_without_a_checkpoint(distributed, tmp_path):
    """A --load folder that holds data but no checkpoint (Megatron-LM's CI points --load at its data folder)
    warns and starts from scratch, as Megatron does; --exit-on-missing-checkpoint exits 2 instead; a damaged
    checkpoint (the pointer names a folder that is gone) still stops the run naming it."""
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "text_document.bin").write_bytes(b"\0" * 16)
    status, err, out = distributed(1, _train_capturing_stdout, [*TINY, "--train-iters", "2", "--load",
                                                                str(tmp_path)])[0]
    assert status == 0, err
    assert f"WARNING: no checkpoint to load in {tmp_path}" in out and "starting from scratch" in out
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "2", "--load", str(tmp_path),
                                            "--exit-on-missing-checkpoint"])[0]
    assert status == 2 and f"--exit-on-missing-checkpoint: no checkpoint in {tmp_path}" in err, err
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "2", "--load", str(tmp_path)])[0]
    assert status == 2 and "iter_0000007" in err and "Traceback" not in err, err


def test_world_size_not_matching_the_layout(distributed):
    status, err = distributed(2, run_main,
                              [*TINY, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])[0]
    assert status == 2 and ("world_size 2 is not divisible by tensor_model_parallel_size 2 x "
                            "pipeline_model_parallel_size 2") in err


def _write_dataset(prefix, tokens):
    from megatron_core.data import IndexedDatasetBuilder
    with IndexedDatasetBuilder(prefix, dtype=np.int32) as builder:
        for start in range(0, len(tokens), 50):
            builder.add_document(tokens[start:start + 50])


def test_corrupt_idx_is_named(distributed, tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    _write_dataset(prefix, list(range(200)) * 10)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTMMIDX")
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "2", "--data-path", prefix])[0]
    assert status == 2 and "corpus_text_document.idx" in err and "Traceback" not in err


def test_tokenizer_vocab_mismatch_with_the_data(distributed, tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    _write_dataset(prefix, [900 + (i % 99) for i in range(4000)])  # ids of a 1000-token vocab
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "2", "--data-path", prefix])[0]  # bytes: 257
    assert status == 2 and "token ids must lie in [0, 384), got values in" in err
    assert "check the tokenizer's vocab size" in err


def _checkpoint(distributed, directory):
    distributed(1, run_main, [*TINY, "--train-iters", "2", "--save", str(directory)])
    return _files_digest(str(directory))


def test_checkpoint_of_another_model_shape(distributed, tmp_path):
    before = _checkpoint(distributed, tmp_path)
    status, err = distributed(1, run_main,
                              [*TINY, "--hidden-size", "64", "--train-iters", "4", "--load", str(tmp_path)])[0]
    assert status == 2 and "--hidden-size: 32 in the checkpoint, 64 in this run" in err
    assert _files_digest(str(tmp_path)) == before


def test_checkpoint_with_a_missing_shard(distributed, tmp_path):
    _checkpoint(distributed, tmp_path)
    os.remove(tmp_path / "iter_0000002" / "model_tp00_pp000.safetensors")
    before = _files_digest(str(tmp_path))
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "4", "--load", str(tmp_path)])[0]
    assert status == 2 and "model_tp00_pp000.safetensors is missing" in err
    assert _files_digest(str(tmp_path)) == before


def test_checkpoint_with_corrupt_metadata(distributed, tmp_path):
    _checkpoint(distributed, tmp_path)
    (tmp_path / "iter_0000002" / "metadata.json").write_text("{not json")
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "4", "--load", str(tmp_path)])[0]
    assert status == 2 and "metadata.json is corrupt" in err


def test_jsonl_with_a_bad_line(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "good"}) + "\n{broken\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(data),
                           "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "ByteTokenizer"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "docs.jsonl:2" in proc.stderr and "Traceback" not in proc.stderr
