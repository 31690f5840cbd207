"""FP8 against bf16 on the quickstart model: ``python pretrain_gpt.py``'s default GPT on the built-in corpus,
one process, ``--train-iters`` iterations (default 200) in bf16 and in each FP8 recipe (``--fp8-format hybrid``;
emulated on a CPU, tensor cores on a GPU with compute capability >= 8.9), for each ``--seeds`` seed.

Per run it prints the final loss, the validation loss after the last iteration (``--eval-iters`` batches of the
held-out split, the same for every run: 100 x 4 samples by default), with its ratio to bf16's at the same seed,
the mean of the last 10 training losses (10 batches of 4 samples: noisy, see docs/fp8.md) and whether any loss
was NaN/inf; with several seeds, the mean ratio per recipe. The target (issue 32): every ratio within 2%.

    python scripts/fp8_convergence.py [--train-iters 200] [--seeds 1234 1235 1236]
                                      [--recipes delayed tensorwise blockwise mxfp8]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def train(iters: int, seed: int, eval_iters: int, extra: list[str]) -> tuple[list[float], float]:
    """(training losses, validation loss after the last iteration)."""
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    with tempfile.TemporaryDirectory() as folder:
        metrics = os.path.join(folder, "metrics.jsonl")
        losses = pretrain(parse_args(["--train-iters", str(iters), "--bf16", "--log-interval", str(iters),
                                      "--eval-interval", str(iters), "--eval-iters", str(eval_iters),
                                      "--metrics-file", metrics, "--seed", str(seed), *extra]))
        with open(metrics) as f:
            valid = [r["lm_loss"] for r in map(json.loads, f) if r.get("split") == "valid"]
    return losses, valid[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=200)
    parser.add_argument("--eval-iters", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234])
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    args = parser.parse_args()
    start = time.perf_counter()
    rows, ratios = [], {recipe: [] for recipe in args.recipes}
    for seed in args.seeds:
        losses, reference = train(args.train_iters, seed, args.eval_iters, [])
        rows.append(("bf16", seed, reference, 1.0, losses))
        for recipe in args.recipes:
            losses, valid = train(args.train_iters, seed, args.eval_iters,
                                  ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--fp8-amax-history-len", "16",
                                   "--fp8-amax-compute-algo", "max"])
            rows.append((f"fp8 hybrid {recipe}", seed, valid, valid / reference, losses))
            ratios[recipe].append(valid / reference)
    print(f"{'run':<22}{'seed':>6}{'valid loss':>12}{'vs bf16':>9}{'last-10 train':>15}{'finite':>8}")
    for name, seed, valid, ratio, losses in rows:
        finite = "yes" if all(math.isfinite(loss) for loss in losses) and math.isfinite(valid) else "NO"
        tail = sum(losses[-10:]) / len(losses[-10:])
        print(f"{name:<22}{seed:>6}{valid:>12.4f}{ratio:>9.3f}{tail:>15.4f}{finite:>8}")
    if len(args.seeds) > 1:
        for recipe, values in ratios.items():
            mean = sum(values) / len(values)
            print(f"fp8 hybrid {recipe:<11} mean valid-loss ratio over {len(values)} seeds {mean:.3f} "
                  f"(min {min(values):.3f}, max {max(values):.3f})")
    print(f"({args.train_iters} iterations each, {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
