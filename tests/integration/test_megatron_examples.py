"""Megatron-LM's own example scripts, flag for flag, through pretrain_gpt.py (issue 15).

The flag sets are rebuilt from Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh, examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh,
examples/mixtral/train_mixtral_8x7b_distributed.sh and examples/gptoss/02_train.sh: only sizes, paths and
lengths are shrunk (3 iterations, CPU, gloo, 1 or 2 processes), and the fp8 flags are left out of the runs
(they are refused on their own below). gpt3, llama (mock and real data) and megatron_fsdp llama train;
their fp8 flags run FP8 (emulated on CPU); fp4 exits 2 with one paragraph naming it (the gpt-oss and
DeepSeek-V3 flag sets train in test_megatron_frontier_examples.py).
"""
import json
import os
import re

import pytest

from tests.integration.test_reliability import run_main
from tests.recipe import RECIPE

CORPUS = ["The quick brown fox jumps over the lazy dog. " * 4, "Megatron users switch without edits. " * 5,
          "Pipeline, tensor and data parallelism on a CPU with gloo. " * 3] * 20


def _tiny_model(kind: str) -> list:
    if kind == "gpt3":
        return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
                "--max-position-embeddings", "32"]
    return ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8", "--seq-length", "32",
            "--max-position-embeddings", "32"]


def gpt3_flags(ckpt, tb, vocab, merges, data) -> list:
    """examples/gpt3/train_gpt3_175b_distributed.sh (tp 8 x pp 16 -> pp 2; batch schedule in tokens of 32)."""
    return [*_tiny_model("gpt3"), "--attention-backend", "auto",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--step-batch-size-schedule", "0:2 64:4",
            "--train-iters", "3", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
            "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
            "--lr-decay-iters", "430000",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
            "--data-path", data, "--vocab-file", vocab, "--merge-file", merges, "--split", "949,50,1",
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--save", ckpt,
            "--load", ckpt, "--eval-iters", "1", "--tensorboard-dir", tb]


LLAMA_MODEL = ["--use-mcore-models", *_tiny_model("llama"), "--position-embedding-type", "rope",
               "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
               "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134",
               "--attention-backend", "fused", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
               "--disable-bias-linear"]
LLAMA_TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "12",
                  "--lr-decay-samples", "12", "--lr-warmup-samples", "4", "--lr", "0.00015", "--min-lr", "0.00001",
                  "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
                  "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                  "--bf16", "--cross-entropy-loss-fusion", "--manual-gc", "--empty-unused-memory-level", "1",
                  "--exit-duration-in-mins", "235"]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
       "--fp8-param-gather"]
DDP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def mock_data_flags(cache) -> list:
    # bash passes the inner quotes of "--split '99,1,0'" through literally
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--data-cache-path", cache,
            "--tiktoken-pattern", "v2", "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files", "--num-workers", "1"]


def llama_flags(ckpt, tb, data_flags) -> list:
    """examples/llama/train_llama3_8b_h100_fp8.sh, its fp8 flags included (emulated here)."""
    return [*LLAMA_MODEL, *LLAMA_TRAINING, *FP8, "--grad-reduce-in-bf16", "--calculate-per-token-loss", *DDP,
            "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel", *data_flags,
            "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "3", "--save-interval", "1000",
            "--log-throughput", "--profile", "--profile-step-start", "1", "--profile-step-end", "2",
            "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", ckpt, "--load", ckpt,
            "--tensorboard-dir", tb]


def fsdp_llama_flags(ckpt, tb, cache) -> list:
    """examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh (USE_MEGATRON_FSDP=1), its fp8 flags included."""
    return [*LLAMA_MODEL, *LLAMA_TRAINING, *FP8, "--no-check-for-nan-in-loss-and-grad",
            "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--no-gradient-accumulation-fusion", "--calculate-per-token-loss", "--init-model-with-meta-device",
            "--ckpt-format", "fsdp_dtensor", "--use-nccl-ub", "--fsdp-double-buffer", "--fsdp-manual-registration",
            *DDP, "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
            *mock_data_flags(cache), "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100",
            "--save-interval", "1000", "--log-throughput", "--logging-level", "20",
            "--distributed-timeout-minutes", "60", "--save", ckpt, "--load", ckpt, "--tensorboard-dir", tb]


MIXTRAL = ["--use-mcore-models", "--disable-bias-linear", "--seq-length", "32", "--max-position-embeddings", "64",
           "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
           "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
           "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
           "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
           "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000",
           "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
           "--overlap-param-gather", "--overlap-grad-reduce",
           "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/no/tokenizer.model",
           "--data-path", "/no/data_text_document", "--split", "99990,8,2",
           "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "3",
           "--lr-decay-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
           "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
           "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
           "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--sequence-parallel",
           "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
           "--save", "/no/ckpt", "--load", "/no/ckpt", "--tensorboard-dir", "/no/ckpt/tensorboard",
           "--no-load-optim", "--no-load-rng", "--wandb-project", "Mixtral", "--wandb-exp-name", "Mixtral_8x7B"]
GPT_OSS = ["--no-masked-softmax-fusion", "--transformer-impl", "transformer_engine", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--no-rope-fusion", "--normalization", "RMSNorm",
           "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
           "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
           "--max-position-embeddings", "32", "--use-mcore-models", "--rotary-percent", "1.0", "--rope-type", "rope",
           "--position-embedding-type", "rope", "--rotary-base", "10000", "--no-bias-gelu-fusion",
           "--export-force-local-attention", "--no-bias-dropout-fusion", "--quick-geglu", "--glu-linear-offset", "1.0",
           "--softmax-type", "learnable", "--window-attn-skip-freq", "2", "--activation-func-clamp-value", "7.0",
           "--window-size", "127,0", "--enable-gpt-oss",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", "1e-3", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
           "--overlap-param-gather", "--overlap-grad-reduce", "--moe-ffn-hidden-size", "64",
           "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3", "--moe-permute-fusion",
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--data-cache-path", "/no/cache",
           "--tiktoken-pattern", "v2", "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
           "--no-mmap-bin-files", "--num-workers", "1",
           "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1.0e-5", "--train-samples", "12",
           "--lr-decay-samples", "12", "--lr-decay-style", "cosine", "--min-lr", "1.0e-6", "--weight-decay", "0.1",
           "--lr-warmup-fraction", "0.05", "--clip-grad", "1.0", "--bf16", "--use-flash-attn",
           "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
           "--disable-bf16-reduced-precision-matmul", "--recompute-activations",
           "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
           "--expert-model-parallel-size", "1", "--sequence-parallel", "--context-parallel-size", "1",
           "--use-distributed-optimizer", *FP8,
           "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "50000000", "--eval-iters", "0",
           "--save", "/no/ckpt", "--tensorboard-dir", "/no/ckpt/tensorboard", "--moe-per-layer-logging",
           "--no-load-optim", "--no-load-rng", "--log-throughput"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A tiny GPT-2 BPE (vocab.json + merges.txt) and a corpus preprocessed with it (.bin/.idx)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megatron_core.data.preprocess import preprocess
    root = tmp_path_factory.mktemp("gpt2")
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab, merges = hf.model.save(str(root))
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS))
    prefixes = preprocess([str(corpus)], str(root / "corpus"), append_eod=True,
                          tokenizer_args=dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    return vocab, merges, prefixes["text"]


def _iteration_lines(out: str) -> int:
    """Megatron's training log lines (``iteration        1/       3 | ...``)."""
    return len(re.findall(r"\] iteration +\d+/", out))


def _run(distributed, world, argv):
    return distributed(world, run_main_with_stdout, argv)[0]


def run_main_with_stdout(argv):
    """``run_main`` plus this rank's stdout, with the framework's log warnings in stderr (as a command-line
    run prints them): (status, stderr, stdout)."""
    import contextlib
    import io
    import logging
    out, warnings = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(warnings)
    handler.setLevel(logging.WARNING)
    logging.getLogger("megatron_core").addHandler(handler)
    try:
        with contextlib.redirect_stdout(out):
            status, err = run_main(argv)
    finally:
        logging.getLogger("megatron_core").removeHandler(handler)
    return status, err + warnings.getvalue(), out.getvalue()


def test_gpt3_example_trains(distributed, tmp_path, gpt2_files):
    vocab, merges, data = gpt2_files
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    status, err, out = _run(distributed, 2, gpt3_flags(ckpt, tb, vocab, merges, data))
    assert status == 0, err
    assert "starting from scratch" in out and "tensorboard package is not installed" in err
    assert "global batch size:     2" in out and "global batch size:     4" in out  # the step schedule
    assert _iteration_lines(out) == 3 and os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    assert out.count(" kernels used: ") == 1 and "layer_norm=" in out  # which implementation ran, said once


def test_llama_example_trains_on_mock_data(distributed, tmp_path):
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    status, err, out = _run(distributed, 1, llama_flags(ckpt, tb, mock_data_flags(str(tmp_path / "cache"))))
    assert status == 0, err
    assert "--sequence-parallel is turned off" in err and "--fp8-format hybrid runs emulated" in err
    assert _iteration_lines(out) == 3 and "validation loss at iteration 3" in out
    assert os.path.getsize(tmp_path / "torch_profile" / "rank-0.json.gz") > 0  # --profile: a torch.profiler trace


def test_megatron_fsdp_llama_example_trains(distributed, tmp_path):
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    status, err, out = _run(distributed, 2, fsdp_llama_flags(ckpt, tb, str(tmp_path / "cache")))
    assert status == 0, err
    assert _iteration_lines(out) == 3
    from megatron_core.checkpointing import read_metadata
    _, metadata = read_metadata(ckpt)
    assert metadata["layout"]["zero_stage"] == 3 if "layout" in metadata else True


@pytest.mark.parametrize("name, argv, named", [
    ("fp4", ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"], ["--fp4-format e2m1", "NVFP4"]),
    ("te quantizer factory", ["--fp8-format", "hybrid", "--fp8-quantizer-factory", "my.module"],
     ["--fp8-quantizer-factory my.module", "this FP8 option is not built"]),
], ids=lambda value: value if isinstance(value, str) else None)
def test_unbuilt_features_refuse_clearly(distributed, name, argv, named):
    status, err, _ = _run(distributed, 1, argv)
    assert status == 2, err
    assert "unrecognized arguments" not in err and "Traceback" not in err and "usage:" not in err
    assert len(err.strip().splitlines()) == 1, err  # one paragraph
    for fragment in named:
        assert fragment in err, (fragment, err)


def _replace_flags(argv: list[str], replacements: dict[str, list[str]]) -> list[str]:
    """``argv`` with each flag in ``replacements`` (and its values) replaced by the given tokens."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        out += replacements.get(flag, argv[i:j])
        i = j
    return out


def test_mixtral_example_trains(distributed, tmp_path):
    """Mixtral's flag set (sizes shrunk; 2 ranks at ep 2 instead of 8; mock data instead of its corpus)
    trains 3 iterations with the MoE layer, the all-to-all dispatcher, grouped GEMM and the distributed
    optimizer."""
    ckpt = str(tmp_path / "ckpt")
    argv = _replace_flags(MIXTRAL, {
        "--tokenizer-type": ["--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--mock-data"],
        "--tokenizer-model": [], "--data-path": [],
        "--expert-model-parallel-size": ["--expert-model-parallel-size", "2"],
        "--save": ["--save", ckpt], "--load": ["--load", ckpt], "--tensorboard-dir": [],
        "--eval-iters": ["--eval-iters", "1"]})
    status, err, out = _run(distributed, 2, argv)
    assert status == 0, err
    assert _iteration_lines(out) == 3 and "load_balancing_loss" in out


def test_mixtral_example_flags_parse_into_an_moe_model():
    from megatron_core.training.arguments import parse_args, transformer_config
    config = transformer_config(parse_args(MIXTRAL))
    assert config.moe.num_moe_experts == 8 and config.moe.moe_router_topk == 2
    assert config.moe.moe_token_dispatcher_type == "alltoall" and config.moe.moe_grouped_gemm


def _losses(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(argv))


def test_per_token_loss_is_layout_independent(distributed, tmp_path):
    """--calculate-per-token-loss: the loss of the global batch's tokens, the same at dp 1 and dp 2 (and, with
    every token counted as here, the same as the per-micro-batch mean)."""
    base = [*RECIPE, *_tiny_model("llama"), "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "0",
            "--lr", "1e-3", "--min-lr", "1e-4", "--seed", "5", "--qk-layernorm"]
    per_token = [*base, "--calculate-per-token-loss"]
    single = distributed(1, _losses, per_token)[0]
    torch_close = pytest.importorskip("torch").testing.assert_close
    torch_close(distributed(2, _losses, per_token)[0], single, rtol=1e-5, atol=0)
    torch_close(distributed(1, _losses, base)[0], single, rtol=1e-5, atol=0)


def test_llama_example_trains_on_real_data_with_a_local_hf_tokenizer(distributed, tmp_path):
    """The llama script's real-data branch: --tokenizer-type HuggingFaceTokenizer --tokenizer-model FOLDER and
    a corpus preprocessed with the same tokenizer."""
    from megatron_core.data.preprocess import preprocess
    from tests.data.test_tokenizers import _saved_hf_tokenizer
    folder = _saved_hf_tokenizer(tmp_path / "hf")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS))
    data = preprocess([str(corpus)], str(tmp_path / "corpus"), append_eod=True,
                      tokenizer_args=dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder))["text"]
    data_flags = ["--data-path", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder,
                  "--data-cache-path", str(tmp_path / "cache"), "--split", "'99,1,0'",
                  "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
                  "--vocab-size", "300"]
    status, err, out = _run(distributed, 1, llama_flags(str(tmp_path / "ckpt"), str(tmp_path / "tb"), data_flags))
    assert status == 0, err
    assert _iteration_lines(out) == 3 and os.listdir(tmp_path / "cache")  # indices cached in --data-cache-path
