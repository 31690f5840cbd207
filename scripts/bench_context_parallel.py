"""Activation memory per rank and step time of context parallelism (p2p ring, a2a Ulysses, allgather) at
cp 1, 2 and 4 on a real GPT forward-backward, ratios side by side in one run.

The model is ``GPTModel`` (fp32, rope, no dropout, small hidden so attention dominates), one micro-batch of
one sequence per step, on gloo ranks with one thread each. Per configuration and rank it measures:

- activation bytes: the peak live tensor bytes of one forward-backward that are neither parameters nor
  gradients (``LiveMemoryTracker``: saved activations and temporaries); the largest rank is reported, next
  to ``cp1 / cp`` (the issue's target: <= 1.1 x);
- step time: the fastest of ``--steps`` untracked forward-backwards (the slowest rank of each), next to
  the ideal compute split ``cp1 / cp`` of two cp-1 runs: the framework's (PyTorch SDPA, a fused C++ kernel
  on CPU) and "cp1 blockwise", the ring's own tiled math on one rank (the compute p2p and allgather split;
  its ratio is the cost of the communication and the causal split). The ranks share this machine's cores:
  with more ranks than cores (or other work on the machine) the time ratio measures the machine, not the
  scheme; the header says so.

    python scripts/bench_context_parallel.py                      # seq 2k, 8k, 16k; cp 1, 2, 4
    python scripts/bench_context_parallel.py --seq 4096 --cp 2    # a quick look
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import CP_COMM_TYPES, TransformerConfig
from megatron_core.context_parallel import ring_attention, split_batch
from megatron_core.models import GPTModel
from megatron_core.transformer import DotProductAttention, TransformerLayerSpec
from megatron_core.testing import DistributedPool
from megatron_core.utils.live_memory import LiveMemoryTracker

VOCAB = 256


class BlockwiseAttention(DotProductAttention):
    """The ring's tiled blockwise math on one rank (cp 1, no communication): the compute p2p splits."""

    def forward(self, query, key, value, attention_mask=None):
        return ring_attention(query, key, value, attention_mask, cp_group=None, cp_ranks=(0,), cp_rank=0,
                              scale=self.scale)


def _model(args: argparse.Namespace, state, cp: int, comm_type: str, seq: int) -> GPTModel:
    blockwise = comm_type == "blockwise"
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
                               context_parallel_size=cp, cp_comm_type=comm_type if comm_type in CP_COMM_TYPES else "p2p")
    torch.manual_seed(0)
    spec = TransformerLayerSpec(core_attention=BlockwiseAttention) if blockwise else None
    return GPTModel(config, parallel_state=state, vocab_size=VOCAB, max_sequence_length=seq, layer_spec=spec)


def _measure(args: argparse.Namespace, cp: int, comm_type: str, seq: int) -> dict:
    """One configuration on this rank: peak activation bytes of a tracked step, fastest untracked step."""
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
        with tracker:
            step()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
        return {"activations": tracker.peak_by_category["activations"], "time": min(times)}
    finally:
        destroy_model_parallel(state)


def _runs(cps: list[int]) -> list[tuple[int, str]]:
    return [(1, "sdpa"), (1, "blockwise")] + [(cp, kind) for cp in cps if cp > 1 for kind in CP_COMM_TYPES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"GPTModel fp32, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, rope, batch 1; gloo, "
          f"1 thread per rank, {cores} CPU cores (load average {os.getloadavg()[0]:.1f}); time ratios above "
          f"cp {cores} measure oversubscribed cores\n")
    print("| seq | cp | attention | activations / rank (MiB) | / (cp1 / cp) | step (s) | / (cp1 / cp) "
          "| / (cp1 blockwise / cp) |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for seq in args.seq:
        baselines: dict[str, dict] = {}
        for cp, kind in _runs(args.cp):
            with DistributedPool(cp) as pool:
                per_rank = pool.run(_measure, args, cp, kind, seq, timeout_s=1800)
            result = {"activations": max(r["activations"] for r in per_rank), "time": per_rank[0]["time"]}
            if cp == 1:
                baselines[kind] = result
            sdpa, blockwise = baselines["sdpa"], baselines.get("blockwise", result)
            print(f"| {seq} | {cp} | {kind} | {result['activations'] / 2**20:.1f} | "
                  f"{result['activations'] / (sdpa['activations'] / cp):.2f} | {result['time']:.2f} | "
                  f"{result['time'] / (sdpa['time'] / cp):.2f} | {result['time'] / (blockwise['time'] / cp):.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
