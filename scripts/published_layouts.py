"""The planner against layouts experts chose and measured (``megatron_core.planning.published`` and
``published_moe``): the tables of docs/performance.md, printed from the code that makes them.

    python scripts/published_layouts.py            # all three tables (about 10 s on a laptop CPU)

Narayanan et al. 2021 (A100): predicted TFLOP/s per GPU at their layout over the measured; Megatron-Bridge's
dense and MoE recipes (H100, B200): measured step time over predicted, from the published tokens per second.
"""
from __future__ import annotations

from megatron_core.planning.published import MEGATRON_BRIDGE, NARAYANAN_2021
from megatron_core.planning.published_moe import MEGATRON_BRIDGE_H100_MOE


def narayanan_rows() -> list[str]:
    lines = ["| model | GPUs | tp | pp | measured TFLOP/s | predicted | predicted / measured |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in NARAYANAN_2021:
        predicted = run.plan().tflops_per_device
        lines.append(f"| {run.name} | {run.gpus} | {run.tp} | {run.pp} | {run.tflops_per_gpu:.0f} | {predicted:.0f} "
                     f"| {predicted / run.tflops_per_gpu:.2f} |")
    return lines


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
