"""Per-rank memory and step time of ZeRO 0-3 on a real GPT run, side by side with PyTorch FSDP2.

The model is ``GPTModel`` (fp32, 4 layers, hidden 768, 12 heads, vocab 8192, seq 128: 34.7M parameters),
trained with AdamW on the same gloo ranks, the same data and 2 micro-batches per step (our ZeRO: ``no_sync``
on the first; FSDP2 in its lowest-memory mode: ``fully_shard`` per layer and on the root, reduce-scatter every
micro-batch, ``reshard_after_forward=True``). Memory is measured with each configuration alone in fresh
processes; step time with all of them built side by side and their steps alternating (median). Per rank it
reports, in bytes per parameter:

- peak RSS: the growth of the resident set (``VmHWM``) over steady steps (after a warm-up step creates the
  Adam states), from just before the model is built (one-time imports paid before, by every run alike);
- peak live: the largest total of live tensor bytes in one tracked step (``LiveMemoryTracker``), with its
  split into model states and activations;

next to the ZeRO paper's formula for fp32 Adam (4 + 4 + 8 bytes: parameter, gradient, two moments; fp32
masters alias the parameters): 16, 8 + 8/dp, 4 + 12/dp, 16/dp. ZeRO-3 builds the model on the meta device
(sharded construction). When ``deepspeed`` is installed (``pip install deepspeed``: pure Python on CPU, it
falls back to gloo) its ZeRO-2 and ZeRO-3 engines run too, with their default settings. Freed tensors must leave the
resident set for RSS to mean anything, so the script
re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` (allocations above 64 KiB are mmapped and unmapped).

    python scripts/bench_memory.py                   # dp 2 and 4; writes outputs/bench_memory.png
    python scripts/bench_memory.py --dp 2 --steps 3 --hidden 256   # a quick look
    python scripts/bench_memory.py --dp 2 --pipeline                 # + pp 2 x dp 2 with 2 and 8 micro-batches
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.models import GPTModel
from megatron_core.optimizer import OptimizerConfig, get_optimizer
from megatron_core.optimizer.memory import memory_categories
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.testing import DistributedPool
from megatron_core.utils.files import new_figure, save_figure
from megatron_core.utils.live_memory import LiveMemoryTracker, current_rss_bytes, peak_rss_bytes, reset_peak_rss

FORMULA = {0: lambda dp: 16.0, 1: lambda dp: 8 + 8 / dp, 2: lambda dp: 4 + 12 / dp, 3: lambda dp: 16 / dp}
RUNS = [("ZeRO-0", 0, True), ("ZeRO-1", 1, True), ("ZeRO-2", 2, True), ("ZeRO-3", 3, True),
        ("ZeRO-3 keep", 3, False), ("FSDP2", None, True)]
if importlib.util.find_spec("deepspeed") is not None:  # pip install deepspeed (pure Python on CPU, gloo)
    RUNS += [("DeepSpeed ZeRO-2", "ds2", True), ("DeepSpeed ZeRO-3", "ds3", True)]


@dataclasses.dataclass
class Shape:
    hidden: int
    layers: int
    vocab: int = 8192
    seq: int = 128
    micro_batch: int = 2
    micro_batches: int = 2


def _build(shape: Shape, state, *, meta: bool) -> GPTModel:
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden,
                               num_attention_heads=max(1, shape.hidden // 64), hidden_dropout=0.0,
                               attention_dropout=0.0, max_position_embeddings=shape.seq)
    torch.manual_seed(0)
    build_state = dataclasses.replace(state, device=torch.device("meta")) if meta else state
    return GPTModel(config, parallel_state=build_state, vocab_size=shape.vocab, max_sequence_length=shape.seq)


def _batches(shape: Shape) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq + 1), generator=g)
               for _ in range(shape.micro_batches)]
    return batches, torch.arange(shape.seq).expand(shape.micro_batch, shape.seq)


def _wrap_deepspeed(stage: int, shape: Shape, state):
    """DeepSpeed's engine at ZeRO ``stage`` (its defaults; gloo on CPU), gradient accumulation inside."""
    import deepspeed
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    model = _build(shape, state, meta=False)
    config = {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": shape.micro_batches,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      dist_init_required=False)
    batches, positions = _batches(shape)

    def step() -> None:
        for tokens in batches:
            engine.backward(engine(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean())
            engine.step()  # steps the optimizer at the accumulation boundary only
    return engine, step, lambda: ()


def _wrap(kind: str, stage, reshard: bool, shape: Shape, state):
    """The model and a ``step()`` doing one optimizer step over ``micro_batches`` micro-batches."""
    if isinstance(stage, str):
        return _wrap_deepspeed(int(stage[-1]), shape, state)
    if stage is None:
        from torch.distributed.fsdp import fully_shard
        model = _build(shape, state, meta=False)
        for layer in model.decoder.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        categories = lambda: ()  # noqa: E731 - FSDP2's tensors all count as "activations" (no split)
    else:
        model = DistributedDataParallel(
            _build(shape, state, meta=stage == 3), dp_group=state.dp_group,
            config=DistributedDataParallelConfig(zero_stage=stage, reshard_after_forward=reshard))
        optimizer = get_optimizer(OptimizerConfig(lr=1e-4, weight_decay=0.01, clip_grad=0.0), model,
                                  parallel_state=state)
        categories = lambda: memory_categories(model, optimizer)  # noqa: E731
    batches, positions = _batches(shape)

    def step() -> None:
        optimizer.zero_grad()
        for i, tokens in enumerate(batches):
            last = i == len(batches) - 1
            sync = model.no_sync() if stage is not None and not last else _nullcontext()
            with sync:
                loss = model(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean() / len(batches)
                loss.backward()
        if stage is not None:
            model.finish_grad_sync()
        optimizer.step()
    return model, step, categories


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _warm_up_imports() -> None:
    """One-time costs that are not the model's (``torch.optim`` imports dynamo on first use, ~70 MB of
    RSS): paid before the baseline, by every configuration alike."""
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param])
    param.sum().backward()
    optimizer.step()
    from torch.distributed import fsdp  # noqa: F401


def _measure(kind: str, stage, reshard: bool, shape: Shape, steps: int) -> dict:
    """One configuration alone on this rank: peak RSS growth over ``steps`` steps and one tracked step's
    live bytes."""
    state = initialize_model_parallel()
    torch.set_num_threads(1)
    _warm_up_imports()
    reset_peak_rss()
    baseline = current_rss_bytes()
    model, step, categories = _wrap(kind, stage, reshard, shape, state)
    step()  # warm-up: creates the Adam states
    reset_peak_rss()
    for _ in range(steps):
        step()
    peak_rss = peak_rss_bytes() - baseline
    tracker = LiveMemoryTracker(categories=categories)
    with tracker:
        step()
    numel = shape_numel(shape)
    return dict(rss=peak_rss / numel, live=tracker.peak_total / numel,
                breakdown={k: v / numel for k, v in tracker.peak_breakdown.items()})


def _alternating_times(shape: Shape, steps: int) -> dict[str, float]:
    """Every configuration built side by side on these ranks, their steps alternating (so a busy machine
    slows them alike); the median seconds per step of each."""
    state = initialize_model_parallel()
    torch.set_num_threads(1)
    runs = {name: _wrap(name, stage, reshard, shape, state)[1] for name, stage, reshard in RUNS}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(steps + 1):
        for name, step in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            if round_:  # the first round creates the Adam states
                times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _pipeline_peaks(shape: Shape, num_microbatches: int) -> dict:
    """pp 2 x dp 2, ZeRO-3 (meta build), 1F1B over ``num_microbatches``: one tracked step's peak split into
    model states (persistent + gathered + grad buckets) and activations, per parameter of this stage."""
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.set_num_threads(1)
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden,
                               num_attention_heads=max(1, shape.hidden // 64), hidden_dropout=0.0,
                               attention_dropout=0.0, max_position_embeddings=shape.seq,
                               pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    model = GPTModel(config, parallel_state=dataclasses.replace(state, device=torch.device("meta")),
                     vocab_size=shape.vocab, max_sequence_length=shape.seq,
                     pre_process=state.is_pipeline_first_stage, post_process=state.is_pipeline_last_stage)
    model.parallel_state = state
    ddp = DistributedDataParallel(model, dp_group=state.dp_group,
                                  config=DistributedDataParallelConfig(zero_stage=3))
    optimizer = get_optimizer(OptimizerConfig(lr=1e-4, clip_grad=0.0), ddp, parallel_state=state)
    g = torch.Generator().manual_seed(state.dp_rank)
    batches = [torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq + 1), generator=g)
               for _ in range(num_microbatches)]
    positions = torch.arange(shape.seq).expand(shape.micro_batch, shape.seq)

    def forward_step(iterator, model_):
        tokens = next(iterator)
        out = model_(tokens[:, :-1], positions, labels=tokens[:, 1:])
        return out, lambda loss: (loss.mean(), {"lm loss": loss.mean().detach()})

    def step() -> None:
        optimizer.zero_grad()
        get_forward_backward_func(2)(forward_step_func=forward_step, data_iterator=iter(batches), model=ddp,
                                     num_microbatches=num_microbatches, seq_length=shape.seq,
                                     micro_batch_size=shape.micro_batch, parallel_state=state)
        optimizer.step()
    step()
    tracker = LiveMemoryTracker(categories=lambda: memory_categories(ddp, optimizer))
    with tracker:
        step()
    numel = sum(b.numel for b in ddp.buckets) * state.dp_size
    activations = tracker.peak_breakdown.get("activations", 0)
    return dict(stage=state.pp_rank, states=(tracker.peak_total - activations) / numel,
                activations=activations / numel,
                gathered=tracker.peak_by_category.get("gathered_parameters", 0) / numel)


def shape_numel(shape: Shape) -> int:
    h = shape.hidden
    return shape.layers * (12 * h * h + 13 * h) + (shape.vocab + shape.seq) * h + 2 * h


def _chart(results: dict, path: str) -> None:
    """One panel per dp size: peak RSS growth and our measured peak live tensors, bytes per parameter, each bar
    labelled with its value; the dashed line is ZeRO-0's RSS (the baseline the stages are compared with)."""
    figure = new_figure(6.5 * len(results), 4.5)
    for index, (dp, rows) in enumerate(results.items()):
        ax = figure.add_subplot(1, len(results), index + 1)
        names = list(rows)
        x = range(len(names))
        rss = ax.bar([i - 0.2 for i in x], [rows[n]["rss"] for n in names], width=0.4, label="peak RSS growth")
        live = ax.bar([i + 0.2 for i in x], [rows[n]["live"] if n.startswith("ZeRO") else 0 for n in names],
                      width=0.4, label="peak live tensors (ours)")
        ax.bar_label(rss, fmt="%.1f", fontsize=7)
        ax.bar_label(live, labels=[f"{rows[n]['live']:.1f}" if n.startswith("ZeRO") else "" for n in names], fontsize=7)
        if "ZeRO-0" in rows:
            ax.axhline(rows["ZeRO-0"]["rss"], color="gray", linestyle="--", linewidth=1, label="ZeRO-0 RSS")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("bytes per parameter (per rank)")
        ax.set_title(f"GPT 34.7M, fp32 AdamW, dp {dp}")
        ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_figure(figure, path)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--png", default="outputs/bench_memory.png")
    parser.add_argument("--pipeline", action="store_true",
                        help="also pp 2 x dp 2 ZeRO-3 with 2 and 8 micro-batches (model states must not grow)")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    shape = Shape(hidden=args.hidden, layers=args.layers)
    print(f"GPTModel fp32, {shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}, seq {shape.seq}: "
          f"{shape_numel(shape) / 1e6:.1f}M parameters; AdamW; {shape.micro_batches} micro-batches of "
          f"{shape.micro_batch} per step; {args.steps} steps each; {os.cpu_count()} CPU cores, gloo\n")
    results: dict[int, dict] = {}
    for dp in args.dp:
        print(f"dp {dp} (bytes per parameter, per rank; the largest rank)\n")
        print("| run | peak RSS | peak live | live: model states / activations | formula | RSS / ZeRO-0 "
              "| RSS / FSDP2 | step time (s) | time / FSDP2 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        rows = {}
        for name, stage, reshard in RUNS:
            with DistributedPool(dp) as pool:
                per_rank = pool.run(_measure, name, stage, reshard, shape, args.steps, timeout_s=1800)
            rows[name] = max(per_rank, key=lambda r: r["rss"])
        with DistributedPool(dp) as pool:
            per_rank = pool.run(_alternating_times, shape, args.steps, timeout_s=3600)
        for name in rows:
            rows[name]["time"] = max(times[name] for times in per_rank)
        results[dp] = rows
        for name, stage, _ in RUNS:
            row, fsdp, zero0 = rows[name], rows["FSDP2"], rows["ZeRO-0"]
            activations = row["breakdown"].get("activations", 0.0)
            ours = isinstance(stage, int)
            split = f"{row['live'] - activations:.1f} / {activations:.1f}" if ours else "-"
            formula = f"{FORMULA[stage](dp):.1f}" if ours else "-"
            # a peer's own buffers (DTensor views, DeepSpeed's flat buffers) can alias one memory from several
            # storages, which the live-storage counter then counts more than once: RSS is the measure for them
            live = f"{row['live']:.1f}" if ours else "-"
            print(f"| {name} | {row['rss']:.1f} | {live} | {split} | {formula} | "
                  f"{row['rss'] / zero0['rss']:.2f} | {row['rss'] / fsdp['rss']:.2f} | {row['time']:.2f} | "
                  f"{row['time'] / fsdp['time']:.2f} |")
        print()
    _chart(results, args.png)
    if args.pipeline:
        print("pp 2 x dp 2, ZeRO-3, 1F1B: peak live bytes per parameter of the stage (the largest dp rank)\n")
        print("| micro-batches | stage | model states (incl. gathered, grad buckets) | of which gathered "
              "| activations |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for m in (2, 8):
            with DistributedPool(4) as pool:
                per_rank = pool.run(_pipeline_peaks, shape, m, timeout_s=1800)
            for stage in (0, 1):
                row = max((r for r in per_rank if r["stage"] == stage), key=lambda r: r["states"])
                print(f"| {m} | {stage} | {row['states']:.2f} | {row['gathered']:.2f} | {row['activations']:.2f} |")


if __name__ == "__main__":
    main()
