"""megatron_core side by side with what users would pick instead, in one process tree: for each part the
implementations are built in the same ranks and their steps alternate (a barrier before each, the order
reversed every round), so a busy machine slows them alike; medians over --runs rounds of --steps steps.

    python scripts/benchmark.py                        # single,tp,pp,dp: ~3 minutes on 2 CPU cores
    python scripts/benchmark.py --only single --runs 9 # one part; scaling and planner run only when named
    python scripts/benchmark.py --only dp --png outputs/dp.png

Parts (``--only``, comma-separated):
  single   1 process: our GPTModel vs the eager nanoGPT-style GPT (scripts/nanogpt_reference.py; torch's
           default AdamW, and with fused=True) and megatron-core 0.16.1's GPTModel (local spec, CPU-mapped)
  tp       2 ranks: our tp 2 vs megatron-core's tp 2 and PyTorch DTensor (parallelize_module)
  pp       2 ranks: our 1F1B and zero bubble (ZB-H1) vs torch.distributed.pipelining Schedule1F1B
           (scripts/bench_pipeline.py, which also runs torch's zero-bubble and interleaved schedules)
  dp       2 ranks: our DistributedDataParallel at ZeRO 0-3 vs torch DistributedDataParallel, FSDP2
           fully_shard and DeepSpeed ZeRO-2/3 (when installed), all on our GPTModel
  scaling  our step time, TFLOP/s and memory as layers, hidden size and sequence length double
  planner  tools/plan_parallelism.py's predictions against measured steps at 12 layouts
A train step is forward + backward + AdamW step, fp32, dropout off, on gloo ranks with one thread each. In the
dp and pp parts each rank is bound to a core of its own (``--bind-cores-to-rank``; its gloo threads then
compete with its own compute only, which removes a 7-8 ms backward imbalance between the dp ranks); the tp
part runs unbound, where binding made every tp 2 step 10-12% slower (the synchronous all-reduce's gloo
thread then waits for its rank's core). Ours at ZeRO-1/2 runs with ``overlap_param_gather`` (Megatron's
``--overlap-param-gather``).

Parallel efficiency of a layout = (single-process time of the same work) / (ranks x layout step time): the
core-seconds one process needs over the core-seconds the layout spends. The single-process reference runs on
rank 0 of the same ranks, alternated with the layout's steps (the other rank waits): for tp 2 our tp 1 step on
the same batch, for dp 2 two micro-batches (both ranks' rows) and one optimizer step, for pp 2 the whole
model over the same micro-batches. 1.0: the layout adds no work; ZeRO-1/2 target >= 0.85.
Writes a bar chart (--png, default scripts/figures/benchmark.png): ours/peer step-time ratios and the
efficiencies, with a dashed parity line at 1.0.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
import warnings
from typing import Callable

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's megatron_core, then the scripts beside this one

import bench_cost  # noqa: E402
import bench_peers as peers  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from nanogpt_reference import GPTShape  # noqa: E402

from megatron_core import initialize_model_parallel  # noqa: E402
from megatron_core.testing import DistributedPool  # noqa: E402
from megatron_core.utils.affinity import bind_cores_to_rank  # noqa: E402

ALL = ("single", "tp", "pp", "dp", "scaling", "planner")
DEFAULT = ("single", "tp", "pp", "dp")
TARGETS = {"eager GPT": 0.95, "megatron-core tp 2": 0.9, "torch pipelining 1F1B": 0.9}
EFFICIENCY_TARGET = 0.85  # ZeRO-1/2 at dp 2


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def alternate(steps: dict[str, Callable[[], None]], *, rounds: int, per_round: int,
              clock: str = "wall") -> dict[str, list[float]]:
    """Runs on every rank: one warm-up step of each, then ``rounds`` rounds in which every step function runs
    ``per_round`` times after a barrier (order reversed each round). Seconds per step, per round, of
    ``clock``: "wall" (perf_counter) or "process" (CPU seconds of this process, all its threads: robust on a
    shared, oversubscribed machine, but blind to time spent waiting for a peer)."""
    now = CLOCKS[clock]
    barrier = dist.barrier if dist.is_initialized() and dist.get_world_size() > 1 else (lambda: None)
    for step in steps.values():
        barrier()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(rounds):
        for name, step in (reversed(list(steps.items())) if index % 2 else list(steps.items())):
            barrier()
            start = now()
            for _ in range(per_round):
                step()
            times[name].append((now() - start) / per_round)
    barrier()
    return times


def _one_core_per_rank(*, bind: bool) -> None:
    """One thread per rank; with ``bind`` every rank (and its gloo threads) bound to a core share of its own
    (``--bind-cores-to-rank``), the same for ours and every peer of the part."""
    torch.set_num_threads(1)
    if bind and dist.is_initialized():
        bind_cores_to_rank(dist.get_rank(), dist.get_world_size())


def _per_round_max(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """The slowest rank of every round: a layout's step ends when its last rank does."""
    return {name: [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))] for name in per_rank[0]}


def _idle() -> None:
    """What the other ranks do while rank 0 runs a single-process reference."""


def _on_rank_0(step: Callable[[], None]) -> Callable[[], None]:
    """A single-process reference, built on every rank (building the optimizer is collective), run on rank 0."""
    return step if dist.get_rank() == 0 else _idle


def _single_worker(shape: GPTShape, rows: int, rounds: int, per_round: int, clock: str) -> dict[str, list[float]]:
    _one_core_per_rank(bind=False)
    steps = {"ours": peers.ours_step(shape, rows), "eager GPT": peers.eager_step(shape, rows),
             "eager GPT, fused AdamW": peers.eager_step(shape, rows, fused=True)}
    megatron_step, close = peers.megatron_core_step(shape, rows, tp=1)
    steps["megatron-core"] = megatron_step
    try:
        return alternate(steps, rounds=rounds, per_round=per_round, clock=clock)
    finally:
        close()


def _tp_worker(shape: GPTShape, rows: int, rounds: int, per_round: int, clock: str) -> dict[str, list[float]]:
    _one_core_per_rank(bind=False)  # bound, every tp 2 step here was 10-12% slower (ours and the peers')
    single_state = initialize_model_parallel()  # tp 1: rank 0's reference makes no collective call
    steps = {"ours": peers.ours_step(shape, rows, state=initialize_model_parallel(tensor_model_parallel_size=2)),
             "DTensor tp 2": peers.eager_step(shape, rows, dtensor=True),
             "single process": _on_rank_0(peers.ours_step(shape, rows, state=single_state))}
    megatron_step, close = peers.megatron_core_step(shape, rows, tp=2)
    steps["megatron-core tp 2"] = megatron_step
    try:
        return alternate(steps, rounds=rounds, per_round=per_round, clock=clock)
    finally:
        close()


def _dp_worker(shape: GPTShape, rows: int, rounds: int, per_round: int, clock: str) -> dict[str, list[float]]:
    _one_core_per_rank(bind=True)
    warnings.filterwarnings("ignore", category=FutureWarning)  # the peers' deprecated collective names
    state = initialize_model_parallel()  # dp = 2
    seed = 1 + state.dp_rank
    steps = {f"ZeRO-{z}": peers.ours_step(shape, rows, state=state, zero_stage=z, seed=seed) for z in range(4)}
    steps["torch DDP"] = peers.torch_dp_step("ddp", shape, rows, state=state, fused=True)
    steps["FSDP2"] = peers.torch_dp_step("fsdp2", shape, rows, state=state)
    if peers.HAS_DEEPSPEED:
        for stage in (2, 3):
            steps[f"DeepSpeed ZeRO-{stage}"] = peers.deepspeed_step(stage, shape, rows, state=state)
    steps["single process"] = _on_rank_0(peers.ours_step(shape, rows, state=state, micro_batches=2))
    return alternate(steps, rounds=rounds, per_round=per_round, clock=clock)


def _pp_worker(pp_args: argparse.Namespace, rounds: int) -> dict[str, list[float]]:
    """Our 1F1B, our zero bubble (ZB-H1) and torch's 1F1B (``bench_pipeline._bench``, one step function per
    call, alternated round by round), then rank 0's single-process reference."""
    import bench_pipeline
    _one_core_per_rank(bind=True)
    times: dict[str, list[float]] = {"ours": [], "ours zero bubble": [], "torch pipelining 1F1B": []}
    for _ in range(rounds):
        times["ours"].append(bench_pipeline._bench("ours", pp_args, None)[0])
        times["ours zero bubble"].append(bench_pipeline._bench("ours", pp_args, None, zero_bubble=True)[0])
        times["torch pipelining 1F1B"].append(bench_pipeline._bench("torch", pp_args, None)[0])
    times.update(alternate({"single process": _on_rank_0(_pp_reference(pp_args))},
                           rounds=rounds, per_round=1))
    return times


def _pp_reference(pp_args: argparse.Namespace) -> Callable[[], None]:
    """The whole pipelined model in one process: forward + backward of the same micro-batches."""
    import bench_pipeline
    model = bench_pipeline._chunks(pp_args, initialize_model_parallel(), None)[0]
    tokens, labels = bench_pipeline._batch(pp_args)
    positions = torch.arange(pp_args.seq).expand(pp_args.micro_batch, pp_args.seq)
    micro = list(zip(tokens.split(pp_args.micro_batch), labels.split(pp_args.micro_batch)))

    def step() -> None:
        for tokens, labels in micro:
            model(tokens, positions, labels=labels).mean().backward()
    return step


def _rows(part: str, peers_of_ours: dict[str, list[float]], ours: list[float], ranks: int,
          single: list[float] | None, ours_name: str) -> list[dict]:
    """One table row per peer (ours/peer, median over rounds of the per-round ratio) and the efficiency row."""
    rows = []
    for peer, theirs in peers_of_ours.items():
        ratios = sorted(o / t for o, t in zip(ours, theirs)) if len(ours) == len(theirs) else \
            [statistics.median(ours) / statistics.median(theirs)]
        rows.append({"part": part, "kind": "ratio", "name": f"{ours_name} / {peer}", "peer": peer,
                     "ours": statistics.median(ours), "theirs": statistics.median(theirs),
                     "value": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]})
    if single:
        efficiency = statistics.median(single) / (ranks * statistics.median(ours))
        rows.append({"part": part, "kind": "efficiency", "name": f"{ours_name} efficiency", "peer": "",
                     "ours": statistics.median(ours), "theirs": statistics.median(single), "value": efficiency,
                     "min": efficiency, "max": efficiency})
    return rows


def bench_single(args) -> list[dict]:
    with DistributedPool(1) as pool:
        (times,) = pool.run(_single_worker, *_common(args), timeout_s=1800)
    ours = times.pop("ours")
    return _rows("single", times, ours, 1, None, "ours")


def bench_tp(args) -> list[dict]:
    with DistributedPool(2) as pool:
        times = _per_round_max(pool.run(_tp_worker, *_common(args), timeout_s=1800))
    ours, single = times.pop("ours"), times.pop("single process")
    return _rows("tp", times, ours, 2, single, "ours tp 2")


def bench_dp(args) -> list[dict]:
    with DistributedPool(2) as pool:
        times = _per_round_max(pool.run(_dp_worker, *_common(args), timeout_s=1800))
    single = times.pop("single process")
    ours = {name: times.pop(name) for name in [n for n in times if n.startswith("ZeRO-")]}
    rows = []
    for name, own in ours.items():  # each stage against every peer would be a long table: its closest peers
        peer_names = ["torch DDP"] if name in ("ZeRO-0", "ZeRO-1", "ZeRO-2") else ["FSDP2"]
        peer_names += [n for n in times if n.startswith("DeepSpeed") and n[-1] == name[-1]]
        rows += _rows("dp", {n: times[n] for n in peer_names}, own, 2, single, f"ours {name}")
    return rows


def bench_pp(args) -> list[dict]:
    pp_args = argparse.Namespace(pp=2, microbatches=8, micro_batch=2, layers=args.layers, hidden=args.hidden,
                                 seq=args.seq, steps=args.steps, vpp=2)
    with DistributedPool(2) as pool:
        times = _per_round_max(pool.run(_pp_worker, pp_args, args.runs, timeout_s=1800))
    ours, zero_bubble, single = times.pop("ours"), times.pop("ours zero bubble"), times.pop("single process")
    return _rows("pp", times, ours, 2, single, "ours 1F1B pp 2") + _rows("pp", times, zero_bubble, 2, single,
                                                                        "ours zero bubble pp 2")


def _common(args) -> tuple:
    """The arguments of every part's worker: shape, rows per rank, rounds, steps per round, clock."""
    return _shape(args), args.batch, args.runs, args.steps, args.clock


def _shape(args) -> GPTShape:
    return GPTShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab)


def print_table(rows: list[dict]) -> None:
    print("| part | comparison | ours s/step | peer (or single-process) s/step | value (median) | min-max | target |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        target = _target(r)
        met = "" if target is None else (f"{'<=' if r['kind'] == 'ratio' else '>='} {target} "
                                         f"{'met' if _meets(r, target) else 'NOT met'}")
        unit = "x" if r["kind"] == "ratio" else ""
        print(f"| {r['part']} | {r['name']} | {r['ours']:.4f} | {r['theirs']:.4f} | {r['value']:.2f}{unit} | "
              f"{r['min']:.2f}-{r['max']:.2f} | {met} |")


def _target(row: dict):
    if row["kind"] == "efficiency":
        return EFFICIENCY_TARGET if row["name"] in ("ours ZeRO-1 efficiency", "ours ZeRO-2 efficiency") else None
    return TARGETS.get(row["peer"])


def _meets(row: dict, target: float) -> bool:
    return row["value"] <= target if row["kind"] == "ratio" else row["value"] >= target


def write_chart(rows: list[dict], path: str, title: str) -> None:
    """Horizontal bars (ours/peer ratios: green when we are faster; efficiencies: blue), each labelled with
    its value, a dashed parity line at 1.0 and black ticks at the targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.6))
    labels = [f"{r['part']}: {r['name']}" for r in rows]
    colours = ["#4c78a8" if r["kind"] == "efficiency" else "#54a24b" if r["value"] <= 1 else "#f58518" for r in rows]
    y = list(range(len(rows)))[::-1]
    bars = ax.barh(y, [r["value"] for r in rows], color=colours)
    ax.bar_label(bars, labels=[f"{r['value']:.2f}" for r in rows], padding=8, fontsize=8)
    for yi, r in zip(y, rows):
        target = _target(r)
        if target is not None:
            ax.plot([target, target], [yi - 0.4, yi + 0.4], color="black", linewidth=2)
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1, label="parity (1.0)")
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("ours / peer step time (lower is faster)   |   parallel efficiency (blue, higher is better)")
    ax.set_xlim(0, max(1.3, max(r["value"] for r in rows) * 1.15))
    ax.set_title(title, fontsize=10)
    ax.plot([], [], color="black", linewidth=2, label="target")
    ax.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(DEFAULT), help=f"comma-separated subset of {','.join(ALL)}")
    for flag, default in (("layers", 4), ("hidden", 256), ("heads", 4), ("seq", 128), ("vocab", 1024), ("batch", 4),
                          ("runs", 5), ("steps", 2), ("threads", 1)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--png", default=str(HERE / "figures" / "benchmark.png"))
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; process: CPU seconds per process (a shared machine; pp stays wall)")
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name]
    unknown = sorted(set(chosen) - set(ALL))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown, choose from {','.join(ALL)}")
    header = (f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, vocab "
              f"{args.vocab}, {args.batch} sequences per rank; {args.runs} rounds of {args.steps} steps, "
              f"{args.clock} clock")
    print(f"{header}; torch {torch.__version__}, {os.cpu_count()} CPUs, gloo, 1 thread per rank; DeepSpeed "
          f"{'installed' if peers.HAS_DEEPSPEED else 'not installed (pip install deepspeed)'}\n")
    rows = []
    for name in chosen:
        if name in ("scaling", "planner"):
            print("\n".join(getattr(bench_cost, f"bench_{name}")(args)) + "\n")
            continue
        rows += globals()[f"bench_{name}"](args)
    if rows:
        print_table(rows)
        write_chart(rows, args.png, header.replace("; ", ";\n", 1) + f", gloo, {os.cpu_count()} CPU cores")
        print(f"\nchart: {args.png}")


if __name__ == "__main__":
    main()
