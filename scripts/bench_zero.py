"""ZeRO memory and speed on gloo ranks of this machine.

1. Per-rank persistent model-state bytes (parameters + gradients + fp32 master weights + Adam states, from
   ``memory_report``) and the measured peak of live model-state tensors in the same step (persistent plus the
   transient gathered parameters and gradient buckets, from ``LiveMemoryTracker``; activations excluded) for
   ZeRO stages 0-3 at dp 2 and 4, against the ZeRO paper's mixed-precision Adam
   formula (Rajbhandari et al. 2019, Fig. 1, K = 12): 16, 4 + 12/dp, 2 + 14/dp, 16/dp bytes per parameter.
   Settings that match the paper: bf16 parameters and bf16 gradients (``grad_reduce_in_fp32=False``; with
   fp32 grads every stage holds 2 bytes/param more, or 2/dp more when grads are sharded), fp32 master weights
   and two fp32 Adam states (12 bytes). Bucket padding (< dp elements per bucket) is the only overhead of the
   persistent bytes. ``scripts/bench_memory.py`` measures whole runs (peak RSS and live bytes) on a GPT.
2. Step time (forward + backward + optimizer step) and peak RSS growth per rank of our ZeRO-3 against PyTorch
   FSDP2 (``torch.distributed.fsdp.fully_shard``, bf16 compute, fp32 sharded master parameters, bf16 reduce)
   on the same module, same gloo ranks and the same data.

    python scripts/bench_zero.py                     # options: --hidden 1024 --layers 8 --steps 10
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_core import initialize_model_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_optimizer, memory_report
from megatron_core.optimizer.memory import memory_categories
from megatron_core.testing import DistributedPool
from megatron_core.utils.live_memory import LiveMemoryTracker

PAPER = {0: lambda dp: 16.0, 1: lambda dp: 4 + 12 / dp, 2: lambda dp: 2 + 14 / dp, 3: lambda dp: 16 / dp}


def build(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])


def _memory(stage: int, hidden: int, layers: int) -> tuple[float, float]:
    """(persistent, measured peak live) model-state bytes per parameter of one step after the first."""
    state = initialize_model_parallel()
    model = build(hidden, layers).to(torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(
        zero_stage=stage, grad_reduce_in_fp32=False), dp_group=state.dp_group)
    optimizer = get_optimizer(OptimizerConfig(bf16=True), ddp, parallel_state=state)
    x = torch.randn(4, hidden, dtype=torch.bfloat16)
    ddp(x).float().square().mean().backward()
    optimizer.step()  # creates the Adam states
    optimizer.zero_grad()
    peak = [0]

    def model_states(sample: dict, _tracker) -> None:
        peak[0] = max(peak[0], sum(v for k, v in sample.items() if k != "activations"))

    with LiveMemoryTracker(categories=lambda: memory_categories(ddp, optimizer), on_sample=model_states):
        ddp(x).float().square().mean().backward()
        optimizer.step()
    return memory_report(ddp, optimizer).total / numel, peak[0] / numel


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


def _timed_steps(kind: str, hidden: int, layers: int, steps: int, batch: int) -> tuple[float, int]:
    """Per-rank seconds per step and peak RSS growth (bytes) from before the model was built."""
    state = initialize_model_parallel()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the peak-RSS mark (VmHWM)
    baseline = _rss("VmRSS:")
    model = build(hidden, layers)
    if kind == "zero3":
        model = DistributedDataParallel(model.to(torch.bfloat16), config=DistributedDataParallelConfig(
            zero_stage=3, grad_reduce_in_fp32=False), dp_group=state.dp_group)
        optimizer = get_optimizer(OptimizerConfig(bf16=True, clip_grad=0.0), model, parallel_state=state)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in model:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        optimizer.zero_grad()
        F.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return sum(times) / len(times), _rss("VmHWM:") - baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--time-dp", type=int, default=2, help="dp size of the timing comparison")
    args = parser.parse_args()
    numel = args.layers * (args.hidden * args.hidden + args.hidden)
    print(f"model: {args.layers} x Linear({args.hidden}, {args.hidden}) = {numel:,} parameters, bf16, Adam\n")
    print("| dp | stage | persistent bytes/param | paper bytes/param | ratio | measured peak of live model states |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for dp in (2, 4):
        with DistributedPool(dp) as pool:
            for stage in range(4):
                per_rank = pool.run(_memory, stage, args.hidden, args.layers)
                persistent, peak = max(p for p, _ in per_rank), max(m for _, m in per_rank)
                paper = PAPER[stage](dp)
                print(f"| {dp} | {stage} | {persistent:.3f} | {paper:.3f} | {persistent / paper:.4f} | {peak:.3f} |")
    print(f"\nstep time and peak RSS growth per rank, dp {args.time_dp}, batch {args.batch} per rank, "
          f"{args.steps} steps after 2 warm-up steps (each run in fresh processes)\n")
    print("| implementation | step time (ms) | peak RSS growth (MiB) |")
    print("| --- | ---: | ---: |")
    results = {}
    for kind in ("zero3", "fsdp2"):
        with DistributedPool(args.time_dp) as pool:
            per_rank = pool.run(_timed_steps, kind, args.hidden, args.layers, args.steps, args.batch)
        results[kind] = (max(t for t, _ in per_rank), max(m for _, m in per_rank))
        print(f"| {'megatron_core ZeRO-3' if kind == 'zero3' else 'PyTorch FSDP2'} | "
              f"{results[kind][0] * 1e3:.1f} | {results[kind][1] / 2**20:.1f} |")
    ratio = results["zero3"][0] / results["fsdp2"][0]
    print(f"\nZeRO-3 / FSDP2 step time: {ratio:.2f}x; peak memory: {results['zero3'][1] / results['fsdp2'][1]:.2f}x")


if __name__ == "__main__":
    main()
