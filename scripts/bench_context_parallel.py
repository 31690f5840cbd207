"""Activation memory per rank and step time of context parallelism (p2p ring, a2a Ulysses, allgather) at
cp 1, 2 and 4 on a real GPT forward-backward, ratios side by side in one run.

The model is ``GPTModel`` (fp32, rope, no dropout, small hidden so attention dominates), one micro-batch of
one sequence per step, on gloo ranks with one thread each. Per configuration and rank it measures:

- activation bytes: the peak live tensor bytes of one forward-backward that are neither parameters nor
  gradients (``LiveMemoryTracker``: saved activations and temporaries); the largest rank is reported, next
  to ``cp1 / cp`` (the issue's target: <= 1.1 x);
- step time: wall seconds of one forward-backward (the slowest rank's, from a barrier), the fastest of
  ``--steps``; and its compute seconds (``time.thread_time`` of the rank's one compute thread, which does
  not count waits for messages nor time the OS gives other processes; the busiest rank's).

The ideal compute split is ``cp1 / cp``: the cp-1 run of the framework's attention (PyTorch SDPA, a fused
C++ kernel) divided by cp, measured in the same round. Configurations run in ``--rounds`` rounds, each round
every configuration once in turn (cp1, cp1 blockwise, cp2 p2p, ...), and every ratio is a median over
rounds of the ratio within a round, so load from other work on a shared machine hits both sides alike.
"cp1 blockwise" is the ring's own block code on one rank (the compute p2p and allgather split). The ranks
share this machine's cores: with more ranks than cores the wall-time ratio measures the oversubscribed
machine (the compute-time ratio still measures the scheme); the header says so.

    python scripts/bench_context_parallel.py                          # seq 2k, 4k, 8k, 16k; cp 1, 2, 4
    python scripts/bench_context_parallel.py --seq 4096 --cp 2        # a quick look
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import CP_COMM_TYPES, TransformerConfig
from megatron_core.context_parallel import ring_attention, split_batch
from megatron_core.models import GPTModel
from megatron_core.planning.planner import Hardware, Layout, Workload, plan_layout
from megatron_core.testing import DistributedPool
from megatron_core.transformer import DotProductAttention, TransformerLayerSpec
from megatron_core.utils.live_memory import LiveMemoryTracker

VOCAB = 256


class BlockwiseAttention(DotProductAttention):
    """The ring's blockwise code on one rank (cp 1, no communication): the compute p2p splits."""

    def forward(self, query, key, value, attention_mask=None):
        return ring_attention(query, key, value, attention_mask, cp_group=None, cp_ranks=(0,), cp_rank=0,
                              scale=self.scale)


def _model(args: argparse.Namespace, state, cp: int, comm_type: str, seq: int) -> GPTModel:
    blockwise = comm_type == "blockwise"
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
                               context_parallel_size=cp,
                               cp_comm_type=comm_type if comm_type in CP_COMM_TYPES else "p2p")
    torch.manual_seed(0)
    spec = TransformerLayerSpec(core_attention=BlockwiseAttention) if blockwise else None
    return GPTModel(config, parallel_state=state, vocab_size=VOCAB, max_sequence_length=seq, layer_spec=spec)


def _measure(args: argparse.Namespace, cp: int, comm_type: str, seq: int, track: bool) -> dict:
    """One configuration on this rank: peak activation bytes of a tracked step (when ``track``), the fastest
    of ``args.steps`` untracked steps (wall seconds of the slowest rank, compute seconds of the busiest)."""
    torch.set_num_threads(1)
    state = initialize_model_parallel(context_parallel_size=cp)
    try:
        model = _model(args, state, cp, comm_type, seq)
        tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(1))
        batch = split_batch({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                             "position_ids": torch.arange(seq).unsqueeze(0)}, cp_size=cp, cp_rank=state.cp_rank)

        def step() -> None:
            model(batch["tokens"], batch["position_ids"], labels=batch["labels"]).mean().backward()

        step()  # warm-up; creates the grads, which the tracker then counts as gradients
        params = list(model.parameters())
        tracker = LiveMemoryTracker(categories=lambda: [("parameters", p) for p in params]
                                    + [("gradients", p.grad) for p in params if p.grad is not None])
        with tracker if track else contextlib.nullcontext():
            step()
        walls, computes = [], []
        for _ in range(args.steps):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            step()
            elapsed = torch.tensor([time.perf_counter() - start, time.thread_time() - start_cpu])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            walls.append(float(elapsed[0]))
            computes.append(float(elapsed[1]))
        activations = tracker.peak_by_category["activations"] if track else None
        return {"activations": activations, "time": min(walls), "compute": min(computes)}
    finally:
        destroy_model_parallel(state)


def _machine_rates() -> dict:
    """This machine as the planner sees it, measured on the calling rank: the fp32 matmul rate of one thread
    in thread time (the planner's peak, efficiency 1; compare its step times with the compute column) and
    the send/recv bandwidth between two gloo ranks (cp's link)."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    tflops = 0.0
    for _ in range(5):  # thread time, the best of 5: the rate of this thread whatever else the machine runs
        start = time.thread_time()
        for _ in range(10):
            a @ b
        tflops = max(tflops, 10 * 2 * 512**3 / (time.thread_time() - start) / 1e12)
    x = torch.zeros(4 * 2**20 // 4)
    seconds = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        (dist.send if dist.get_rank() == 0 else dist.recv)(x, 1 - dist.get_rank())
        seconds.append(time.perf_counter() - start)
    return {"tflops": tflops, "gbps": x.numel() * 4 / statistics.median(seconds) / 1e9}


def _planner_seconds(args: argparse.Namespace, rates: dict, seq: int, cp: int, kind: str) -> float:
    """The planner's step time of this row (``plan_layout`` at tp 1, dp 1, cp ``cp``) on ``rates``."""
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               position_embedding_type="rope", max_position_embeddings=seq,
                               cp_comm_type=kind if kind in CP_COMM_TYPES else "p2p")
    workload = Workload(vocab_size=VOCAB, seq_length=seq, micro_batch_size=1, global_batch_size=1,
                        make_vocab_size_divisible_by=1)
    hardware = Hardware(num_devices=cp, memory_per_device_gb=1, peak_tflops=rates["tflops"], compute_efficiency=1.0,
                        intra_node_bandwidth_gbps=rates["gbps"])
    return plan_layout(config, workload, hardware, Layout(1, 1, 1, None, 0, False, None, cp)).step_seconds


def _runs(cps: list[int]) -> list[tuple[int, str]]:
    return [(1, "sdpa"), (1, "blockwise")] + [(cp, kind) for cp in cps if cp > 1 for kind in CP_COMM_TYPES]


def _measure_seq(args: argparse.Namespace, pools: dict[int, DistributedPool], seq: int) -> dict:
    """``{(cp, kind): {"activations": bytes, "rounds": [per-round results]}}`` for one sequence length."""
    results: dict = {run: {"rounds": []} for run in _runs(args.cp)}
    for round_index in range(args.rounds):
        for cp, kind in _runs(args.cp):
            per_rank = pools[cp].run(_measure, args, cp, kind, seq, round_index == 0, timeout_s=3600)
            if round_index == 0:
                results[(cp, kind)]["activations"] = max(r["activations"] for r in per_rank)
            results[(cp, kind)]["rounds"].append(per_rank[0])
    return results


def _row(seq: int, cp: int, kind: str, results: dict, planner: dict) -> str:
    """One table row: memory, the median per-round ratios against the same round's cp1 runs, and the
    planner's step time (``planner[(cp, kind)]``) with its ratio to cp1 / cp."""
    mine, sdpa, blockwise = results[(cp, kind)], results[(1, "sdpa")], results[(1, "blockwise")]

    def ratio(key: str, baseline: dict) -> float:
        return statistics.median(r[key] / (b[key] / cp) for r, b in zip(mine["rounds"], baseline["rounds"]))

    wall = statistics.median(r["time"] for r in mine["rounds"])
    compute = statistics.median(r["compute"] for r in mine["rounds"])
    return (f"| {seq} | {cp} | {kind} | {mine['activations'] / 2**20:.1f} | "
            f"{mine['activations'] / (sdpa['activations'] / cp):.2f} | {wall:.3f} | {ratio('time', sdpa):.2f} | "
            f"{ratio('time', blockwise):.2f} | {compute:.3f} | {ratio('compute', sdpa):.2f} | "
            f"{planner[(cp, kind)]:.3f} | {planner[(cp, kind)] / (planner[(1, 'sdpa')] / cp):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration and round (fastest)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median of the ratios)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"GPTModel fp32, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, rope, batch 1; gloo, "
          f"1 thread per rank, {cores} CPU cores (load average {os.getloadavg()[0]:.1f}); {args.rounds} alternating "
          f"rounds, best of {args.steps} steps each; wall-time ratios above cp {cores} measure oversubscribed "
          "cores\n")
    print("| seq | cp | attention | activations / rank (MiB) | / (cp1 / cp) | step (s) | / (cp1 / cp) "
          "| / (cp1 blockwise / cp) | compute (s) | / (cp1 / cp) | planner (s) | / (cp1 / cp) |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with contextlib.ExitStack() as stack:
        pools = {cp: stack.enter_context(DistributedPool(cp, timeout_s=1800)) for cp in sorted({1, 2, *args.cp})}
        rates = pools[2].run(_machine_rates)[0]
        for seq in args.seq:
            results = _measure_seq(args, pools, seq)
            planner = {(cp, kind): _planner_seconds(args, rates, seq, cp, kind) for cp, kind in _runs(args.cp)}
            for cp, kind in _runs(args.cp):
                print(_row(seq, cp, kind, results, planner), flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}; planner on this machine: fp32 matmul "
          f"{rates['tflops'] * 1e3:.1f} GFLOP/s (1 thread, efficiency 1), gloo send/recv {rates['gbps']:.2f} GB/s")


if __name__ == "__main__":
    main()
