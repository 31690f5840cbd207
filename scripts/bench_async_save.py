"""How long a checkpoint save stalls the step loop, with and without ``--async-save`` (one process, gloo).

Trains a small GPT (default 4 layers x hidden 384, Adam: weights + 2 states, about 90 MB per checkpoint) and
saves every ``--save-interval`` iterations; prints the loop's wait per save (the host copy for async; the
whole write + fsync + publication for sync) and the wall time of the run.

    python scripts/bench_async_save.py               # options: --hidden 384 --layers 4 --iters 12 --save-interval 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from megatron_core import destroy_model_parallel
from megatron_core.training.arguments import parse_args
from megatron_core.training.loop import _train, build_run


def measure(*, hidden: int, layers: int, iters: int, interval: int, use_async: bool) -> tuple[list[float], float]:
    """(seconds the loop waited per save, run wall seconds)."""
    with tempfile.TemporaryDirectory() as directory:
        argv = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4",
                "--seq-length", "64", "--micro-batch-size", "2", "--train-iters", str(iters), "--log-interval",
                "100000", "--eval-interval", "100000", "--save", directory, "--save-interval", str(interval),
                *(["--async-save"] if use_async else [])]
        run = build_run(parse_args(argv))
        try:
            begin = time.perf_counter()
            _train(run)
            return run.save_stalls, time.perf_counter() - begin
        finally:
            destroy_model_parallel(run.state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--save-interval", type=int, default=3)
    options = parser.parse_args()
    rows = []
    for use_async in (False, True):
        stalls, wall = measure(hidden=options.hidden, layers=options.layers, iters=options.iters,
                               interval=options.save_interval, use_async=use_async)
        rows.append(("async" if use_async else "sync", stalls, wall))
    print(f"{'save':>6} | {'saves':>5} | {'stall per save (ms), median':>28} | {'max (ms)':>8} | {'run (s)':>7}")
    for name, stalls, wall in rows:
        print(f"{name:>6} | {len(stalls):>5} | {statistics.median(stalls) * 1e3:>28.1f} | "
              f"{max(stalls) * 1e3:>8.1f} | {wall:>7.2f}")
    print(f"stall ratio sync / async: {statistics.median(rows[0][1]) / statistics.median(rows[1][1]):.1f} x")


if __name__ == "__main__":
    main()
