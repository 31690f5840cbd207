"""One rank of a dry run: joins a fake world, builds the run exactly as ``pretrain_gpt.py`` does and trains
``--steps`` steps on fake CUDA tensors; writes what it measured as JSON.

Run by ``tools/dry_run.py`` as ``python megatron_core/dryrun/fake_cuda.py TARGET --rank R --world-size W
--output-json FILE -- <pretrain_gpt.py flags>`` (the fake CUDA hooks must load before torch). The process group
is torch's ``fake`` backend (collectives return at once, their outputs untouched), so one process plays rank R
of a world of W. The run's own code builds the layout, the model (``layer_spec_for``), the data-parallel
wrapper, the optimizer and the schedule; the data is ``--mock-data`` (shapes are what matter); checkpoints,
evaluation and the banner's object gathers are off. Triton launches are captured (``capture_launches``), and
with ``--compile-kernels sm_90`` compiled for that target.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_core.dryrun.modes import CollectiveRecorder, FakeCudaMode, FlopCounter
from megatron_core.optimizer.memory import MemoryCategories
from megatron_core.planning.planner import Workload, stage_expert_parameters, stage_parameters
from megatron_core.training.arguments import parse_args
from megatron_core.training.banner import predicted_stage_bytes
from megatron_core.training.data import micro_batches, take
from megatron_core.training.loop import build_run, train_step
from megatron_core.utils import accelerator
from megatron_core.utils.live_memory import LiveMemoryTracker

IGNORED_FLAGS = ("--data-path", "--save", "--load", "--train-iters", "--train-samples", "--eval-iters",
                 "--tensorboard-dir", "--wandb-project", "--metrics-file")
"""Flags whose value the dry run replaces (mock data, no checkpoints, ``--steps`` iterations, no evaluation)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron_core.dryrun.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--output-json", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--compile-kernels", default=None, help="sm_80 / sm_90 / sm_100: compile the captured launches")
    return p


def strip_ignored(flags: Sequence[str]) -> list[str]:
    """``flags`` without the ones in ``IGNORED_FLAGS`` (and their values)."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            if not flag.startswith("--"):
                continue
        name = flag.split("=", 1)[0]
        if name in IGNORED_FLAGS:
            skip = "=" not in flag
            continue
        out.append(flag)
    return out


def _exact_parameters(run) -> float:
    """The planner's closed-form count of this rank's parameters (dense shard plus its experts)."""
    args, config, state = run.args, run.config, run.state
    workload = Workload(vocab_size=run.tokenizer.vocab_size, seq_length=args.seq_length,
                        micro_batch_size=args.micro_batch_size, global_batch_size=run.global_batch,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    dense, _ = stage_parameters(config, workload, pp_rank=state.pp_rank)
    experts = stage_expert_parameters(config, pp_rank=state.pp_rank, ep=state.ep_size, etp=state.etp_size) \
        if config.moe is not None else 0.0
    return dense + experts


def _train(run, steps: int, recorder: CollectiveRecorder) -> dict:
    """``steps`` training steps under the memory tracker (peak over all), FLOPs and collectives of the last."""
    iterator = micro_batches(run.train_dataset, consumed_samples=0, state=run.state,
                             micro_batch_size=run.args.micro_batch_size, device=run.state.device)
    tracker = LiveMemoryTracker(categories=MemoryCategories(run.chunks, run.optimizer), device_type="cuda",
                                every_op=False)
    step_seconds = []
    with run.state.kernel_backend.capture_launches() as launches, tracker:
        for step in range(steps):
            batches = take(iterator, run.num_microbatches)
            last = step == steps - 1
            if last:
                recorder.seen.clear()
                counter = FlopCounter()
            begin = time.perf_counter()
            with counter if last else contextlib.nullcontext():
                train_step(run, batches)
            step_seconds.append(time.perf_counter() - begin)
    return {"tracker": tracker, "launches": list(launches), "flops": counter.total,
            "step_seconds": step_seconds}


def _compile(launches: list, target: Optional[str]) -> Optional[dict]:
    if not target:
        return None
    from kernels.aot import compile_launch, unique
    capability = int(target.removeprefix("sm_"))
    distinct = unique(launches)
    sizes = [len(compile_launch(launch, capability).asm["cubin"]) for launch in distinct]
    return {"target": target, "kernels": len(distinct), "cubin_bytes": sum(sizes),
            "names": sorted({launch[0].fn.__qualname__ for launch in distinct})}


def dry_run_rank(opts: argparse.Namespace, flags: Sequence[str]) -> dict:
    """The measurements of rank ``opts.rank`` (see the module docstring)."""
    os.environ.update(RANK=str(opts.rank), WORLD_SIZE=str(opts.world_size),
                      LOCAL_RANK=str(opts.rank % opts.gpus_per_node), LOCAL_WORLD_SIZE=str(opts.gpus_per_node))
    # torch's fake backend (torch.testing._internal.distributed.fake_pg registers it); an in-memory store, which
    # unlike fake_pg's FakeStore answers the pipeline's peer-failure checks (nobody fails)
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    dist.init_process_group("fake", store=dist.HashStore(), rank=opts.rank, world_size=opts.world_size)
    args = parse_args(strip_ignored(flags) + ["--mock-data", "--train-iters", str(opts.steps), "--eval-iters", "0"])
    begin = time.perf_counter()
    fake, recorder = FakeCudaMode(), CollectiveRecorder()
    with fake, recorder:
        run = build_run(args, announce=False)
        build_seconds = time.perf_counter() - begin
        trained = _train(run, opts.steps, recorder)
    tracker, state = trained["tracker"], run.state
    predicted = predicted_stage_bytes(run)
    return {
        "rank": opts.rank, "world_size": opts.world_size, "layout": state.describe(),
        "coordinates": {"tp": state.tp_rank, "pp": state.pp_rank, "dp": state.dp_rank, "cp": state.cp_rank,
                        "ep": getattr(state, "ep_rank", 0)},
        "device": {"type": state.device.type, "simulated": accelerator.device_name()},
        "parameters": run.local_parameters, "parameters_exact": _exact_parameters(run),
        "num_microbatches": run.num_microbatches, "steps": opts.steps,
        "peak_bytes": tracker.peak_total, "peak_breakdown": dict(tracker.peak_breakdown),
        "peak_by_category": dict(tracker.peak_by_category),
        "predicted_bytes": sum(predicted.values()), "predicted_breakdown": predicted,
        "flops_per_step": trained["flops"], "collectives_per_step": recorder.summary(),
        "kernel_launches": len(trained["launches"]),
        "compiled_kernels": _compile(trained["launches"], opts.compile_kernels),
        "scalar_reads": fake.scalar_reads,
        "seconds": {"build": build_seconds, "steps": trained["step_seconds"],
                    "total": time.perf_counter() - begin},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    opts = _parser().parse_args(argv[:split])
    result = dry_run_rank(opts, argv[split + 1:])
    partial = opts.output_json + ".tmp"
    with open(partial, "w") as handle:
        json.dump(result, handle, indent=1, default=str)
    os.replace(partial, opts.output_json)
    return 0
