"""Our 1F1B / zero-bubble (ZB-H1) / interleaved 1F1B against torch.distributed.pipelining (Schedule1F1B,
ScheduleInterleavedZeroBubble with one stage per rank, ScheduleInterleaved1F1B) on the same GPT, micro-batches
and gloo ranks, side by side in one run.

    python scripts/bench_pipeline.py [--pp 2 --microbatches 8 --layers 8 --hidden 128 --seq 128 --steps 3]

Rows: each of our schedules against torch's same schedule (our ZB-H1 against torch's zero bubble), and our
zero bubble as it runs on CPU (the "cooldown" split) against torch's 1F1B, the schedule of the same memory a
user of torch pipelining runs by default. (The cooldown split has no formula of its own: the 1F1B formula is
shown.)

Steps of ours and torch's alternate in the same ranks (a barrier before each). Prints the median step time
of each schedule and its ratio to torch's; our measured bubble (mean over ranks of the per-step median) next
to the bubble replayed from the measured pass times (``simulate``: free transfers, no overhead) and the
formula (p-1)/(v*m); the ratio of CPU time per step (all ranks' processes, all threads: little disturbed by
other jobs on a shared machine); and each rank's peak resident memory (RSS, both schedules' models). Ranks
are forked gloo processes on this machine (megatron_core.testing), one thread each, each bound to a core of its
own (``--bind-cores-to-rank``: a rank's gloo thread then takes time from its own compute only, which turns
the last stage's 1.4-3 ms gradient sends, blocked while the first stage's receiving thread waited for a
core, into 0.2 ms); the model runs its torch reference kernels.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.models import GPTModel
from megatron_core.pipeline_parallel import Timeline, get_forward_backward_func
from megatron_core.pipeline_parallel.schedule_plan import (
    ZERO_BUBBLE_DEFER,
    bubble_fraction_formula,
    interleaved_ops,
    one_f_one_b_ops,
    simulate,
    zero_bubble_ops,
)
from megatron_core.pipeline_parallel.timeline import COMPUTE
from megatron_core.testing import run_distributed
from megatron_core.utils.affinity import bind_cores_to_rank

VOCAB = 512
# (row name, our schedule: "1f1b" | "all" | "cooldown" (zero bubble, zero_bubble_defer) | "interleaved",
#  torch's schedule class name)
ROWS = (("1F1B", "1f1b", "Schedule1F1B"),
        ("zero bubble ZB-H1", "all", "ScheduleInterleavedZeroBubble"),
        ("zero bubble, cooldown", "cooldown", "Schedule1F1B"),
        ("interleaved 1F1B (v={vpp})", "interleaved", "ScheduleInterleaved1F1B"))


def _config(args, pp: int, vpp) -> TransformerConfig:
    return TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                             max_position_embeddings=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)


def _chunks(args, state, vpp) -> list[GPTModel]:
    chunks = []
    for vp in range(vpp or 1):
        torch.manual_seed(0)
        first = state.is_first_model_chunk(vp) if vpp else state.is_pipeline_first_stage
        last = state.is_last_model_chunk(vp) if vpp else state.is_pipeline_last_stage
        chunks.append(GPTModel(_config(args, state.pp_size, vpp), parallel_state=state, vocab_size=VOCAB,
                               max_sequence_length=args.seq, pre_process=first, post_process=last,
                               vp_stage=vp if vpp else None, share_embeddings_and_output_weights=False))
    return chunks


def _batch(args):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (args.micro_batch * args.microbatches, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _our_step(args, state, vpp, zero_bubble=False, defer=None):
    """A function running one step of our schedule on this rank; it returns that step's Timeline."""
    chunks = _chunks(args, state, vpp)
    tokens, labels = _batch(args)
    positions = torch.arange(args.seq).expand(args.micro_batch, args.seq)
    micro = [(t, lab) for t, lab in zip(tokens.split(args.micro_batch), labels.split(args.micro_batch))]

    def forward_step(iterator, model):
        t, lab = next(iterator)
        return model(t, positions, labels=lab), lambda loss: (loss.mean(), {"lm loss": loss.mean().detach()})

    schedule = get_forward_backward_func(state.pp_size, vpp, zero_bubble=zero_bubble, zero_bubble_defer=defer)

    def step() -> Timeline:
        timeline = Timeline()
        schedule(forward_step_func=forward_step, data_iterator=[iter(micro) for _ in chunks] if vpp else iter(micro),
                 model=chunks if vpp else chunks[0], num_microbatches=args.microbatches, seq_length=args.seq,
                 micro_batch_size=args.micro_batch, parallel_state=state, timeline=timeline)
        return timeline
    return step


class _TorchStage(nn.Module):
    """Adapts one GPTModel chunk to torch.distributed.pipelining: tensors in, tensors out."""

    def __init__(self, model: GPTModel, seq: int, micro_batch: int) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("positions", torch.arange(seq).expand(micro_batch, seq).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.model.pre_process:
            return self.model(x, self.positions)
        self.model.set_input_tensor(x)
        return self.model(None, self.positions)  # hidden [s, b, h], or logits [b, s, V] on the last stage


def _torch_step(args, state, vpp, schedule_name):
    """A function running one step of torch.distributed.pipelining's ``schedule_name`` on this rank."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    chunks = _chunks(args, state, vpp)
    p, v = state.pp_size, vpp or 1
    stages = [PipelineStage(_TorchStage(chunk, args.seq, args.micro_batch), state.pp_rank + vp * p, p * v,
                            torch.device("cpu"), group=state.pp_group) for vp, chunk in enumerate(chunks)]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    schedule_class = getattr(pipelining, schedule_name)
    multi_stage = issubclass(schedule_class, pipelining.schedules.PipelineScheduleMulti)
    schedule = schedule_class(stages if multi_stage else stages[0], args.microbatches, loss_fn=loss_fn)
    tokens, labels = _batch(args)

    def step() -> None:
        if state.is_pipeline_first_stage:
            schedule.step(tokens)
        elif state.is_pipeline_last_stage:
            schedule.step(target=labels, losses=[])
        else:
            schedule.step()
    return step


def _one_core_per_rank() -> None:
    """One thread per rank, each rank (and its gloo threads) bound to a core share of its own."""
    torch.set_num_threads(1)
    bind_cores_to_rank(dist.get_rank(), dist.get_world_size())


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ours(args, state, kind: str):
    """Our schedule ``kind`` (a ``ROWS`` kind) as a step function."""
    zero_bubble = kind in ZERO_BUBBLE_DEFER
    return _our_step(args, state, args.vpp if kind == "interleaved" else None, zero_bubble=zero_bubble,
                     defer=kind if zero_bubble else None)


def _bench(which: str, args, vpp, zero_bubble: bool = False):
    """One schedule alone ("ours" or "torch"), as scripts/benchmark.py runs it: (median s/step, our measured
    bubble or None, peak RSS MB). Torch runs Schedule1F1B (ScheduleInterleaved1F1B with vpp)."""
    _one_core_per_rank()
    state = initialize_model_parallel(pipeline_model_parallel_size=dist.get_world_size(),
                                      virtual_pipeline_model_parallel_size=vpp)
    step = (_our_step(args, state, vpp, zero_bubble) if which == "ours" else
            _torch_step(args, state, vpp, "ScheduleInterleaved1F1B" if vpp else "Schedule1F1B"))
    times, bubbles = [], []
    for _ in range(args.steps + 1):  # the first step warms up
        start = time.perf_counter()
        timeline = step()
        times.append(time.perf_counter() - start)
        bubbles.append(timeline.measured_bubble() if timeline is not None else None)
    destroy_model_parallel(state)
    return statistics.median(times[1:]), bubbles[-1], _peak_rss_mb()


def _bench_alternating(args, kind: str, torch_schedule: str):
    """Alternates one step of our ``kind`` and one of torch's ``torch_schedule`` (after a warm-up step of
    each); a barrier before each step lines the ranks up. Returns (our median s/step, torch's, our median
    measured bubble, our bubble replayed from the measured passes, peak RSS MB, our and torch's median CPU
    s/step of this process)."""
    _one_core_per_rank()
    vpp = args.vpp if kind == "interleaved" else None
    state = initialize_model_parallel(pipeline_model_parallel_size=dist.get_world_size(),
                                      virtual_pipeline_model_parallel_size=vpp)
    ours, theirs = _ours(args, state, kind), _torch_step(args, state, vpp, torch_schedule)
    our_times, their_times, bubbles, our_cpu, their_cpu = [], [], [], [], []
    for index in range(args.steps + 1):  # the first step of each warms up
        dist.barrier(group=state.pp_group)
        start, cpu = time.perf_counter(), time.process_time()
        timeline = ours()
        our_times.append(time.perf_counter() - start)
        our_cpu.append(time.process_time() - cpu)
        bubbles.append((timeline.measured_bubble(), _replayed_bubble(timeline, state, kind, args)))
        dist.barrier(group=state.pp_group)
        start, cpu = time.perf_counter(), time.process_time()
        theirs()
        their_times.append(time.perf_counter() - start)
        their_cpu.append(time.process_time() - cpu)
    destroy_model_parallel(state)
    return (statistics.median(our_times[1:]), statistics.median(their_times[1:]),
            statistics.median(b[0] for b in bubbles[1:]), statistics.median(b[1] for b in bubbles[1:]),
            _peak_rss_mb(), statistics.median(our_cpu[1:]), statistics.median(their_cpu[1:]))


def _replayed_bubble(timeline: Timeline, state, kind: str, args) -> float:
    """The bubble this rank would have with the passes as long as measured (every rank's) but free
    transfers and no per-pass overhead: ``simulate`` of the schedule's orders. The gap between it and the
    measured bubble is what communication and the executor cost; the gap between it and the formula is
    stage imbalance (embedding on the first stage, output layer and loss on the last) and B != 2 F."""
    mine = {(e.kind[0].upper(), e.chunk or 0, e.microbatch): e.end - e.start
            for e in timeline.events if e.kind in COMPUTE}
    everyone: list = [None] * state.pp_size
    dist.all_gather_object(everyone, mine, group=state.pp_group)
    durations = {(rank, *key): value for rank, passes in enumerate(everyone) for key, value in passes.items()}
    p, m = state.pp_size, args.microbatches
    v = args.vpp if kind == "interleaved" else 1
    if kind in ZERO_BUBBLE_DEFER:
        orders = [zero_bubble_ops(r, p, m, defer=kind) for r in range(p)]
    elif kind == "interleaved":
        orders = [interleaved_ops(r, p, v, m) for r in range(p)]
    else:
        orders = [one_f_one_b_ops(r, p, m) for r in range(p)]
    finish = simulate(orders, v, durations=durations)[state.pp_rank]
    compute = sum(mine.values())
    return (finish - compute) / compute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("pp", 2), ("microbatches", 8), ("micro-batch", 2), ("layers", 8), ("hidden", 128),
                          ("seq", 128), ("steps", 3), ("vpp", 2)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args()
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}; pp={args.pp}, {args.microbatches} "
          f"micro-batches of {args.micro_batch}; gloo on this machine, 1 thread per rank")
    print(f"{'ours':<28}{'torch':<31}{'ours s':>8}{'torch s':>9}{'ours/torch':>11}{'bubble':>8}{'replayed':>9}"
          f"{'formula':>9}{'CPU ours/torch':>16}{'RSS MB/rank':>12}")
    for name, kind, torch_schedule in ROWS:
        try:
            results = run_distributed(args.pp, _bench_alternating, args, kind, torch_schedule, timeout_s=600)
        except Exception as error:  # noqa: BLE001 - a peer schedule this torch lacks or refuses: say so, go on
            print(f"{name.format(vpp=args.vpp):<28}{torch_schedule:<31}failed: {type(error).__name__}: "
                  f"{str(error).splitlines()[0][:120]}")
            continue
        ours_t, theirs_t = max(r[0] for r in results), max(r[1] for r in results)
        bubble, replayed = statistics.mean(r[2] for r in results), statistics.mean(r[3] for r in results)
        rss = " ".join(f"{r[4]:.0f}" for r in results)
        cpu = sum(r[5] for r in results) / sum(r[6] for r in results)
        formula = bubble_fraction_formula(args.pp, args.microbatches, args.vpp if kind == "interleaved" else None,
                                          zero_bubble=kind == "all")
        print(f"{name.format(vpp=args.vpp):<28}{torch_schedule:<31}{ours_t:>8.3f}{theirs_t:>9.3f}"
              f"{ours_t / theirs_t:>11.2f}{bubble:>8.3f}{replayed:>9.3f}{formula:>9.3f}{cpu:>16.2f}{rss:>12}")


if __name__ == "__main__":
    main()
