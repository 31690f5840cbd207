"""The CPU memory probe's cost: pretrain_gpt's loop with its second step under ``LiveMemoryTracker`` sampling
after every op (``every_op=True``) and in the fast mode the probe and the dry run use (``every_op=False``),
alternating run by run on the same gloo ranks (a pool forked once).

Prints, per mode, the median whole-run seconds over the rounds (with the range), the tracker's samples in the
probed step and the peak it found; the peaks must be equal (the script exits 1 otherwise). The run is the
suite's MoE test shape (2 layers, hidden 32, 4 experts, ep 2, 8 iterations of 4 micro-batches) by default.

    python scripts/bench_tracker.py                    # ep 2 MoE, 7 rounds
    python scripts/bench_tracker.py --dense --rounds 5  # the same run without experts
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TRITON_INTERPRET", "1")

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "8", "--lr", "2e-3", "--eval-interval", "1000", "--log-interval", "1000",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data", "--seed", "7"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-token-dispatcher-type", "alltoall"]


def _run(argv: list[str], every_op: bool) -> dict:
    """One pretrain run on this rank with the probe's tracker in the given mode: seconds, samples, peak."""
    from megatron_core.training import banner
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    from megatron_core.utils.live_memory import LiveMemoryTracker
    made = []

    class Tracker(LiveMemoryTracker):
        def __init__(self, **kwargs):
            super().__init__(**{**kwargs, "every_op": every_op})
            made.append(self)

    original, banner.LiveMemoryTracker = banner.LiveMemoryTracker, Tracker
    try:
        start = time.perf_counter()
        pretrain(parse_args(argv))
        seconds = time.perf_counter() - start
    finally:
        banner.LiveMemoryTracker = original
    return {"seconds": seconds, "samples": made[0].samples, "peak": made[0].peak_total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dense", action="store_true", help="no experts (dp 2)")
    opts = parser.parse_args()
    from megatron_core.testing import PoolCache
    argv = ARGV + ([] if opts.dense else MOE)
    modes = {"every op": True, "fast (the probe)": False}
    results = {name: [] for name in modes}
    with PoolCache() as pools:
        pools.run(2, _run, argv, True)  # warm-up: imports, kernels, caches
        for _ in range(opts.rounds):
            for name, every_op in modes.items():
                results[name].append(pools.run(2, _run, argv, every_op)[0])
    print(f"pretrain_gpt, {'dense dp 2' if opts.dense else 'MoE ep 2'}, 2 gloo ranks, {opts.rounds} alternating rounds")
    medians = {}
    for name, runs in results.items():
        seconds = [r["seconds"] for r in runs]
        medians[name] = statistics.median(seconds)
        print(f" {name:28s} run {medians[name]:.3f} s (range {min(seconds):.3f}-{max(seconds):.3f}), probed step "
              f"{runs[0]['samples']} samples, peak {runs[0]['peak']:,} bytes")
    before, after = medians.values()
    print(f" fast / every op: {after / before:.3f}x run time")
    peaks = {r["peak"] for runs in results.values() for r in runs}
    if len(peaks) != 1:
        print(f" PEAKS DIFFER: {sorted(peaks)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
