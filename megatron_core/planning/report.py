"""What ``tools/plan_parallelism.py --explain`` prints and ``--plot`` draws: each layout's step time by part,
and why each axis of the chosen layout has its size."""
from __future__ import annotations

from megatron_core.planning.choose import axis_reasons
from megatron_core.planning.confidence import how_sure, memory_note, model_error
from megatron_core.planning.step_time import PARTS


def layout_name(plan) -> str:
    lay = plan.layout
    name = f"tp{lay.tp} pp{lay.pp} dp{lay.dp}"
    for label, value, default in (("cp", lay.cp, 1), ("ep", lay.ep, 1), ("etp", lay.etp, 1), ("vpp", lay.vpp, None)):
        if value != default:
            name += f" {label}{value}"
    name += f" Z{lay.zero_stage}" + (" SP" if lay.sequence_parallel else "")
    name += {None: "", "selective": " sel", "full": " full"}[lay.recompute] + (" ZB" if lay.zero_bubble else "")
    name += (" E|L" if lay.embedding_loss_split else "") + (" TPO" if lay.tp_comm_overlap else "")
    return name


def parts_table(plans: list, top: int) -> str:
    """Markdown table: milliseconds of each part of the step for the first ``top`` plans."""
    shown = [plan for plan in plans[:top] if plan.time is not None]
    used = [part for part in PARTS if any(plan.time.parts[part] > 0 for plan in shown)]
    rows = ["| layout | " + " | ".join(used) + " | step ms | TFLOP/s |",
            "| --- |" + " ---: |" * (len(used) + 2)]
    for plan in shown:
        cells = " | ".join(f"{1e3 * plan.time.parts[part]:.1f}" for part in used)
        rows.append(f"| {layout_name(plan)} | {cells} | {1e3 * plan.step_seconds:.1f} | "
                    f"{plan.tflops_per_device:.1f} |")
    return "\n".join(rows)


def explain(plans: list, *, budget_bytes: float, tolerance: float, top: int = 5, hardware_name: str = "h100") -> str:
    """The chosen plan (``plans[0]``): its memory and step time by part, beside the next layouts, how sure the
    model is (``planning.confidence``, against the published runs nearest ``hardware_name``), and one line per
    axis saying why it has its size."""
    chosen = plans[0]
    fitting = [plan for plan in plans if plan.fits]
    fastest = min(fitting, key=lambda plan: plan.step_seconds) if fitting else chosen
    lines = [f"chosen: {layout_name(chosen)}: {chosen.memory_bytes / 2**30:.2f} GiB per rank (states "
             f"{chosen.model_state_bytes / 2**30:.2f}, activations {chosen.activation_bytes / 2**30:.2f}, "
             f"transients {chosen.transient_bytes / 2**30:.2f}), {chosen.step_seconds:.3f} s per step, "
             f"{chosen.tflops_per_device:.1f} TFLOP/s per device"]
    if fastest is not chosen:
        faster = 100 * (1 - fastest.step_seconds / chosen.step_seconds)
        lines.append(f"the fastest, {layout_name(fastest)}, is {faster:.1f}% faster: within the {100 * tolerance:g}% "
                     "tolerance, the simpler layout is chosen")
    lines += ["", how_sure(chosen, plans, hardware_name) + " " + memory_note(chosen, plans, budget_bytes)]
    lines += ["", "step time by part (milliseconds per step on the busiest pipeline stage; the parts sum to the "
              "step):", "", parts_table(plans, top), "", "why each axis has its size:"]
    spread = model_error(hardware_name)[0].spread
    lines += [f"- {line}" for line in axis_reasons(chosen, plans, budget_bytes, tolerance, spread)]
    return "\n".join(lines)


def plot(plans: list, path: str, top: int = 8) -> None:
    """A stacked bar per layout (the first ``top``): seconds per step by part. Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError(f"--plot {path} needs matplotlib ({error}): pip install matplotlib") from error
    shown = [plan for plan in plans[:top] if plan.time is not None]
    used = [part for part in PARTS if any(plan.time.parts[part] > 0 for plan in shown)]
    fig, ax = plt.subplots(figsize=(1.3 * len(shown) + 3, 4.5))
    bottoms = [0.0] * len(shown)
    for part in used:
        values = [plan.time.parts[part] for plan in shown]
        ax.bar(range(len(shown)), values, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(shown)), [layout_name(plan).replace(" ", "\n", 2) for plan in shown], fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title("predicted step time by part (first: the chosen layout)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["layout_name", "parts_table", "explain", "plot"]
