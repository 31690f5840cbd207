"""Megatron-LM's functional-test configurations as its CI launches them, made runnable here.

``data/megatron_lm_ci_model_args.json`` holds the MODEL_ARGS of every training config under Megatron-LM's
``tests/functional_tests/test_cases/{gpt,moe,mixtral}`` (commit d98e8a64dd, the one
``megatron_core/training/megatron_lm_flags.json`` was read from), each already turned into argv the way its
runner (``shell_test_utils/_run_training.sh``) does: ``true`` -> the bare flag, ``[a, b]`` -> ``a b``.
``localize`` fills the runner's environment variables; ``shrink`` keeps every flag and parallel size but makes
the model, data and schedule tiny, on the mock dataset and gloo.
"""
from __future__ import annotations

import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "data", "megatron_lm_ci_model_args.json")

# what a shrunk run drops (paths, sizes and schedules it replaces; services it cannot reach)
_DROPPED = {"--data-path": 1, "--data-cache-path": 1, "--vocab-file": 1, "--merge-file": 1, "--tokenizer-type": 1,
            "--tokenizer-model": 1, "--tensorboard-dir": 1, "--wandb-project": 1, "--wandb-exp-name": 1,
            "--wandb-save-dir": 1, "--wandb-entity": 1, "--train-samples": 1, "--lr-decay-samples": 1,
            "--lr-warmup-samples": 1, "--lr-decay-iters": 1, "--lr-warmup-iters": 1, "--lr-warmup-fraction": 1,
            "--train-iters": 1, "--eval-iters": 1, "--eval-interval": 1, "--save-interval": 1, "--save": 1,
            "--load": 1, "--exit-interval": 1, "--exit-duration-in-mins": 1, "--step-batch-size-schedule": 1,
            "--rampup-batch-size": 3, "--num-layers": 1, "--hidden-size": 1, "--ffn-hidden-size": 1,
            "--num-attention-heads": 1, "--kv-channels": 1, "--num-query-groups": 1, "--seq-length": 1,
            "--max-position-embeddings": 1, "--micro-batch-size": 1, "--global-batch-size": 1,
            "--moe-ffn-hidden-size": 1, "--moe-shared-expert-intermediate-size": 1, "--distributed-backend": 1,
            "--num-layers-per-virtual-pipeline-stage": 1, "--split": 1, "--log-interval": 1, "--mock-data": 0,
            "--profile": 0, "--use-pytorch-profiler": 0, "--distributed-timeout-minutes": 1, "--moe-layer-freq": 1}


def load_configs() -> dict:
    """``{"gpt/<case>": {"test_type", "argv"}}``."""
    with open(CONFIGS, encoding="utf-8") as handle:
        return json.load(handle)


def localize(argv: list[str], root: str) -> list[str]:
    """The runner's ``${VAR}`` / ``$VAR`` filled in: paths under ``root``, ``$REPEAT`` (a seed) 1."""
    def fill(match: re.Match) -> str:
        name = match.group(1)
        return "1" if "REPEAT" in name else os.path.join(root, name.lower())
    return [re.sub(r"\$\{?(\w+)\}?", fill, token) for token in argv]


def value(argv: list[str], flag: str, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def layout(argv: list[str]) -> dict:
    sizes = {name: int(value(argv, flag, 1)) for name, flag in (
        ("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
        ("cp", "--context-parallel-size"), ("ep", "--expert-model-parallel-size"))}
    vpp_layers = value(argv, "--num-layers-per-virtual-pipeline-stage")
    sizes["vpp"] = 2 if vpp_layers is not None else 1
    return sizes


def _without(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        width = _DROPPED.get(argv[i])
        if width is None:
            out.append(argv[i])
            i += 1
            continue
        i += 1
        while width and i < len(argv) and not argv[i].startswith("--"):
            i += 1
            width -= 1
    return out


def shrink(argv: list[str], save_dir: str, *, iterations: int = 3) -> tuple[list[str], int]:
    """``(argv, world size)``: the config's flags and parallel sizes (data-parallel size 1, or what ep and the
    optimizer instances need), a
    model of one layer per (virtual) pipeline stage (at least 2), hidden 32 x tp, sequence 32 x cp, ``iterations``
    steps on the mock data."""
    sizes = layout(argv)
    tp, pp, cp, vpp = sizes["tp"], sizes["pp"], sizes["cp"], sizes["vpp"]
    heads = 4 * tp
    layered = any(flag in argv for flag in (
        "--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank",
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"))
    layers = value(argv, "--num-layers", 2) if layered else max(2, pp * vpp)  # a layout counts the config's layers
    tiny = ["--num-layers", str(layers), "--hidden-size", str(8 * heads), "--num-attention-heads", str(heads),
            "--ffn-hidden-size", str(16 * heads), "--seq-length", str(32 * cp), "--max-position-embeddings",
            str(32 * cp), "--micro-batch-size", "1", "--train-iters",
            str(iterations), "--eval-iters", "1", "--eval-interval", "1000", "--lr-warmup-iters", "1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--save", save_dir,
            "--load", save_dir, "--save-interval", "1000", "--log-interval", "1", "--distributed-backend", "gloo",
            "--distributed-timeout-minutes", "2"]
    if "--group-query-attention" in argv:
        tiny += ["--num-query-groups", str(tp)]
    if vpp > 1 and not layered:
        tiny += ["--num-layers-per-virtual-pipeline-stage", "1"]
    if "--num-experts" in argv:
        tiny += ["--moe-ffn-hidden-size", str(8 * heads)]
        if "--moe-shared-expert-intermediate-size" in argv:
            tiny += ["--moe-shared-expert-intermediate-size", str(8 * heads)]
    etp = int(value(argv, "--expert-tensor-parallel-size", tp)) if "--num-experts" in argv else 1
    instances = int(value(argv, "--num-distributed-optimizer-instances", 1))
    dp = 1
    # ep x etp must divide tp x cp x dp and the optimizer instances dp x cp (and expert-dp): add dp ranks
    expert_grid = sizes["ep"] * etp
    while (tp * cp * dp) % expert_grid or (cp * dp) % instances or (tp * cp * dp // expert_grid) % instances:
        dp += 1
    tiny += ["--global-batch-size", str(2 * pp * dp)]
    return [*_without(argv), *tiny], tp * pp * cp * dp


__all__ = ["load_configs", "localize", "shrink", "layout", "value", "CONFIGS"]
