"""Benchmark of the fused Triton kernels (forward + backward) against torch eager and torch.compile.

    python scripts/bench_kernels.py                  # Megatron-scale shapes, bf16
    python scripts/bench_kernels.py --iters 50 --peak-gbps 4800

Shapes: causal softmax ``[4*32, 2048, 2048]``, LayerNorm / RMSNorm ``[16384, 8192]``, cross-entropy
``[8192, 50304]``, all bf16. For each op it prints the median time of forward + backward for the fused kernel,
torch eager and ``torch.compile`` of the eager code, the speed ratios (eager / fused, compile / fused), and the
fused kernel's achieved memory bandwidth as a fraction of the device's peak. Bytes counted are the least any
implementation must move: every input read once and every output written once (for the causal softmax only the
lower triangle of x, y and dy is read; y and dx are written in full). It also prints the peak memory that
fused and eager cross-entropy allocate on top of their inputs.

On a machine without a CUDA GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

import kernels

SHAPES = {"softmax": (4 * 32, 2048), "norm": (16384, 8192), "cross_entropy": (8192, 50304)}

# Peak HBM bandwidth (bytes/s) by device-name fragment, from the vendors' data sheets; first match wins.
PEAK_BANDWIDTH = [("H200", 4.8e12), ("B200", 8.0e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12),
                  ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12), ("A100-PCIE-80GB", 1.935e12),
                  ("A100", 1.555e12), ("L40S", 0.864e12), ("A10G", 0.6e12), ("4090", 1.008e12)]


def peak_bandwidth(device: torch.device, override_gbps: Optional[float]) -> float:
    """Peak memory bandwidth in bytes/s: ``--peak-gbps``, else the data-sheet table, else clock * bus width."""
    if override_gbps:
        return override_gbps * 1e9
    props = torch.cuda.get_device_properties(device)
    for fragment, peak in PEAK_BANDWIDTH:
        if fragment in props.name:
            return peak
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else float("nan")


def time_ms(step: Callable[[], None], warmup: int, iters: int) -> float:
    """Median milliseconds of ``step()`` over ``iters`` runs, timed with CUDA events after ``warmup`` runs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fwd_bwd(fn: Callable, inputs: Sequence[torch.Tensor], grad_out: torch.Tensor) -> Callable[[], None]:
    """A step running ``fn(*inputs)`` and the gradients of the inputs that require them (no accumulation)."""
    leaves = [t for t in inputs if t.requires_grad]

    def step() -> None:
        torch.autograd.grad(fn(*inputs), leaves, grad_out)
    return step


def peak_extra_mib(step: Callable[[], None]) -> float:
    """MiB that one ``step()`` allocates at its peak on top of what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _causal_eager(x: torch.Tensor, scale: float) -> torch.Tensor:
    upper = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu_(1)
    return torch.softmax((x * scale).masked_fill(upper, float("-inf")), dim=-1)


def cases(backend, device: torch.device, dtype: torch.dtype):
    """``(name, shape, fused, eager, inputs, grad_out, bytes moved)`` for every benchmarked op."""
    def rand(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    b_h, s = SHAPES["softmax"]
    x, scale, e = rand(b_h, s, s), 0.125, torch.finfo(dtype).bits // 8
    tri = b_h * s * (s + 1) // 2  # lower-triangle elements
    yield ("softmax causal", (b_h, s, s),
           lambda t: kernels.scaled_upper_triang_masked_softmax(t, scale, backend=backend),
           lambda t: _causal_eager(t, scale), (x,), torch.randn_like(x), e * (3 * tri + 2 * x.numel()))
    del x
    rows, hidden = SHAPES["norm"]
    h, w, bias = rand(rows, hidden), rand(hidden), rand(hidden)
    norm_bytes = e * 5 * h.numel()  # x, y forward; x, dy, dx backward
    yield ("layer_norm", (rows, hidden), lambda t, w_, b_: kernels.layer_norm(t, w_, b_, 1e-5, backend=backend),
           lambda t, w_, b_: F.layer_norm(t, (hidden,), w_, b_, 1e-5), (h, w, bias), torch.randn_like(h), norm_bytes)
    yield ("rms_norm", (rows, hidden), lambda t, w_: kernels.rms_norm(t, w_, 1e-5, backend=backend),
           lambda t, w_: F.rms_norm(t, (hidden,), w_, 1e-5), (h, w), torch.randn_like(h), norm_bytes)
    del h
    tokens, vocab = SHAPES["cross_entropy"]
    logits, target = rand(tokens, vocab), torch.randint(0, vocab, (tokens,), device=device)
    grad_loss = torch.rand(tokens, device=device)
    yield ("cross_entropy", (tokens, vocab), lambda t: kernels.cross_entropy(t, target, backend=backend),
           lambda t: F.cross_entropy(t, target, reduction="none"), (logits,), grad_loss, e * 3 * logits.numel())


def run(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    peak = peak_bandwidth(device, args.peak_gbps)
    print(f"device: {torch.cuda.get_device_name(device)}, peak memory bandwidth {peak / 1e9:.0f} GB/s, "
          f"dtype bf16, median of {args.iters} runs of forward + backward")
    header = (f"{'op':<16}{'shape':<20}{'fused ms':>10}{'eager ms':>10}{'compile ms':>12}{'fused GB/s':>12}"
              f"{'% peak':>8}{'eager/fused':>13}{'compile/fused':>15}")
    print(header)
    print("-" * len(header))
    memory, backend = {}, kernels.KernelBackend()
    for name, shape, fused, eager, inputs, grad_out, nbytes in cases(backend, device, torch.bfloat16):
        ms = {"fused": time_ms(fwd_bwd(fused, inputs, grad_out), args.warmup, args.iters),
              "eager": time_ms(fwd_bwd(eager, inputs, grad_out), args.warmup, args.iters)}
        compiled = torch.compile(eager) if not args.no_compile else None
        ms["compile"] = (time_ms(fwd_bwd(compiled, inputs, grad_out), args.warmup, args.iters)
                         if compiled is not None else float("nan"))
        gbps = nbytes / (ms["fused"] * 1e-3) / 1e9
        print(f"{name:<16}{str(list(shape)):<20}{ms['fused']:>10.3f}{ms['eager']:>10.3f}{ms['compile']:>12.3f}"
              f"{gbps:>12.0f}{100 * gbps * 1e9 / peak:>7.0f}%{ms['eager'] / ms['fused']:>12.2f}x"
              f"{ms['compile'] / ms['fused']:>14.2f}x")
        if name == "cross_entropy":
            memory = {label: peak_extra_mib(fwd_bwd(fn, inputs, grad_out)) for label, fn in
                      (("fused", fused), ("eager", eager), ("compile", compiled)) if fn is not None}
        del inputs, grad_out
        torch.cuda.empty_cache()
    print("cross_entropy peak memory above its inputs (forward + backward): "
          + ", ".join(f"{label} {mib:.0f} MiB" for label, mib in memory.items()))
    print(f"backends that ran: {backend.report()}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="timed runs per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (compilation, autotuning)")
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth, GB/s (default: "
                        "the data-sheet value for known GPUs)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU on this machine; nothing to benchmark (the kernels' correctness "
              "tests run on CPU: pytest tests/kernels)")
        return 0
    reason = kernels.triton_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        print(f"bench_kernels: Triton cannot run here ({reason}); nothing to benchmark")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
