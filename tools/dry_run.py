"""Dry run at full scale without a GPU: one process per requested rank joins a fake world of ``--world-size``
ranks, builds the run exactly as ``pretrain_gpt.py`` would at that layout on fake CUDA tensors, trains two
steps through the real schedule and reports its memory, parameters, FLOPs and collectives.

    python tools/dry_run.py --world-size 128 --ranks first-last --memory-per-device-gb 80 \\
        --output-json dry_run.json -- <pretrain_gpt.py flags>

``--ranks``: ``0,63,127``, ``first-last`` (rank 0 and the last rank: first and last pipeline stage) or
``all-stages`` (the first rank of every pipeline stage, and the last rank). Exit status 0 only when every rank
completed and its measured peak fits ``--memory-per-device-gb``; 1 when one did not fit or failed; 2 on bad
flags. See docs/performance.md, "Before you launch".
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from megatron_core.utils.accelerator import SIMULATED_GPUS

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOOTSTRAP = ROOT / "megatron_core" / "dryrun" / "fake_cuda.py"
GIB = 2**30
TARGETS = tuple(SIMULATED_GPUS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/dry_run.py", description=__doc__.split("\n\n")[0],
                                epilog="Every flag after -- (or not named here) is a pretrain_gpt.py flag.")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the simulated job")
    p.add_argument("--ranks", default="first-last", help="comma-separated ranks, first-last or all-stages")
    p.add_argument("--output-json", default=None, help="write every rank's measurements here")
    p.add_argument("--memory-per-device-gb", type=float, default=None,
                   help="the bound each rank's measured peak must fit (default: the target GPU's memory)")
    p.add_argument("--target", default="sm_90", choices=TARGETS, help="the simulated GPU (sm_90: H100 80 GB)")
    p.add_argument("--compile-kernels", default=None, choices=TARGETS,
                   help="also compile every captured Triton launch for this target")
    p.add_argument("--steps", type=int, default=2, help="training steps per rank (2: the second has optimizer "
                   "states)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--jobs", type=int, default=1, help="ranks dry-run at the same time (one process each)")
    p.add_argument("--timeout-minutes", type=float, default=30.0, help="per rank")
    return p


def _flag_value(flags: Sequence[str], name: str, default: int) -> int:
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return int(flags[i + 1])
        if flag.startswith(name + "="):
            return int(flag.split("=", 1)[1])
    return default


def resolve_ranks(spec: str, world_size: int, pipeline_size: int) -> list[int]:
    """The ranks ``spec`` names; ValueError naming a rank outside the world or a malformed spec."""
    if spec == "first-last":
        ranks = [0, world_size - 1]
    elif spec == "all-stages":  # the grid is [pp, dp, cp, tp]: stage p starts at p * world / pp
        ranks = [p * (world_size // pipeline_size) for p in range(pipeline_size)] + [world_size - 1]
    else:
        try:
            ranks = [int(r) for r in spec.split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"--ranks {spec!r} is not a comma-separated list of ranks, first-last or all-stages")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise ValueError(f"--ranks {spec!r}: ranks {bad} are outside the world of --world-size {world_size}")
    return sorted(dict.fromkeys(ranks))


def _run_rank(rank: int, opts: argparse.Namespace, flags: Sequence[str], folder: str) -> dict:
    out = os.path.join(folder, f"rank{rank}.json")
    command = [sys.executable, str(BOOTSTRAP), opts.target, "--rank", str(rank), "--world-size",
               str(opts.world_size), "--output-json", out, "--steps", str(opts.steps), "--gpus-per-node",
               str(opts.gpus_per_node)]
    command += ["--compile-kernels", opts.compile_kernels] if opts.compile_kernels else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TRITON_INTERPRET="0")
    begin = time.perf_counter()
    try:
        done = subprocess.run(command + ["--", *flags], capture_output=True, text=True, env=env,
                              timeout=opts.timeout_minutes * 60)
    except subprocess.TimeoutExpired:
        return {"rank": rank, "error": f"did not finish within --timeout-minutes {opts.timeout_minutes}"}
    if done.returncode != 0 or not os.path.exists(out):
        return {"rank": rank, "error": f"exit status {done.returncode}", "stderr": done.stderr[-4000:]}
    with open(out) as handle:
        result = json.load(handle)
    result["wall_seconds"] = time.perf_counter() - begin
    return result


def _row(result: dict, bound: float) -> str:
    if "error" in result:
        return f" rank {result['rank']:>5}: FAILED ({result['error']})"
    peak, predicted = result["peak_bytes"], result["predicted_bytes"]
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(result["peak_breakdown"].items()))
    exact = "exact" if result["parameters"] == round(result["parameters_exact"]) else \
        f"planner counts {result['parameters_exact']:,.0f}"
    fits = "fits" if peak <= bound else "DOES NOT FIT"
    compiled = result.get("compiled_kernels")
    kernels = (f"; {compiled['kernels']} Triton kernels compiled for {compiled['target']} "
               f"({compiled['cubin_bytes'] / 1e3:.0f} kB of cubin)") if compiled else ""
    return (f" rank {result['rank']:>5} ({result['layout_coordinates']}): {result['parameters'] / 1e9:.3f} B params "
            f"({exact}); peak {peak / GIB:.2f} GiB ({parts}) vs planner {predicted / GIB:.2f} GiB "
            f"(measured / predicted {peak / max(predicted, 1):.3f}); {fits} {bound / GIB:.0f} GiB; "
            f"{result['flops_per_step'] / 1e12:.1f} TFLOP per step; {result['wall_seconds']:.0f} s{kernels}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    opts, extra = build_parser().parse_known_args(argv[:split])
    flags = extra + argv[split + 1:]
    pipeline = _flag_value(flags, "--pipeline-model-parallel-size", 1)
    try:
        ranks = resolve_ranks(opts.ranks, opts.world_size, pipeline)
    except ValueError as error:
        print(f"tools/dry_run.py: {error}", file=sys.stderr)
        return 2
    bound = opts.memory_per_device_gb * 1e9 if opts.memory_per_device_gb else SIMULATED_GPUS[opts.target].total_memory
    with tempfile.TemporaryDirectory(prefix="dry_run_") as folder, ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        results = list(pool.map(lambda r: _run_rank(r, opts, flags, folder), ranks))
    for result in results:
        if "coordinates" in result:
            result["layout_coordinates"] = " ".join(f"{k} {v}" for k, v in result["coordinates"].items())
            result["fits"] = result["peak_bytes"] <= bound
    print(f"dry run: {opts.world_size} ranks simulated on {SIMULATED_GPUS[opts.target].name}, "
          f"{results[0].get('layout', '?')}")
    for result in results:
        print(_row(result, bound))
        if "stderr" in result:
            print(result["stderr"], file=sys.stderr)
    ok = all(r.get("fits") for r in results)
    if opts.output_json:
        report = {"world_size": opts.world_size, "target": opts.target, "memory_bound_bytes": bound, "ok": ok,
                  "flags": flags, "ranks": results}
        partial = opts.output_json + ".tmp"
        with open(partial, "w") as handle:
            json.dump(report, handle, indent=1)
        os.replace(partial, opts.output_json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
