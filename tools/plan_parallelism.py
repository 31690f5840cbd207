"""Rank every parallel layout of a GPT by predicted step time, among those whose predicted per-rank memory fits.

    python tools/plan_parallelism.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 2048 --micro-batch-size 1 --global-batch-size 512 --vocab-size 50257 --bf16 \\
        --num-devices 64 --memory-per-device-gb 80 --devices-per-node 8 --peak-tflops 989

Model and batch flags are pretrain_gpt.py's (parsed by ``megatron_core.training.arguments``); layout flags
given there (tp, pp, cp, SP, ZeRO, recompute) are ignored: every valid layout is tried (tp x pp x cp x dp x
vpp in {1, 2} x ZeRO 0-3 x SP x recompute none/selective/full; pp where --num-layers divides evenly, or with the
embedding and loss counted as layers where only that divides (--account-for-embedding/loss-in-pipeline-split);
cp where --seq-length divides by 2 cp, with the
--cp-comm-type given, p2p by default; with --num-experts every --expert-model-parallel-size dividing the
experts, --expert-tensor-parallel-size 1 or tp, ep x etp dividing tp x cp x dp, experts' states sharded over expert-dp,
the MoE activations and the ep all-to-all/all-gather traffic counted). Memory: parameters, grads (fp32, or bf16
with --grad-reduce-in-bf16), fp32 masters and
Adam states per ZeRO stage, activations per Korthikanti et al. with SP, recompute and the micro-batches in
flight on the fullest pipeline stage (``megatron_core.planning``). Time: hardware FLOPs (recompute included)
over peak x --compute-efficiency, tp/cp/pp/dp volumes over the link bandwidths, bubble (p-1)/(v m).
Prints the ranked table and the torchrun command of the best layout.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional, Sequence

from megatron_core.planning.hardware import PROFILES, Hardware, hardware_from_profile, save_profile
from megatron_core.planning.planner import RECOMPUTE_CHOICES, Plan, SearchSpace, Workload, grad_bytes_of, rank_plans
from megatron_core.planning.report import explain, plot
from megatron_core.training.arguments import build_parser, transformer_config, validate_args
from megatron_core.utils.errors import run_tool

PROG = "plan_parallelism.py"

PLANNER_FLAGS = {"--num-devices": int, "--memory-per-device-gb": float, "--intra-node-bandwidth-gbps": float,
                 "--inter-node-bandwidth-gbps": float, "--devices-per-node": int, "--peak-tflops": float,
                 "--compute-efficiency": float, "--top": int, "--mask-bytes": int, "--debug": bool,
                 "--hardware": str, "--calibrate": str, "--calibrate-ranks": int, "--calibrate-dtype": str,
                 "--tolerance": float,
                 "--zero-stages": str, "--recompute-options": str, "--no-sequence-parallel": bool,
                 "--max-context-parallel": int, "--zero-bubble": bool, "--no-flash-attention": bool,
                 "--explain": bool, "--plot": str}
HARDWARE_FLAGS = ("memory_per_device_gb", "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps",
                  "devices_per_node", "peak_tflops", "compute_efficiency")
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                "--expert-model-parallel-size", "--expert-tensor-parallel-size",
                "--sequence-parallel",
                "--zero-stage", "--use-distributed-optimizer", "--data-parallel-sharding-strategy",
                "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                "--tp-comm-overlap", "--overlap-param-gather")


def _planner_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    g = parser.add_argument_group("planner")
    g.add_argument("--num-devices", type=int)
    g.add_argument("--hardware", default="h100",
                   help=f"a shipped profile ({', '.join(sorted(PROFILES))}) or a JSON file from --calibrate; the "
                        "flags below override its fields")
    g.add_argument("--calibrate", metavar="FILE", help="measure this machine (GEMM curve, memory bandwidth, layer "
                   "overhead, all-reduce) on --calibrate-ranks gloo ranks and write its profile to FILE")
    g.add_argument("--calibrate-ranks", type=int, default=2)
    g.add_argument("--calibrate-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="dtype of the calibration's GEMMs and layers; auto: bfloat16 unless this CPU runs it over 2x "
                        "slower than float32 (no bf16 instructions, e.g. AMD Zen 1-3)")
    g.add_argument("--memory-per-device-gb", type=float)
    g.add_argument("--intra-node-bandwidth-gbps", type=float, help="GB/s of a collective inside a node")
    g.add_argument("--inter-node-bandwidth-gbps", type=float, help="GB/s per device between nodes")
    g.add_argument("--devices-per-node", type=int)
    g.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one device")
    g.add_argument("--compute-efficiency", type=float, help="fraction of the peak large GEMMs reach")
    g.add_argument("--mask-bytes", type=int, default=1, help="dropout-mask bytes/element (1 CUDA, 2 or 4 CPU)")
    g.add_argument("--no-flash-attention", action="store_true",
                   help="count the s^2 attention scores' memory traffic (unfused softmax, as on a CPU)")
    g.add_argument("--tolerance", type=float, default=0.03,
                   help="among layouts this close to the fastest (fraction), choose the simplest; 0: the fastest")
    g.add_argument("--zero-stages", default="0,1,2,3", help="ZeRO stages to consider, e.g. 0,1")
    g.add_argument("--recompute-options", default="none,selective,full", help="recompute kinds to consider")
    g.add_argument("--no-sequence-parallel", action="store_true", help="consider no sequence parallelism")
    g.add_argument("--max-context-parallel", type=int, help="largest cp size to consider (1: none)")
    g.add_argument("--zero-bubble", action="store_true", help="consider the zero-bubble schedule too")
    g.add_argument("--explain", action="store_true",
                   help="print the chosen layout's step time by part and why each axis has its size")
    g.add_argument("--plot", metavar="PNG", help="draw the step time by part of the first layouts")
    g.add_argument("--top", type=int, default=15, help="rows of the table")
    g.add_argument("--debug", action="store_true", help="show the traceback of a handled error")
    return parser


def search_space(options: argparse.Namespace) -> SearchSpace:
    """The layouts' features the flags allow (values checked, naming the flag)."""
    try:
        stages = tuple(int(x) for x in options.zero_stages.split(","))
    except ValueError:
        raise ValueError(f"--zero-stages {options.zero_stages!r} is not a comma-separated list of 0-3") from None
    recompute = tuple(None if x == "none" else x for x in options.recompute_options.split(","))
    if not set(stages) <= {0, 1, 2, 3} or not stages:
        raise ValueError(f"--zero-stages {options.zero_stages!r}: each stage must be 0, 1, 2 or 3")
    if not set(recompute) <= set(RECOMPUTE_CHOICES) or not recompute:
        raise ValueError(f"--recompute-options {options.recompute_options!r}: each must be none, selective or full")
    return SearchSpace(zero_stages=stages, recompute=recompute, sequence_parallel=not options.no_sequence_parallel,
                       max_cp=options.max_context_parallel, zero_bubble=options.zero_bubble)


def hardware(options: argparse.Namespace) -> Hardware:
    """The profile named by --hardware, with the explicit hardware flags over it."""
    overrides = {name: getattr(options, name) for name in HARDWARE_FLAGS}
    return hardware_from_profile(options.hardware, num_devices=options.num_devices, **overrides)


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(planner flags, pretrain_gpt.py flags)."""
    planner, model, i = [], [], 0
    while i < len(argv):
        flag = argv[i].split("=")[0]
        target = planner if flag in PLANNER_FLAGS else model
        target.append(argv[i])
        takes_value = PLANNER_FLAGS.get(flag) is not bool
        if takes_value and "=" not in argv[i] and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            target.append(argv[i + 1])
            i += 1
        i += 1
    return planner, model


def _model_argv(model_argv: list[str]) -> list[str]:
    """The pretrain_gpt.py flags without the layout flags the planner chooses."""
    kept, skip = [], False
    for token in model_argv:
        if skip and not token.startswith("--"):
            continue
        skip = token.split("=")[0] in LAYOUT_FLAGS
        if not skip:
            kept.append(token)
    return kept


def _layout_flags(plan: Plan, *, moe: bool = False, overlap: bool = False) -> list[str]:
    """The layout's flags; for an MoE model at tp > 1 the expert tensor parallel size always (its default is tp);
    with ``overlap`` (a profile whose ``comm_overlap`` the prediction counted on) the data-parallel overlaps the
    step time assumed: ``--overlap-grad-reduce``, and at ZeRO 1-2 ``--overlap-param-gather``."""
    layout = plan.layout
    flags = ["--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.cp > 1:
        flags += ["--context-parallel-size", str(layout.cp)]
    if layout.ep > 1:
        flags += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.etp > 1 or (moe and layout.tp > 1):
        flags += ["--expert-tensor-parallel-size", str(layout.etp)]
    if layout.embedding_loss_split:
        flags += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    if layout.vpp and layout.embedding_loss_split:  # the chunks' layer counts differ: name the chunk count
        flags += ["--num-virtual-stages-per-pipeline-rank", str(layout.vpp)]
    elif layout.vpp:
        flags += ["--num-layers-per-virtual-pipeline-stage", "LAYERS_PER_CHUNK"]
    if layout.sequence_parallel:
        flags.append("--sequence-parallel")
    if layout.tp_comm_overlap:
        flags.append("--tp-comm-overlap")
    if layout.zero_stage:
        flags += ["--zero-stage", str(layout.zero_stage)]
    if layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if overlap and max(layout.dp_cp, layout.expert_dp) > 1:
        flags.append("--overlap-grad-reduce")
        if layout.zero_stage in (1, 2):
            flags.append("--overlap-param-gather")
    return flags


def torchrun_command(plan: Plan, model_argv: list[str], *, num_devices: int, devices_per_node: int,
                     num_layers: int, overlap: bool = False) -> str:
    """The launch line of ``plan`` (run on every node; multi-node needs --rdzv-endpoint as usual); ``overlap``:
    with the data-parallel overlap flags (``_layout_flags``). ``--overlap-param-gather`` is the planner's (it
    needs ZeRO 1-2), ``--overlap-grad-reduce`` may also be the user's."""
    per_node = min(num_devices, devices_per_node)
    nodes = -(-num_devices // per_node)
    flags = [flag for flag in _layout_flags(plan, moe="--num-experts" in model_argv, overlap=overlap)
             if not (flag == "--overlap-grad-reduce" and flag in model_argv)]  # the user's own already
    if "LAYERS_PER_CHUNK" in flags:
        flags[flags.index("LAYERS_PER_CHUNK")] = str(num_layers // (plan.layout.pp * plan.layout.vpp))
    launcher = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node)]
    if nodes > 1:
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:29500"]
    return shlex.join(launcher + ["pretrain_gpt.py"] + model_argv + flags)


def format_table(plans: list[Plan], top: int) -> str:
    header = ("| rank | tp | pp | cp | ep | etp | dp | vpp | ZeRO | SP | recompute | states GiB | activations GiB |"
              " transient GiB | total GiB | fits | step s | compute s | comm s | bubble | TFLOP/s |")
    rows = [header, "|" + " ---: |" * 7 + " ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: "
                    "| ---: | ---: | ---: |"]
    for i, plan in enumerate(plans[:top], 1):
        lay = plan.layout
        rows.append(f"| {i} | {lay.tp} | {lay.pp} | {lay.cp} | {lay.ep} | {lay.etp} | {lay.dp} | {lay.vpp or 1} | "
                    f"{lay.zero_stage}{' ZB' if lay.zero_bubble else ''} | "
                    f"{('overlap' if lay.tp_comm_overlap else 'yes') if lay.sequence_parallel else 'no'} | "
                    f"{lay.recompute or 'none'} | "
                    f"{plan.model_state_bytes / 2**30:.2f} | {plan.activation_bytes / 2**30:.2f} | "
                    f"{plan.transient_bytes / 2**30:.2f} | {plan.memory_bytes / 2**30:.2f} | "
                    f"{'yes' if plan.fits else 'NO'} | {plan.step_seconds:.3f} | "
                    f"{plan.compute_seconds:.3f} | {plan.comm_seconds:.3f} | {plan.bubble:.3f} | "
                    f"{plan.tflops_per_device:.1f} |")
    return "\n".join(rows)


def _rank(options: argparse.Namespace, args: argparse.Namespace) -> tuple[Workload, list[Plan], Hardware]:
    """The workload the flags describe, every layout's plan (the chosen first) and the hardware."""
    validate_args(args)
    base = transformer_config(args)
    workload = Workload(vocab_size=args.vocab_size or 50257, seq_length=args.seq_length,
                        micro_batch_size=args.micro_batch_size,
                        global_batch_size=args.global_batch_size or args.micro_batch_size * options.num_devices,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                        optimizer_state_bytes=8 if args.optimizer == "adam" else 4, mask_bytes=options.mask_bytes,
                        flash_attention=not options.no_flash_attention,
                        grad_bytes=grad_bytes_of(args))
    machine = hardware(options)
    return workload, rank_plans(base, workload, machine, space=search_space(options),
                                tolerance=options.tolerance), machine


def _calibrate(options: argparse.Namespace) -> None:
    from megatron_core.planning.calibrate import calibrate, fastest_cpu_dtype
    dtype = fastest_cpu_dtype() if options.calibrate_dtype == "auto" else options.calibrate_dtype
    fields = calibrate(options.calibrate_ranks, dtype_name=dtype)
    save_profile(Hardware(num_devices=options.calibrate_ranks, **fields), options.calibrate)
    print(f"calibrated {options.calibrate_ranks} ranks of this machine in {dtype} -> {options.calibrate}: "
          + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()))
    options.hardware = options.calibrate


def _run(argv: Optional[Sequence[str]]) -> int:
    planner_argv, model_argv = _split_argv(list(sys.argv[1:] if argv is None else argv))
    options = _planner_parser().parse_args(planner_argv)
    if options.calibrate:
        _calibrate(options)
        if not model_argv:
            return 0
    if options.num_devices is None:
        raise ValueError("--num-devices is required to plan (the devices the run will have)")
    model_argv = _model_argv(model_argv)
    args = build_parser().parse_args(model_argv)
    workload, plans, machine = _rank(options, args)
    print(f"{len(plans)} layouts of {options.num_devices} {machine.name} devices, {sum(p.fits for p in plans)} fit "
          f"in {machine.memory_per_device_gb:g} GiB; vocab {workload.vocab_size}, "
          f"global batch {workload.global_batch_size}; the first row is the simplest layout within "
          f"{100 * options.tolerance:g}% of the fastest\n")
    print(format_table(plans, options.top))
    if options.explain and plans[0].fits:
        print("\n" + explain(plans, budget_bytes=machine.memory_per_device_gb * 2**30, tolerance=options.tolerance,
                              hardware_name=options.hardware))
    if options.plot:
        plot(plans, options.plot)
        print(f"\nplot: {options.plot}")
    if not plans[0].fits:
        return _offload_advice(plans, model_argv, options, machine, args.num_layers)
    print("\nbest layout:\n" + torchrun_command(plans[0], model_argv, num_devices=options.num_devices,
                                               devices_per_node=machine.devices_per_node, num_layers=args.num_layers,
                                               overlap=machine.comm_overlap > 0))
    return 0


def _offload_advice(plans: list[Plan], model_argv: list[str], options, machine: Hardware, num_layers: int) -> int:
    offloaded = sorted((p for p in plans if p.fits_with_offload), key=lambda p: p.step_seconds + p.offload_seconds)
    if not offloaded:
        print("\nno layout fits, not even with optimizer offload: lower --micro-batch-size or --seq-length, "
              "or add devices")
        return 1
    best = offloaded[0]
    print(f"\nno layout fits in device memory; {len(offloaded)} fit with the optimizer states offloaded "
          f"(masters + states {best.offloadable_bytes / 2**30:.2f} GiB per rank to host or NVMe, "
          f"{(best.memory_bytes - best.offloadable_bytes) / 2**30:.2f} GiB left on the device); best, with NVMe "
          f"optimizer offload, {best.step_seconds + best.offload_seconds:.3f} s per step (gradients and parameters "
          f"over PCIe: {best.offload_seconds:.3f} s; the host's own update time not included):")
    print(torchrun_command(best, model_argv + ["--optimizer-nvme-offload-dir", "/path/to/nvme"],
                           num_devices=options.num_devices, devices_per_node=machine.devices_per_node,
                           num_layers=num_layers, overlap=machine.comm_overlap > 0))
    return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the planner; returns 0 (1 when no layout fits), or 2 for bad flags after one ``plan_parallelism.py:
    error:`` paragraph on stderr (with the traceback under ``--debug``)."""
    return run_tool(PROG, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
