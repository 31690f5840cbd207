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


def bridge_rows() -> list[str]:
    lines = ["| model | system | GPUs | layout | measured s | predicted s | measured / predicted |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for run in MEGATRON_BRIDGE:
        layout = f"tp {run.tp} pp {run.pp} cp {run.cp} vpp {run.vpp or 1}"
        predicted = run.plan().step_seconds
        lines.append(f"| {run.name} | {run.system} | {run.gpus} | {layout} | {run.measured_step_seconds:.2f} | "
                     f"{predicted:.2f} | {run.measured_step_seconds / predicted:.2f} |")
    return lines


def bridge_moe_rows() -> list[str]:
    lines = ["| model | GPUs | layout | their MoE settings | measured s | predicted s | measured / predicted |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for run in MEGATRON_BRIDGE_H100_MOE:
        layout = f"tp {run.tp} pp {run.pp} vpp {run.vpp or 1} ep {run.ep}"
        predicted = run.plan().step_seconds
        lines.append(f"| {run.name} | {run.gpus} | {layout} | {run.settings} | {run.measured_step_seconds:.2f} | "
                     f"{predicted:.2f} | {run.measured_step_seconds / predicted:.2f} |")
    return lines


def main() -> None:
    for title, rows in (("Narayanan et al. 2021, A100", narayanan_rows),
                        ("Megatron-Bridge dense recipes", bridge_rows),
                        ("Megatron-Bridge MoE recipes, H100 (not in the validation set)", bridge_moe_rows)):
        print(f"\n## {title}\n")
        print("\n".join(rows()))


if __name__ == "__main__":
    main()
