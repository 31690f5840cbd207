"""megatron_core's engine against DeepSpeed's on the same script, config and model: a transformers GPT-2 (fp32,
random weights) at dp 2 over gloo, ZeRO stages 0-3.

    python scripts/bench_engine.py                   # ~3 minutes on 2 CPU cores
    python scripts/bench_engine.py --stages 3 --rounds 5

Both engines come from scripts/engine_example.py (its ``ds_config``: AdamW with torch's kernel in both,
clipping 1.0, WarmupLR; its GPT-2 builder). Two forked gloo ranks (``megatron_core.testing``) build, per stage,
one engine of each backend from the same seed and feed them the same batches:

* loss: the largest relative difference of the per-step losses (mean over micro-batches and ranks);
* memory: each rank's peak-RSS growth (``VmHWM`` reset before the engine is built) over building it and its
  first two steps (optimizer states allocated), after a warm-up step of each backend (one-time costs); the
  script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set;
* time: one optimizer step (``accumulation`` micro-batches), the engines alternating step by step for
  ``rounds`` rounds (the order flips every round, so a busy machine slows both alike): median and range.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import engine_example  # noqa: E402

from megatron_core.testing import DistributedPool  # noqa: E402
from megatron_core.utils.live_memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss  # noqa: E402

BACKENDS = ("megatron_core", "deepspeed")
SHAPE = dict(layers=4, hidden=192, heads=4, vocab=8192, seq=64)


def _build(backend: str, stage: int, *, micro: int, accumulation: int):
    deepspeed = engine_example.import_backend(backend)
    model = engine_example.build_gpt2(**SHAPE)
    config = engine_example.ds_config(stage=stage, micro=micro, accumulation=accumulation)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine, micro_batches: list[torch.Tensor]) -> float:
    """One optimizer step over ``micro_batches``; the loss averaged over them and the dp ranks."""
    total = torch.zeros(())
    for tokens in micro_batches:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach()
    total /= len(micro_batches)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _batches(steps: int, *, micro: int, accumulation: int) -> list[list[torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = engine_example.RandomTokens(steps * micro * accumulation * world, SHAPE["seq"], SHAPE["vocab"])
    out = []
    for step in range(steps):
        first = (step * world + rank) * micro * accumulation
        samples = [data[i] for i in range(first, first + micro * accumulation)]
        out.append([torch.stack(samples[i:i + micro]) for i in range(0, len(samples), micro)])
    return out


def _warm_up(batches: list[list[torch.Tensor]], *, micro: int, accumulation: int) -> None:
    """One step of each backend at stages 0 and 3, so that neither measured engine pays the one-time costs
    (lazy imports, DeepSpeed's op builds, gloo's buffers)."""
    for backend in BACKENDS:
        for stage in (0, 3):
            _step(_build(backend, stage, micro=micro, accumulation=accumulation), batches[0])
    gc.collect()


def bench_rank(stages: list[int], rounds: int, micro: int, accumulation: int) -> dict:
    """Runs on every rank: for each stage, both engines side by side (see the module docstring)."""
    torch.set_num_threads(1)
    multiprocessing.current_process()._config["daemon"] = False
    batches = _batches(2 + rounds, micro=micro, accumulation=accumulation)
    _warm_up(batches, micro=micro, accumulation=accumulation)
    results = {}
    for index, stage in enumerate(stages):
        engines, rss, losses, times = {}, {}, {b: [] for b in BACKENDS}, {b: [] for b in BACKENDS}
        for backend in BACKENDS if index % 2 == 0 else BACKENDS[::-1]:  # who is built first alternates too
            gc.collect()
            reset_peak_rss()
            baseline = current_rss_bytes()
            engines[backend] = _build(backend, stage, micro=micro, accumulation=accumulation)
            losses[backend] += [_step(engines[backend], batches[0]), _step(engines[backend], batches[1])]
            rss[backend] = peak_rss_bytes() - baseline
        for round_index in range(rounds):
            order = BACKENDS if round_index % 2 == 0 else BACKENDS[::-1]
            for backend in order:
                dist.barrier()
                start = time.perf_counter()
                losses[backend].append(_step(engines[backend], batches[2 + round_index]))
                times[backend].append(time.perf_counter() - start)
        results[stage] = {"rss": rss, "losses": losses, "times": times}
        del engines
        gc.collect()
    return results


def _report(per_rank: list[dict], stages: list[int]) -> list[dict]:
    rows = []
    for stage in stages:
        first = per_rank[0][stage]
        ours, theirs = first["losses"]["megatron_core"], first["losses"]["deepspeed"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
        row = {"stage": stage, "steps": len(ours), "max_rel_loss_diff": rel}
        for backend in BACKENDS:
            times = first["times"][backend]
            row[backend] = {"step_s_median": statistics.median(times), "step_s_min": min(times),
                            "step_s_max": max(times),
                            "rss_growth_mib": [r[stage]["rss"][backend] / 2 ** 20 for r in per_rank]}
        rows.append(row)
    return rows


def _print(rows: list[dict], args) -> None:
    print(f"GPT-2 {SHAPE}, fp32, dp 2 (gloo, 1 thread per rank), micro {args.micro_batch} x {args.accumulation} "
          f"accumulation, {args.rounds} alternating rounds; torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| ZeRO | steps | max rel. loss diff | step s ours (range) | step s DeepSpeed (range) | ours / DS "
          "| RSS growth MiB ours (rank 0, 1) | RSS growth MiB DeepSpeed (rank 0, 1) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        ours, theirs = row["megatron_core"], row["deepspeed"]
        ratio = ours["step_s_median"] / theirs["step_s_median"]
        print(f"| {row['stage']} | {row['steps']} | {row['max_rel_loss_diff']:.1e} | {ours['step_s_median']:.3f} "
              f"({ours['step_s_min']:.3f}-{ours['step_s_max']:.3f}) | {theirs['step_s_median']:.3f} "
              f"({theirs['step_s_min']:.3f}-{theirs['step_s_max']:.3f}) | {ratio:.2f} | "
              f"{', '.join(f'{m:.0f}' for m in ours['rss_growth_mib'])} | "
              f"{', '.join(f'{m:.0f}' for m in theirs['rss_growth_mib'])} |")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--rounds", type=int, default=6, help="alternating timed steps per engine (>= 5)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--output-json", help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error(f"--rounds {args.rounds}: use at least 5 (the median needs them)")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        parser.error("deepspeed is not installed: pip install -e '.[bench]' (deepspeed==0.19.8)")
    with DistributedPool(2, timeout_s=3600) as pool:
        per_rank = pool.run(bench_rank, args.stages, args.rounds, args.micro_batch, args.accumulation,
                            timeout_s=3600)
    rows = _report(per_rank, args.stages)
    _print(rows, args)
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    main(sys.argv[1:])
