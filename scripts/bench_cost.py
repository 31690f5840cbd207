"""The cost side of ``scripts/benchmark.py``: our step time, TFLOP/s and memory as the GPT grows (``--only
scaling``), and the parallelism planner's predictions against measured steps (``--only planner``).
Each returns the lines of a markdown table."""
from __future__ import annotations

import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
from bench_peers import batch, ours_model
from nanogpt_reference import GPTShape

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.optimizer import OptimizerConfig, get_optimizer, memory_report
from megatron_core.planning.activations import ActivationShape, stage_activation_bytes
from megatron_core.planning.measure import SavedActivationTracker
from megatron_core.training.metrics import gpt_flops_per_iteration


def _time_steps(step, steps: int) -> float:
    """Seconds per step, mean of ``steps`` after one warm-up step (CPU)."""
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _scaling_point(shape: GPTShape, rows: int, steps: int) -> tuple[float, int, int, float]:
    """(seconds per step, measured saved-activation peak, model-state bytes, predicted activation bytes)."""
    torch.manual_seed(0)
    state = initialize_model_parallel()
    model = ours_model(shape, state)
    optimizer = get_optimizer(OptimizerConfig(lr=1e-4, clip_grad=0.0), model, parallel_state=state)
    inputs, labels = batch(shape, rows)
    positions = torch.arange(shape.seq).expand(rows, shape.seq)

    def step():
        optimizer.zero_grad()
        model(inputs, positions, labels=labels).mean().backward()
        optimizer.step()
    seconds = _time_steps(step, steps)
    with SavedActivationTracker() as tracker:
        step()
    states = memory_report(model, optimizer).total
    predicted = stage_activation_bytes(model.config, ActivationShape(shape.seq, rows, element_bytes=4, mask_bytes=4),
                                       layers=shape.layers, first=True, last=True, in_flight=1,
                                       padded_vocab_size=model.padded_vocab_size)
    destroy_model_parallel(state)
    return seconds, tracker.peak, states, predicted


def bench_scaling(args) -> list[str]:
    """The cost curve of our model in one process (table lines)."""
    torch.set_num_threads(args.threads)
    base = shape_of(args)
    points = [("base", base), ("2x layers", _replace(base, layers=2 * base.layers)),
              ("2x hidden", _replace(base, hidden=2 * base.hidden)), ("2x seq", _replace(base, seq=2 * base.seq))]
    lines = ["scaling (ours, one process):", "",
             "| shape | layers | hidden | seq | step s (median) | vs base | GFLOP/step | TFLOP/s | activations MiB "
             "(measured / predicted) | model states MiB |", "| --- |" + " ---: |" * 9]
    base_time = None
    for name, shape in points:
        results = [_scaling_point(shape, args.batch, args.steps) for _ in range(args.runs)]
        seconds = statistics.median(r[0] for r in results)
        base_time = base_time or seconds
        flops = flops_per_step(shape, args.batch)
        lines.append(f"| {name} | {shape.layers} | {shape.hidden} | {shape.seq} | {seconds:.4f} | "
                     f"{seconds / base_time:.2f}x | {flops / 1e9:.2f} | {flops / seconds / 1e12:.4f} | "
                     f"{results[0][1] / 2**20:.2f} / {results[0][3] / 2**20:.2f} | {results[0][2] / 2**20:.2f} |")
    return lines


def _matmul_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 512) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * n ** 3 / (time.perf_counter() - start) / 1e12


def _allreduce_gbps(megabytes: int = 16) -> float:
    x = torch.zeros(megabytes * 2**20 // 4)
    dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(x)
    return 3 * x.numel() * 4 / (time.perf_counter() - start) / 1e9  # algorithm bandwidth


def bench_planner(args) -> list[str]:
    """The planner's memory at the memory-test layouts, and its step time (calibrated on this machine) against
    measured steps at ``planning.time_validation``'s layouts."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    import test_planner as tp_test

    from megatron_core.planning.calibrate import calibrate, fastest_cpu_dtype
    from megatron_core.planning.time_validation import validate
    from megatron_core.testing import run_distributed
    lines = ["| tp | pp | dp | vpp | ZeRO | SP | recompute | predicted MiB | measured MiB | ratio |",
             "| ---: | ---: | ---: | ---: | ---: | --- | --- |" + " ---: |" * 3]
    for layout in tp_test.LAYOUTS:
        pairs = tp_test.predicted_and_measured(run_distributed, layout)
        predicted, measured = max(p for p, _ in pairs), max(m for _, m in pairs)
        lines.append(f"| {layout.tp} | {layout.pp} | {layout.dp} | {layout.vpp or 1} | {layout.zero_stage} | "
                     f"{'yes' if layout.sequence_parallel else 'no'} | {layout.recompute or 'none'} | "
                     f"{predicted / 2**20:.3f} | {measured / 2**20:.3f} | {predicted / measured:.3f} |")
    dtype = fastest_cpu_dtype()
    profile = calibrate(2, dtype_name=dtype)
    lines += ["", f"calibrated in {dtype}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in profile.items()), "",
              "| layout | predicted ms | measured ms | predicted / measured |", "| --- | ---: | ---: | ---: |"]
    for name, predicted, measured in validate(run_distributed, profile, rounds=max(args.runs, 1), dtype_name=dtype):
        lines.append(f"| {name} | {1e3 * predicted:.1f} | {1e3 * measured:.1f} | {predicted / measured:.2f} |")
    return lines


def _replace(shape: GPTShape, **changes) -> GPTShape:
    return GPTShape(**{**shape.__dict__, **changes})


def shape_of(args) -> GPTShape:
    return GPTShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab)


def flops_per_step(shape: GPTShape, rows: int) -> float:
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                               max_position_embeddings=shape.seq)
    return gpt_flops_per_iteration(config, batch_size=rows, seq_length=shape.seq, padded_vocab_size=shape.vocab)


