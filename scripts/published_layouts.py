"""The planner against layouts experts chose and measured (``megatron_core.planning.published`` and
``published_moe``): the tables of docs/performance.md, printed from the code that makes them.

    python scripts/published_layouts.py            # all three tables (about 10 s on a laptop CPU)

Narayanan et al. 2021 (A100): predicted TFLOP/s per GPU at their layout over the measured; Megatron-Bridge's
dense and MoE recipes (H100, B200): measured step time over predicted, from the published tokens per second.
"""
from __future__ import annotations

from megatron_core.planning.planner import rank_plans
from megatron_core.planning.published import MEGATRON_BRIDGE, NARAYANAN_2021, NARAYANAN_2021_SPACE
from megatron_core.planning.published_moe import MEGATRON_BRIDGE_H100_MOE


def narayanan_rows() -> list[str]:
    """Their layout (with the micro-batch and DDP of their script), the planner's choice in the 2021 search
    space, and predicted TFLOP/s per GPU at their layout over the measured."""
    lines = ["| model | GPUs | batch | micro-batch | DDP | their tp | pp (vpp) | chosen tp | pp (vpp) "
             "| measured TFLOP/s | predicted | predicted / measured |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in NARAYANAN_2021:
        predicted = run.plan().tflops_per_device
        chosen = rank_plans(run.config(), run.workload(), run.hardware(), space=NARAYANAN_2021_SPACE)[0].layout
        lines.append(f"| {run.name} | {run.gpus} | {run.global_batch} | {run.micro_batch} | {run.ddp} | {run.tp} "
                     f"| {_pp(run.pp, run.vpp)} | {chosen.tp} | {_pp(chosen.pp, chosen.vpp)} "
                     f"| {run.tflops_per_gpu:.0f} | {predicted:.0f} | {predicted / run.tflops_per_gpu:.2f} |")
    return lines


def _pp(pp: int, vpp) -> str:
    return f"{pp} (vpp {vpp})" if vpp else str(pp)


def _step_time_rows(runs, columns: str, describe) -> list[str]:
    """A row per run: ``describe(run)``'s cells (``columns`` names them), then measured / predicted step time."""
    lines = [f"| model | GPUs | {columns} | measured s | predicted s | measured / predicted |",
             "| --- | ---: | " + " | ".join("---" for _ in columns.split(" | ")) + " | ---: | ---: | ---: |"]
    for run in runs:
        predicted = run.plan().step_seconds
        lines.append(f"| {run.name} | {run.gpus} | {describe(run)} | {run.measured_step_seconds:.2f} | "
                     f"{predicted:.2f} | {run.measured_step_seconds / predicted:.2f} |")
    return lines


def bridge_rows() -> list[str]:
    return _step_time_rows(MEGATRON_BRIDGE, "system | layout",
                           lambda run: f"{run.system} | tp {run.tp} pp {run.pp} cp {run.cp} vpp {run.vpp or 1}")


def bridge_moe_rows() -> list[str]:
    return _step_time_rows(MEGATRON_BRIDGE_H100_MOE, "layout | their MoE settings",
                           lambda run: f"tp {run.tp} pp {run.pp} vpp {run.vpp or 1} ep {run.ep} | {run.settings}")


def main() -> None:
    for title, rows in (("Narayanan et al. 2021, A100", narayanan_rows),
                        ("Megatron-Bridge dense recipes", bridge_rows),
                        ("Megatron-Bridge MoE recipes, H100 (not in the validation set)", bridge_moe_rows)):
        print(f"\n## {title}\n")
        print("\n".join(rows()))


if __name__ == "__main__":
    main()
