"""Optimizer and parameter offload on one CPU-only machine: step time and peak RSS of a GPT trained with its
states in memory, on the host (``--optimizer-cpu-offload``), in NVMe files (``--optimizer-nvme-offload-dir``)
and NVMe states + ZeRO-3 parameters (``--param-offload nvme``); and the host Adam kernels side by side.

Each configuration runs in a fresh process (so ``VmHWM`` is its own): ``--steps`` training steps of an fp32
``GPTModel``, single rank. "state RSS" is the run's peak RSS minus that of a run doing the same
forward-backward without any optimizer (so it is what the optimizer adds: masters, moments, ring buffers,
temporaries). The NVMe files live in ``--dir``; reads may be served from the page cache (not counted in
RSS), so on this machine the NVMe rows measure the streaming machinery, not a disk's bandwidth.

    python scripts/bench_offload.py                   # ~2-3 minutes on 2 cores
    python scripts/bench_offload.py --hidden 512 --layers 4 --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's megatron_core

CONFIGS = {"no optimizer (baseline)": [], "in memory": [], "cpu offload": ["cpu"], "nvme states": ["nvme"],
           "nvme states, fused adam": ["nvme", "fused"], "nvme states + params": ["nvme", "params"]}


def run_config(args: argparse.Namespace, name: str) -> dict:
    """One configuration in this process: times and peak RSS."""
    from megatron_core import initialize_model_parallel
    from megatron_core.config import TransformerConfig
    from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_core.models import GPTModel
    from megatron_core.optimizer import OptimizerConfig, get_optimizer, memory_report
    from megatron_core.optimizer.offload import offload_parameters
    from megatron_core.utils.live_memory import peak_rss_bytes
    tags = CONFIGS[name]
    state = initialize_model_parallel()
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
                               ffn_hidden_size=4 * args.hidden, max_position_embeddings=args.seq,
                               hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTModel(config, parallel_state=state, vocab_size=args.vocab, max_sequence_length=args.seq)
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=3 if "params" in tags else 0),
                                  dp_group=None)
    if "params" in tags:
        offload_parameters(ddp, "nvme", directory=args.dir)
    optimizer = None
    if name != "no optimizer (baseline)":
        optimizer = get_optimizer(OptimizerConfig(
            lr=1e-4, optimizer_cpu_offload="cpu" in tags,
            optimizer_nvme_offload_dir=args.dir if "nvme" in tags else None,
            optimizer_nvme_chunk_elements=args.chunk, optimizer_host_adam="fused" if "fused" in tags else "exact"),
            ddp, parallel_state=state)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(args.seq).expand(args.batch, args.seq)
    step_times, update_times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        ddp(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean().backward()
        ddp.finish_grad_sync()
        update = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        update_times.append(time.perf_counter() - update)
        step_times.append(time.perf_counter() - start)
    report = memory_report(ddp, optimizer) if optimizer is not None else None
    params = sum(p.numel() for p in model.parameters())
    return {"name": name, "params": params, "step_s": min(step_times[1:] or step_times),
            "update_s": min(update_times[1:] or update_times), "peak_rss": peak_rss_bytes(),
            "tiers": report.tiers if report else None,
            "in_memory_state_bytes": (report.master_weights + report.optimizer_states) if report else 0,
            "nvme_bytes": (report.nvme_master_weights + report.nvme_optimizer_states) if report else 0}


def bench_host_adam(numel: int, repeats: int = 5) -> dict[str, float]:
    """Seconds per Adam update of ``numel`` fp32 elements, best of ``repeats``, for each kernel."""
    from megatron_core.optimizer.offload.host_adam import AdamHyper, adamw_, fused_adamw_
    hyper = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    param, grad = torch.randn(numel), torch.randn(numel)
    kernels = {"ours, exact (torch AdamW math)": lambda s: adamw_(param, grad, m, v, step=s, hyper=hyper),
               "ours, fused (torch._fused_adamw_)": lambda s: fused_adamw_([param], [grad], [m], [v], step=s,
                                                                           hyper=hyper)}
    for label, flags in (("torch AdamW, plain (foreach=False)", dict(foreach=False)),
                         ("torch AdamW, foreach=True", dict(foreach=True)),
                         ("torch AdamW, fused=True", dict(fused=True))):
        p = torch.nn.Parameter(param.clone())
        p.grad = grad
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, **flags)
        kernels[label] = lambda s, opt=opt: opt.step()
    deepspeed = _deepspeed_cpu_adam(param, grad)
    if deepspeed is not None:
        kernels["DeepSpeedCPUAdam (adamw_mode)"] = lambda s: deepspeed.step()
    times = {}
    for label, kernel in kernels.items():
        m, v = torch.zeros(numel), torch.zeros(numel)
        best = float("inf")
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            kernel(step)
            best = min(best, time.perf_counter() - start)
        times[label] = best
    return times


def _deepspeed_cpu_adam(param: torch.Tensor, grad: torch.Tensor):
    """DeepSpeed's C++ host Adam when it is installed and its op builds here, else None."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p = torch.nn.Parameter(param.clone())
        p.grad = grad
        return DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.1, adamw_mode=True)
    except Exception as error:  # noqa: BLE001 - optional comparison: any import or build failure skips it
        print(f"DeepSpeedCPUAdam skipped: {type(error).__name__}: {error}")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=2 * 2 ** 20, help="--optimizer-nvme-chunk-elements")
    parser.add_argument("--dir", default=None, help="NVMe offload folder (default: a temporary one)")
    parser.add_argument("--adam-elements", type=int, default=20_000_000)
    parser.add_argument("--adam-only", action="store_true", help="only the host Adam kernels")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    if args.child is not None:
        print(json.dumps(run_config(args, args.child)))
        return
    if not args.adam_only:
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            rows = []
            for name in CONFIGS:
                argv = [a for a in sys.argv[1:] if not a.startswith("--dir")]
                out = subprocess.run([sys.executable, __file__, *argv, "--dir", folder, "--child", name],
                                     capture_output=True, text=True, check=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
        _print_runs(rows)
    times = bench_host_adam(args.adam_elements)
    plain = times["torch AdamW, plain (foreach=False)"]
    print(f"\nhost Adam, {args.adam_elements / 1e6:.0f}M fp32 elements, best of 5:")
    for label, seconds in times.items():
        print(f"  {label:38s} {seconds * 1e3:8.1f} ms   {plain / seconds:5.2f}x plain AdamW")


def _print_runs(rows: list[dict]) -> None:
    base = rows[0]
    memory = next(r for r in rows if r["name"] == "in memory")
    print(f"GPT, {base['params'] / 1e6:.1f}M parameters, fp32, 1 rank, {torch.get_num_threads()} threads")
    print(f"{'configuration':26s} {'step s':>7s} {'x mem':>6s} {'update s':>9s} {'peak RSS MB':>12s} "
          f"{'state RSS MB':>13s} {'% of mem':>9s} {'in-memory states MB':>20s} {'nvme MB':>8s}  tiers")
    state_mem = memory["peak_rss"] - base["peak_rss"]
    for row in rows:
        state_rss = row["peak_rss"] - base["peak_rss"]
        tiers = ",".join(f"{k[:6]}={v}" for k, v in (row["tiers"] or {}).items())
        print(f"{row['name']:26s} {row['step_s']:7.2f} {row['step_s'] / memory['step_s']:6.2f} {row['update_s']:9.3f} "
              f"{row['peak_rss'] / 2**20:12.0f} {state_rss / 2**20:13.0f} {100 * state_rss / state_mem:8.0f}% "
              f"{row['in_memory_state_bytes'] / 2**20:20.0f} {row['nvme_bytes'] / 2**20:8.0f}  {tiers}")


if __name__ == "__main__":
    main()
