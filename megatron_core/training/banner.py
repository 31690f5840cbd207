"""How a run introduces itself (rank 0 prints; every rank takes part in the small gathers):

* at start: the layout (tp / cp / pp / vpp / dp, ep, ZeRO stage, world size, nodes), the groups rank 0 belongs
  to, the parameters held by each model-parallel rank, the planner's predicted peak memory per pipeline stage
  and the data (samples, tokens, epochs of the corpus);
* at the end: each stage's measured peak memory next to that prediction.

The measurement is the peak of live tensor bytes: on CUDA ``torch.cuda.max_memory_allocated`` over the whole
run; on the CPU a ``LiveMemoryTracker`` over the second training step (the first one with optimizer states;
the first when the run has one step), which slows that one step down. The peak resident set of the process is
printed beside it (it also holds the interpreter, the libraries and the allocator's caches).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator, Optional

import torch.distributed as dist

from megatron_core.fp8.config import fp8_runs_emulated
from megatron_core.optimizer.memory import MemoryCategories
from megatron_core.pipeline_parallel.schedule_plan import resolve_zero_bubble_defer
from megatron_core.pipeline_parallel.schedules import pipeline_tensor_shape
from megatron_core.planning.planner import (
    Workload,
    grad_bytes_of,
    model_state_bytes,
    rank_activation_bytes,
    rank_peak_extra_bytes,
)
from megatron_core.training.metrics import memory_bytes
from megatron_core.utils.live_memory import LiveMemoryTracker, peak_rss_bytes

MIB = 2**20


def _gather(value: Any) -> list:
    """``value`` from every rank, in rank order (all-gather; a list of one without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def _zero_bubble_defer(run) -> Optional[str]:
    """The split the run's zero-bubble schedule uses (None without ``--enable-zero-bubble``)."""
    if not run.args.enable_zero_bubble:
        return None
    return resolve_zero_bubble_defer(run.args.zero_bubble_defer, run.state.device.type)


def predicted_stage_bytes(run) -> dict[str, float]:
    """The planner's bytes for this rank's pipeline stage: model states, activations, the transients that
    coexist with them at the peak moment (``planning.peak_phases``), and on gloo the p2p buffers a CPU pipeline
    stage holds (``gloo_p2p_bytes``)."""
    args, config = run.args, run.config
    workload = Workload(vocab_size=run.tokenizer.vocab_size, seq_length=args.seq_length,
                        micro_batch_size=args.micro_batch_size, global_batch_size=run.global_batch,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                        mask_bytes=1 if run.state.device.type == "cuda" else (2 if (config.bf16 or config.fp16) else 4),
                        grad_bytes=grad_bytes_of(args))
    zero = getattr(args, "zero_stage", 0) or 0
    pp_rank, experts = run.state.pp_rank, dict(ep=run.state.ep_size, etp=run.state.etp_size)
    parts = {"model states": model_state_bytes(config, workload, pp_rank=pp_rank, dp=run.state.dp_cp_size,
                                               zero_stage=zero, **experts,
                                               instances=run.state.num_distributed_optimizer_instances),
             "activations": rank_activation_bytes(config, workload, pp_rank=pp_rank, **experts,
                                                  num_microbatches=run.num_microbatches,
                                                  zero_bubble_defer=_zero_bubble_defer(run)),
             "transients": rank_peak_extra_bytes(config, workload, pp_rank=pp_rank, zero_stage=zero, **experts)}
    held = gloo_p2p_bytes(run)
    return {**parts, "gloo p2p buffers": held} if held else parts


def gloo_p2p_bytes(run) -> float:
    """What a pipeline stage on gloo (a CPU run) also holds at its peak, which the planner's GPU model does not:
    the stage outputs and input gradients it sent in this step (gloo reports a send complete only on ``wait``,
    so ``pipeline_parallel.p2p`` drops them at the end of the schedule; NCCL as they complete) and the two
    receives posted ahead. 1F1B stage r peaks at its last steady forward, holding m sends downstream (not the
    last stage) and m - w - 1 upstream (not the first; w = pp - r - 1 warmup forwards); interleaved and
    zero-bubble schedules count every send of the step (an upper bound). Each is ``[s/cp (/tp with SP), b, h]``
    in the params dtype (``schedules.pipeline_tensor_shape``). 0 on CUDA or without pipelining."""
    state, args = run.state, run.args
    pp, rank, m = state.pp_size, state.pp_rank, run.num_microbatches
    if state.device.type == "cuda" or pp == 1:
        return 0.0
    shape, dtype = pipeline_tensor_shape(run.chunks[0], args.seq_length, args.micro_batch_size)
    tensor = math.prod(shape) * dtype.itemsize
    first, last = rank == 0, rank == pp - 1
    if state.vpp_size or _zero_bubble_defer(run):
        sends = m * (state.vpp_size or 1) * 2 - m * first - m * last
    else:
        sends = m * (not last) + max(m - min(pp - rank - 1, m) - 1, 0) * (not first)
    return (sends + 2) * tensor


def _corpus_tokens(dataset) -> Optional[int]:
    """Tokens in one epoch of a GPT dataset's documents (summed over a blend); None when unknown."""
    if dataset is None:
        return None
    if hasattr(dataset, "datasets"):
        parts = [_corpus_tokens(d) for d in dataset.datasets]
        return None if any(p is None for p in parts) else sum(parts)
    indexed, documents = getattr(dataset, "dataset", None), getattr(dataset, "documents", None)
    lengths = getattr(indexed, "sequence_lengths", None)
    if lengths is None or documents is None:
        return None
    return int(lengths[documents].astype("int64").sum())


def _data_line(run) -> str:
    args = run.args
    tokens = args.train_iters * run.global_batch * args.seq_length
    line = (f" data: {args.train_iters} iterations x global batch {run.global_batch} x seq {args.seq_length} = "
            f"{tokens:,} training tokens")
    corpus = _corpus_tokens(run.train_dataset)
    if corpus:
        line += f"; training split {corpus:,} tokens, {tokens / corpus:.2f} epochs"
    if run.valid_dataset is not None:
        line += f"; validation {args.eval_iters} x {run.global_batch} samples every {args.eval_interval} iterations"
    return line


def start_banner(run) -> Optional[str]:
    """The start banner on rank 0 (None elsewhere); collective (every rank calls it)."""
    state, args = run.state, run.args
    mp_params = _gather((state.pp_rank, state.tp_rank, state.dp_rank, state.cp_rank, run.local_parameters))
    predict = predicted_stage_bytes(run)
    per_stage = _gather((state.pp_rank, sum(predict.values()), predict))
    if state.rank != 0:
        return None
    nodes = max(1, state.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", state.world_size)))
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if run.config.fp8 is not None:  # the planner line below counts FP8's 1-byte saved inputs (planning/fp8.py)
        fp8, where = run.config.fp8, "emulated" if fp8_runs_emulated() else "tensor cores"
        precision += f" + fp8 {fp8.fp8_format} {fp8.fp8_recipe} ({where})"
    lines = [f"megatron_core: {state.describe()} on {nodes} node(s) | ZeRO stage {getattr(args, 'zero_stage', 0)} | "
             f"{precision} | {run.num_microbatches} micro-batches of {args.micro_batch_size} per step per dp rank"]
    groups = [f"tp {list(state.tp_ranks)}", f"cp {list(state.cp_ranks)}", f"dp {list(state.dp_ranks)}",
              f"pp {list(state.pp_ranks)}"]
    if state.ep_size > 1:
        groups += [f"ep {list(state.ep_ranks)}", f"expert-dp {list(state.expert_dp_ranks)}"]
    lines.append(" groups of rank 0: " + " | ".join(groups))
    counts = {(pp, tp): n for pp, tp, dp, cp, n in mp_params if dp == 0 and cp == 0}
    per_rank = ", ".join(f"pp {pp} tp {tp}: {_count(n)}" for (pp, tp), n in sorted(counts.items()))
    lines.append(f" parameters per model-parallel rank: {per_rank} (sum {_count(sum(counts.values()))}, "
                 "tied embeddings counted on each stage that holds them)")
    stages = {pp: (total, parts) for pp, total, parts in per_stage}
    for pp, (total, parts) in sorted(stages.items()):
        detail = ", ".join(f"{name} {value / MIB:.1f}" for name, value in parts.items())
        lines.append(f" planner: pp stage {pp} predicted peak {total / MIB:.1f} MiB per rank ({detail} MiB)")
    lines.append(_data_line(run))
    return "\n".join(lines)


@contextlib.contextmanager
def memory_probe(run, iteration: int) -> Iterator[None]:
    """Wraps training step ``iteration`` (counted from 1 in this process): on the CPU the second step (the
    first when there is only one) runs under a ``LiveMemoryTracker`` and its peak is kept in
    ``run.measured_peak_bytes``; elsewhere and on CUDA nothing is done. The tracker samples only after ops that
    create a storage, run a collective or write into a fresh or category storage (``every_op=False``), where a
    peak can be reached: the same peaks as a scan after every op (six layouts, byte for byte); whole runs
    1.2-1.8x faster (two runs per mode). A creation is sampled only when a new peak is possible: the MoE test's
    probed step takes 271 samples instead of 776 (``scripts/bench_tracker.py``)."""
    probe = run.state.device.type != "cuda" and iteration == min(2, run.args.train_iters)
    if not probe:
        yield
        return
    with LiveMemoryTracker(categories=MemoryCategories(run.chunks, run.optimizer), every_op=False) as tracker:
        yield
    run.measured_peak_bytes = tracker.peak_total


def end_report(run) -> Optional[str]:
    """Each pipeline stage's measured peak (the fullest rank of the stage) next to its prediction, on rank 0;
    collective."""
    state = run.state
    cuda = state.device.type == "cuda"
    measured = memory_bytes(state.device) if cuda else run.measured_peak_bytes
    rows = _gather((state.pp_rank, measured, sum(predicted_stage_bytes(run).values()), peak_rss_bytes()))
    if state.rank != 0 or any(m is None for _, m, _, _ in rows):
        return None
    what = "peak allocated" if cuda else "peak live tensors (second step)"
    lines = []
    for pp in sorted({r[0] for r in rows}):
        peak = max(m for p, m, _, _ in rows if p == pp)
        predicted = next(q for p, _, q, _ in rows if p == pp)
        rss = max(r for p, _, _, r in rows if p == pp)
        lines.append(f" memory: pp stage {pp} {what} {peak / MIB:.1f} MiB, planner predicted {predicted / MIB:.1f} "
                     f"MiB (measured / predicted {peak / max(predicted, 1):.2f}); process peak RSS {rss / MIB:.0f} MiB")
    return "\n".join(lines)
