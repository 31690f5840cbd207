"""FP8 against bf16 on the quickstart model: ``python pretrain_gpt.py``'s default GPT on the built-in corpus,
one process, ``--train-iters`` iterations (default 200) in bf16 and in each FP8 recipe (``--fp8-format hybrid``;
emulated on a CPU, tensor cores on a GPU with compute capability >= 8.9). Prints each run's final loss (the mean
of the last 10 iterations), its ratio to bf16's, and whether any loss was NaN/inf.

    python scripts/fp8_convergence.py [--train-iters 200] [--recipes delayed tensorwise blockwise mxfp8]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def train(iters: int, extra: list[str]) -> list[float]:
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(["--train-iters", str(iters), "--bf16", "--log-interval", str(iters),
                                "--eval-interval", str(10 * iters), "--seed", "1234", *extra]))


def final_loss(losses: list[float]) -> float:
    tail = losses[-10:]
    return sum(tail) / len(tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=200)
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    args = parser.parse_args()
    start = time.perf_counter()
    reference = final_loss(train(args.train_iters, []))
    print(f"{'run':<22}{'final loss':>12}{'vs bf16':>10}{'finite':>8}")
    print(f"{'bf16':<22}{reference:>12.4f}{1.0:>10.3f}{'yes':>8}")
    for recipe in args.recipes:
        losses = train(args.train_iters, ["--fp8-format", "hybrid", "--fp8-recipe", recipe,
                                          "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"])
        finite = all(math.isfinite(loss) for loss in losses)
        loss = final_loss(losses)
        print(f"{'fp8 hybrid ' + recipe:<22}{loss:>12.4f}{loss / reference:>10.3f}{'yes' if finite else 'NO':>8}")
    print(f"({args.train_iters} iterations each, {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
