"""megatron_core side by side with what users would pick instead, measured in one run: same GPT shape, data
and process count, runs alternated (ours, peer, ours, ...), median of --runs with min-max shown.

    python scripts/benchmark.py                              # everything, a few minutes on 2 CPU cores
    python scripts/benchmark.py --only single,tp --runs 5 --png outputs/benchmark.png --peak-tflops 989

Sub-benchmarks (``--only``, comma-separated):
  single   one process: our GPTModel train step vs a plain eager PyTorch GPT (scripts/nanogpt_reference.py)
  tp       2 ranks: our tensor parallelism vs PyTorch DTensor (parallelize_module, Colwise/RowwiseParallel)
  pp       2 ranks: our 1F1B vs torch.distributed.pipelining Schedule1F1B (scripts/bench_pipeline.py)
  zero3    dp 2: our ZeRO-3 vs FSDP2 fully_shard (scripts/bench_zero.py)
  scaling  our step time, TFLOP/s and memory (saved activations + model states, measured and predicted by
           megatron_core.planning) as layers, hidden size and sequence length double
  planner  tools/plan_parallelism.py's memory and step time against one measured step at 12 layouts of a
           tiny bf16 GPT (the layouts of tests/distributed/test_planner.py), with this machine's bf16 matmul
           rate as the peak and its gloo all-reduce rate as the bandwidth
A train step is forward + backward + AdamW step, fp32, dropout off. Gloo ranks on the CPU (one thread each);
with CUDA, single, tp and scaling run on the GPU (nccl for tp) and print MFU against --peak-tflops or the
device table of megatron_core.training.metrics. Writes a bar chart of the ratios (--png; 1.0 = parity).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_pipeline  # noqa: E402
import bench_zero  # noqa: E402
from nanogpt_reference import GPTShape, NanoGPT, parallelize_dtensor  # noqa: E402

from megatron_core import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_core.config import TransformerConfig  # noqa: E402
from megatron_core.models import GPTModel  # noqa: E402
from megatron_core.optimizer import OptimizerConfig, get_optimizer, memory_report  # noqa: E402
from megatron_core.planning.activations import ActivationShape, stage_activation_bytes  # noqa: E402
from megatron_core.planning.measure import SavedActivationTracker  # noqa: E402
from megatron_core.testing import DistributedPool  # noqa: E402
from megatron_core.training.metrics import gpt_flops_per_iteration, mfu, peak_tflops_per_device  # noqa: E402
from megatron_core.utils.png import atomic_write, encode_png  # noqa: E402

ALL = ("single", "tp", "pp", "zero3", "scaling", "planner")
TARGETS = {"single": 0.95, "tp": 0.7}


def _device(backend: str) -> torch.device:
    if backend == "nccl":  # CUDA-only path
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA-only path


def _ours_model(shape: GPTShape, state, device: torch.device) -> GPTModel:
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                               max_position_embeddings=shape.seq, hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=state.tp_size, untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    return GPTModel(config, parallel_state=state, vocab_size=shape.vocab, max_sequence_length=shape.seq).to(device)


def _batch(shape: GPTShape, batch: int, device: torch.device):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab, (batch, shape.seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _time_steps(step, steps: int, device: torch.device) -> float:
    """Seconds per step, mean of ``steps`` after one warm-up step."""
    step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def gpt_step_seconds(kind: str, shape: GPTShape, batch: int, steps: int, backend: str = "gloo") -> float:
    """One implementation's seconds per train step on this rank: "ours" (GPTModel, any tp = world size),
    "eager" (NanoGPT, one process) or "dtensor" (NanoGPT under DTensor tp = world size)."""
    device = _device(backend)
    inputs, labels = _batch(shape, batch, device)
    if kind == "ours":
        state = initialize_model_parallel(
            tensor_model_parallel_size=dist.get_world_size() if dist.is_initialized() else 1)
        model = _ours_model(shape, state, device)
        optimizer = get_optimizer(OptimizerConfig(lr=1e-4, clip_grad=0.0), model, parallel_state=state)
        positions = torch.arange(shape.seq, device=device).expand(batch, shape.seq)

        def step():
            optimizer.zero_grad()
            model(inputs, positions, labels=labels).mean().backward()
            optimizer.step()
        seconds = _time_steps(step, steps, device)
        destroy_model_parallel(state)
        return seconds
    torch.manual_seed(0)
    model = NanoGPT(shape).to(device)
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        model = parallelize_dtensor(model, init_device_mesh(device.type, (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad()
        model(inputs, labels).backward()
        optimizer.step()
    return _time_steps(step, steps, device)


def _alternate(runs: int, ours, theirs) -> tuple[list[float], list[float]]:
    """Runs ``ours()`` and ``theirs()`` alternately ``runs`` times each; their seconds."""
    a, b = [], []
    for _ in range(runs):
        a.append(ours())
        b.append(theirs())
    return a, b


def _row(name: str, peer: str, ours: list[float], theirs: list[float], note: str = "") -> dict:
    ratios = sorted(o / t for o, t in zip(ours, theirs))
    return {"name": name, "peer": peer, "ours": statistics.median(ours), "theirs": statistics.median(theirs),
            "ratio": statistics.median(ratios), "min": ratios[0], "max": ratios[-1], "note": note}


def bench_single(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    shape, device = _shape(args), torch.device("cuda" if args.backend == "nccl" else "cpu")
    ours, theirs = _alternate(args.runs, lambda: gpt_step_seconds("ours", shape, args.batch, args.steps, args.backend),
                              lambda: gpt_step_seconds("eager", shape, args.batch, args.steps, args.backend))
    return [_row("single process", "eager PyTorch GPT", ours, theirs, _mfu_note(args, shape, ours, 1, device))]


def bench_tp(args) -> list[dict]:
    shape = _shape(args)
    with DistributedPool(2, backend=args.backend) as pool:
        ours, theirs = _alternate(
            args.runs, lambda: max(pool.run(gpt_step_seconds, "ours", shape, args.batch, args.steps, args.backend)),
            lambda: max(pool.run(gpt_step_seconds, "dtensor", shape, args.batch, args.steps, args.backend)))
    device = torch.device("cuda" if args.backend == "nccl" else "cpu")
    return [_row("tp 2", "DTensor parallelize_module", ours, theirs, _mfu_note(args, shape, ours, 2, device))]


def bench_pp(args) -> list[dict]:
    pp_args = argparse.Namespace(pp=2, microbatches=8, micro_batch=2, layers=args.layers, hidden=args.hidden,
                                 seq=args.seq, steps=args.steps, vpp=2)
    with DistributedPool(2) as pool:
        ours, theirs = _alternate(args.runs,
                                  lambda: max(r[0] for r in pool.run(bench_pipeline._bench, "ours", pp_args, None)),
                                  lambda: max(r[0] for r in pool.run(bench_pipeline._bench, "torch", pp_args, None)))
    return [_row("pp 2 (1F1B, 8 micro-batches)", "torch.distributed.pipelining", ours, theirs)]


def bench_zero3(args) -> list[dict]:
    ours, theirs, mem = [], [], {}
    for _ in range(args.runs):  # fresh processes per run: each measures its own peak RSS growth
        for kind, out in (("zero3", ours), ("fsdp2", theirs)):
            with DistributedPool(2) as pool:
                per_rank = pool.run(bench_zero._timed_steps, kind, args.zero_hidden, args.zero_layers, args.steps, 64)
            out.append(max(t for t, _ in per_rank))
            mem.setdefault(kind, []).append(max(m for _, m in per_rank))
    note = f"peak RSS growth {statistics.median(mem['zero3']) / statistics.median(mem['fsdp2']):.2f}x FSDP2"
    return [_row(f"ZeRO-3 dp 2 ({args.zero_layers} x Linear({args.zero_hidden}), bf16)", "FSDP2 fully_shard",
                 ours, theirs, note)]


def _scaling_point(shape: GPTShape, batch: int, steps: int) -> tuple[float, int, int, float]:
    """(seconds per step, measured saved-activation peak, model-state bytes, predicted activation bytes)."""
    torch.manual_seed(0)
    state = initialize_model_parallel()
    model = _ours_model(shape, state, torch.device("cpu"))
    optimizer = get_optimizer(OptimizerConfig(lr=1e-4, clip_grad=0.0), model, parallel_state=state)
    inputs, labels = _batch(shape, batch, torch.device("cpu"))
    positions = torch.arange(shape.seq).expand(batch, shape.seq)

    def step():
        optimizer.zero_grad()
        model(inputs, positions, labels=labels).mean().backward()
        optimizer.step()
    seconds = _time_steps(step, steps, torch.device("cpu"))
    with SavedActivationTracker() as tracker:
        step()
    states = memory_report(model, optimizer).total
    predicted = stage_activation_bytes(model.config, ActivationShape(shape.seq, batch, element_bytes=4, mask_bytes=4),
                                       layers=shape.layers, first=True, last=True, in_flight=1,
                                       padded_vocab_size=model.padded_vocab_size)
    destroy_model_parallel(state)
    return seconds, tracker.peak, states, predicted


def bench_scaling(args) -> list[str]:
    """The cost curve of our model in one process (table lines)."""
    torch.set_num_threads(args.threads)
    base = _shape(args)
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
        flops = _flops(shape, args.batch)
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
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    import test_planner as tp_test

    from megatron_core.planning.planner import Hardware, Workload, plan_layout
    from megatron_core.testing import run_distributed
    torch.set_num_threads(1)
    peak = _matmul_tflops()
    gbps = max(run_distributed(2, _allreduce_gbps))
    base = TransformerConfig(**tp_test.MODEL, max_position_embeddings=tp_test.S, params_dtype=torch.bfloat16, bf16=True)
    lines = [f"bf16 matmul {peak * 1e3:.1f} GFLOP/s per rank (1 thread), gloo all-reduce {gbps:.2f} GB/s", "",
             "| tp | pp | dp | vpp | ZeRO | SP | recompute | predicted MiB | measured MiB | ratio | predicted ms | "
             "measured ms | ratio |", "| ---: | ---: | ---: | ---: | ---: | --- | --- |" + " ---: |" * 6]
    for layout in tp_test.LAYOUTS:
        pairs = tp_test.predicted_and_measured(run_distributed, layout)
        measured_ms = 1e3 * statistics.median(
            max(r.step_seconds for r in run_distributed(layout.tp * layout.pp * layout.dp * layout.cp, tp_test._measure,
                                                        layout,
                                                        {**tp_test.MODEL, "sequence_parallel": layout.sequence_parallel,
                                                         "recompute_granularity": layout.recompute}, 3))
            for _ in range(3))
        workload = Workload(vocab_size=tp_test.V, seq_length=tp_test.S, micro_batch_size=tp_test.B,
                            global_batch_size=tp_test.B * tp_test.M * layout.dp, make_vocab_size_divisible_by=8,
                            mask_bytes=2)
        hardware = Hardware(num_devices=layout.tp * layout.pp * layout.dp * layout.cp, memory_per_device_gb=1,
                            peak_tflops=peak, intra_node_bandwidth_gbps=gbps, devices_per_node=4,
                            compute_efficiency=1.0)
        plan = plan_layout(base, workload, hardware, layout)
        predicted, measured = max(p for p, _ in pairs), max(m for _, m in pairs)
        lines.append(f"| {layout.tp} | {layout.pp} | {layout.dp} | {layout.vpp or 1} | {layout.zero_stage} | "
                     f"{'yes' if layout.sequence_parallel else 'no'} | {layout.recompute or 'none'} | "
                     f"{predicted / 2**20:.3f} | {measured / 2**20:.3f} | {predicted / measured:.3f} | "
                     f"{plan.step_seconds * 1e3:.1f} | {measured_ms:.1f} | "
                     f"{plan.step_seconds * 1e3 / measured_ms:.2f} |")
    return lines


def _replace(shape: GPTShape, **changes) -> GPTShape:
    return GPTShape(**{**shape.__dict__, **changes})


def _shape(args) -> GPTShape:
    return GPTShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab)


def _flops(shape: GPTShape, batch: int) -> float:
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                               max_position_embeddings=shape.seq)
    return gpt_flops_per_iteration(config, batch_size=batch, seq_length=shape.seq, padded_vocab_size=shape.vocab)


def _mfu_note(args, shape: GPTShape, seconds: list[float], devices: int, device: torch.device) -> str:
    flops, median = _flops(shape, args.batch), statistics.median(seconds)
    peak = peak_tflops_per_device(device, args.peak_tflops)
    utilization = mfu(flops, median, num_devices=devices, peak_tflops=peak)
    text = f"ours {flops / median / devices / 1e12:.4f} TFLOP/s/rank"
    return text + (f", MFU {utilization:.1%}" if utilization is not None else ", MFU n/a (no peak for a CPU)")


def write_chart(rows: list[dict], path: str) -> None:
    """One bar per comparison: height = ours/peer step-time ratio (grey line at 1.0, red ticks at targets);
    green below 1 (we are faster), orange above."""
    width, height, margin, bar = 120 * max(len(rows), 1) + 40, 320, 20, 60
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    top = max([2.0] + [r["max"] for r in rows])
    y_of = lambda value: height - margin - round((height - 2 * margin) * value / top)  # noqa: E731
    for i, row in enumerate(rows):
        x0 = 40 + 120 * i
        colour = (52, 168, 83) if row["ratio"] <= 1 else (251, 140, 0)
        for y in range(y_of(row["ratio"]), height - margin):
            pixels[y][x0: x0 + bar] = [colour] * bar
        for y in range(y_of(row["max"]), y_of(row["min"]) + 1):  # min-max whisker
            pixels[y][x0 + bar // 2] = (0, 0, 0)
        target = TARGETS.get(row["key"])
        if target:
            pixels[y_of(target)][x0 - 5: x0 + bar + 5] = [(220, 0, 0)] * (bar + 10)
    pixels[y_of(1.0)][margin: width - margin] = [(120, 120, 120)] * (width - 2 * margin)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, encode_png(pixels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}")
    for flag, default in (("layers", 4), ("hidden", 256), ("heads", 4), ("seq", 128), ("vocab", 1024), ("batch", 4),
                          ("runs", 5), ("steps", 3), ("zero-hidden", 1024), ("zero-layers", 8),
                          ("threads", 1)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: table)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--png", default="outputs/benchmark.png")
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name]
    unknown = sorted(set(chosen) - set(ALL))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown, choose from {','.join(ALL)}")
    print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, "
          f"batch {args.batch}; {args.runs} alternated runs of {args.steps} steps; backend {args.backend}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} thread(s) per process\n")
    rows = []
    for name in chosen:
        if name in ("scaling", "planner"):
            print("\n".join((bench_scaling if name == "scaling" else bench_planner)(args)) + "\n")
            continue
        for row in globals()[f"bench_{name}"](args):
            rows.append({**row, "key": name})
    if rows:
        print("| comparison | peer | ours s/step | peer s/step | ours/peer (median) | min-max | target | note |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in rows:
            target = TARGETS.get(r["key"])
            verdict = "" if target is None else f"<= {target} {'met' if r['ratio'] <= target else 'NOT met'}"
            print(f"| {r['name']} | {r['peer']} | {r['ours']:.4f} | {r['theirs']:.4f} | {r['ratio']:.2f}x | "
                  f"{r['min']:.2f}-{r['max']:.2f} | {verdict} | {r['note']} |")
        write_chart(rows, args.png)
        print(f"\nchart: {args.png}")


if __name__ == "__main__":
    main()
