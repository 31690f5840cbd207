"""One-GPU check, prepared to run in under 8 minutes on an H100/H200-class GPU (``scripts/gpu_check.sh`` runs it).

    bash scripts/gpu_check.sh                 # on the GPU machine: kernels, bandwidth, 1B bf16 training (MFU)
    bash scripts/gpu_check.sh --dry-run       # anywhere: the same plumbing, tiny shapes, CPU, Triton interpreter

Three parts, each timed and summarized:

1. **Correctness**: every fused Triton kernel of ``kernels`` (causal and masked softmax, LayerNorm, RMSNorm,
   cross-entropy), forward and backward, against plain torch computed in fp32, on GPT shapes and odd sizes, in
   fp32 and bf16; ``KernelBackend("triton")`` makes a silent fallback to the reference an error.
2. **Bandwidth**: forward + backward of each kernel at Megatron-scale bf16 shapes (``scripts/bench_kernels.py``'s
   cases), GB/s and % of the device's peak memory bandwidth.
3. **Training**: ``pretrain_gpt.py --bf16 --mock-data`` on one GPU for a ~1.3B-parameter GPT (24 layers, hidden
   2048, 16 heads, seq 2048, GPT-2 vocab), eager and ``--compile``; MFU and tokens/s as the median of the
   iterations after the warm-up (``megatron_core.training.metrics``).

The summary is printed and written to ``outputs/gpu_check_<time>.txt`` (and ``.json``). With ``--dry-run``
every number is meaningless (CPU, tiny shapes); it only proves the script runs end to end.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import bench_kernels  # noqa: E402 - scripts/bench_kernels.py: the benchmark cases and the peak-bandwidth table
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402

FULL = dict(softmax=[(32, 2048), (15, 1000)], masked=[(2, 16, 2048), (1, 3, 777)],
            norm=[(8192, 2048), (1000, 2050), (512, 16384)], xent=[(8192, 50304), (1000, 50257)])
TINY = dict(softmax=[(4, 16), (3, 7)], masked=[(1, 2, 16), (1, 3, 7)], norm=[(8, 32), (5, 33)],
            xent=[(8, 64), (5, 67)])
BENCH_TINY = {"softmax": (4, 32), "norm": (64, 128), "cross_entropy": (64, 256)}
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
TRAIN_FULL = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
              "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "30", "--log-interval", "5"]
TRAIN_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "2",
              "--peak-tflops", "1"]  # a CPU has no table entry: a nominal peak so the MFU plumbing runs
TRAIN_COMMON = ["--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50256",
                "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2", "--eval-interval", "100000",
                "--eval-iters", "0", "--seed", "1234"]


# ------------------------------------------------------------------------------------------------------------
# 1. correctness
def _check_cases(device: torch.device, shapes: dict) -> list[tuple[str, Callable, Callable, list]]:
    """``(name, fused, reference, inputs)``: the reference is plain torch, run on fp32 copies of the inputs; the
    fused ops run in mode "triton" (no silent fallback: a missing kernel path raises)."""
    out, kb = [], kernels.KernelBackend("triton")
    for bh, s in shapes["softmax"]:
        upper = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
        out.append((f"softmax_causal[{bh},{s},{s}]",
                    lambda x: kernels.scaled_upper_triang_masked_softmax(x, 0.125, backend=kb),
                    lambda x, u=upper: torch.softmax((x * 0.125).masked_fill(u, float("-inf")), -1), [(bh, s, s)]))
    for b, h, s in shapes["masked"]:
        mask = torch.rand(b, 1, s, s, device=device, generator=None) < 0.2
        mask[..., 0] = False  # every row keeps one position
        out.append((f"softmax_masked[{b},{h},{s},{s}]",
                    lambda x, m=mask: kernels.scaled_masked_softmax(x, m, 0.5, backend=kb),
                    lambda x, m=mask: torch.softmax((x * 0.5).masked_fill(m, float("-inf")), -1), [(b, h, s, s)]))
    for rows, hidden in shapes["norm"]:
        out.append((f"layer_norm[{rows},{hidden}]", lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5, backend=kb),
                    lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5), [(rows, hidden), (hidden,), (hidden,)]))
        out.append((f"rms_norm[{rows},{hidden}]", lambda x, w: kernels.rms_norm(x, w, 1e-5, backend=kb),
                    lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-5), [(rows, hidden), (hidden,)]))
    for tokens, vocab in shapes["xent"]:
        target = torch.randint(0, vocab, (tokens,), device=device)
        out.append((f"cross_entropy[{tokens},{vocab}]", lambda x, t=target: kernels.cross_entropy(x, t, backend=kb),
                    lambda x, t=target: F.cross_entropy(x, t, reduction="none"), [(tokens, vocab)]))
    return out


def _max_error(got: torch.Tensor, want: torch.Tensor, tol: dict) -> tuple[float, bool]:
    err = (got.detach().float() - want.detach()).abs()
    return float(err.max()), bool((err <= tol["atol"] + tol["rtol"] * want.abs()).all())


def check_kernels(device: torch.device, shapes: dict) -> list[dict]:
    """Forward output and input grads of each kernel against the fp32 torch reference; one row per case."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, fused, reference, input_shapes in _check_cases(device, shapes):
            torch.manual_seed(0)
            inputs = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for shape in input_shapes]
            ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
            row = {"case": name, "dtype": str(dtype).replace("torch.", "")}
            try:
                y = fused(*inputs)
                grad = torch.randn_like(y)
                grads = torch.autograd.grad(y, inputs, grad)
                y_ref = reference(*ref_inputs)
                grads_ref = torch.autograd.grad(y_ref, ref_inputs, grad.float())
                errors = [_max_error(y, y_ref, TOL[dtype])] + [
                    _max_error(g, r, {k: 4 * v for k, v in TOL[dtype].items()}) for g, r in zip(grads, grads_ref)]
                row.update(max_abs_error=max(e for e, _ in errors), ok=all(ok for _, ok in errors))
            except Exception as error:  # noqa: BLE001 - the summary names every failing case and goes on
                row.update(max_abs_error=float("nan"), ok=False, error=f"{type(error).__name__}: {error}"[:300])
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------------
# 2. bandwidth
def _time_ms(step: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    if device.type == "cuda":
        return bench_kernels.time_ms(step, warmup, iters)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        step()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, *, dry_run: bool, iters: int) -> tuple[list[dict], Optional[float]]:
    """GB/s of forward + backward of each fused kernel (bench_kernels' bytes), and the device peak (bytes/s)."""
    if dry_run:
        bench_kernels.SHAPES = BENCH_TINY
    peak = bench_kernels.peak_bandwidth(device, None) if device.type == "cuda" else None
    rows = []
    backend = kernels.KernelBackend("triton")
    for name, shape, fused, _eager, inputs, grad_out, nbytes in bench_kernels.cases(backend, device, torch.bfloat16):
        ms = _time_ms(bench_kernels.fwd_bwd(fused, inputs, grad_out), device, 2 if dry_run else 5, iters)
        gbps = nbytes / (ms * 1e-3) / 1e9
        rows.append({"op": name, "shape": list(shape), "ms": ms, "gbps": gbps,
                     "pct_peak": 100 * gbps * 1e9 / peak if peak else None})
        del inputs, grad_out
    return rows, peak


# ------------------------------------------------------------------------------------------------------------
# 3. training
def train(extra: Sequence[str], *, dry_run: bool, out_dir: str, tag: str, timeout_s: int) -> dict:
    """Runs pretrain_gpt.py in a subprocess; returns its median MFU / tokens/s / step time after the warm-up."""
    metrics = os.path.join(out_dir, f"gpu_check_train_{tag}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *(TRAIN_TINY if dry_run else TRAIN_FULL),
            *TRAIN_COMMON, "--metrics-file", metrics, *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if dry_run:  # interpreted kernels would take minutes per step; the correctness part already ran them
        env.pop("TRITON_INTERPRET", None)
    begin = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"run": tag, "ok": False, "error": f"timed out after {timeout_s} s", "wall_s": timeout_s}
    result = {"run": tag, "ok": done.returncode == 0, "wall_s": time.perf_counter() - begin,
              "kernels": next((line.split("kernels used:", 1)[1].strip() for line in done.stdout.splitlines()
                               if "kernels used:" in line), None)}
    if done.returncode != 0:
        result["error"] = (done.stderr or done.stdout)[-600:]
        return result
    records = [json.loads(line) for line in open(metrics, encoding="utf-8")]
    records = [r for r in records if r.get("split", "train") == "train" and "mfu" in r]
    steady = records[len(records) // 3:] or records  # the first third: compilation, allocator warm-up
    def median(key: str) -> Optional[float]:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    result.update(iterations=len(records), mfu=median("mfu"), tokens_per_sec=median("tokens_per_sec"),
                  ms_per_iter=median("ms_per_iter"),
                  mem_gib=max(r.get("mem_bytes", 0) for r in records) / 2**30,
                  loss_first=records[0].get("lm_loss"), loss_last=records[-1].get("lm_loss"))
    return result


# ------------------------------------------------------------------------------------------------------------
# summary
def _fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def summarize(report: dict) -> str:
    """The compact text summary of ``report`` (what is printed and written to outputs/)."""
    mode = "DRY RUN: tiny shapes, numbers meaningless" if report["dry_run"] else "full"
    lines = [f"gpu_check {report['when']} on {report['device']} ({mode})",
             f"torch {report['torch']}, triton {report['triton']}, total {report['wall_s']:.0f} s"
             + (" (INTERRUPTED by the time limit: the parts below are what finished)" if report["interrupted"] else "")]
    checks = report["correctness"]
    failed = [c for c in checks if not c["ok"]]
    lines.append(f"[1] correctness: {len(checks) - len(failed)}/{len(checks)} cases pass "
                 "(fp32, bf16; fwd + bwd vs torch)")
    for case in failed:
        lines.append(f"    FAIL {case['case']} {case['dtype']}: max err {case['max_abs_error']:.3g} "
                     f"{case.get('error', '')}")
    peak = report["peak_bandwidth"]
    lines.append(f"[2] bandwidth, bf16 fwd+bwd (peak {_fmt(peak and peak / 1e9, '.0f')} GB/s; target >= 80%):")
    for row in report["bandwidth"]:
        lines.append(f"    {row['op']:<16}{str(row['shape']):<20}{row['ms']:>9.3f} ms {row['gbps']:>8.0f} GB/s "
                     f"{_fmt(row['pct_peak'], '.0f'):>5}% of peak")
    lines.append("[3] training, pretrain_gpt.py --bf16 (target MFU >= 45%):")
    for run in report["training"]:
        if not run["ok"]:
            lines.append(f"    {run['run']:<8} FAILED: {run.get('error', '')[-300:]}")
            continue
        lines.append(f"    {run['run']:<8} MFU {_fmt(run['mfu'] and 100 * run['mfu'], '.1f')}% | "
                     f"{_fmt(run['tokens_per_sec'], '.0f')} tokens/s | {_fmt(run['ms_per_iter'], '.0f')} ms/iter | "
                     f"mem {run['mem_gib']:.1f} GiB | loss {run['loss_first']:.3f} -> {run['loss_last']:.3f} | "
                     f"{run['iterations']} iters, {run['wall_s']:.0f} s")
        lines.append(f"             kernels used: {run['kernels']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU under the Triton interpreter: checks the plumbing only")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per bandwidth measurement (median)")
    parser.add_argument("--skip-compile-run", action="store_true", help="train eager only (no --compile run)")
    parser.add_argument("--train-timeout", type=int, default=150, help="seconds per training run before it is killed")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "outputs"))
    args = parser.parse_args(argv)
    if args.dry_run:
        if not kernels._dispatch.INTERPRET:
            parser.error("--dry-run needs TRITON_INTERPRET=1 in the environment (gpu_check.sh sets it)")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run on the GPU machine, or pass --dry-run to check the plumbing on CPU")
    else:
        device = torch.device("cuda")
    reason = kernels.triton_unavailable_reason(device)
    if reason is not None:
        parser.error(f"Triton cannot run on {device}: {reason}")
    os.makedirs(args.out_dir, exist_ok=True)
    begin = time.perf_counter()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    report = {"when": when, "dry_run": args.dry_run, "torch": torch.__version__,
              "triton": getattr(kernels._dispatch.triton, "__version__", None),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"}
    report.update(correctness=[], bandwidth=[], peak_bandwidth=None, training=[], interrupted=False)
    try:  # gpu_check.sh's time limit interrupts with SIGINT: what finished is still summarized
        report["correctness"] = check_kernels(device, TINY if args.dry_run else FULL)
        report["bandwidth"], report["peak_bandwidth"] = measure_bandwidth(device, dry_run=args.dry_run,
                                                                          iters=args.iters)
        runs = [("eager", [])] + ([] if args.skip_compile_run else [("compile", ["--compile"])])
        for tag, extra in runs:
            report["training"].append(train(extra, dry_run=args.dry_run, out_dir=args.out_dir, tag=tag,
                                            timeout_s=args.train_timeout))
    except KeyboardInterrupt:
        report["interrupted"] = True
    report["wall_s"] = time.perf_counter() - begin
    text = summarize(report)
    print(text)
    stem = os.path.join(args.out_dir, f"gpu_check_{when}")
    with open(stem + ".txt", "w", encoding="utf-8") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"summary written to {stem}.txt (full report: {stem}.json)")
    ok = (not report["interrupted"] and all(c["ok"] for c in report["correctness"])
          and all(r["ok"] for r in report["training"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
