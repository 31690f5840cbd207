"""Choosing a layout as an expert would: among the fitting layouts within ``tolerance`` (default 3%) of the
best predicted step time, the simplest; and why each axis has its size.

Differences under a few percent are inside the step-time model's own error, so they should not decide. The
simplest layout is the one with the fewest moving parts, in this order: no context parallelism (it only pays
when sequences need it for memory), the lowest pipeline size, the largest data-parallel size (so the lowest
tp x cp), no interleaving or zero bubble, the lowest ZeRO stage, no recompute over selective over full, no
sequence parallelism, the lowest ep, and only then the faster.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping, Optional

RECOMPUTE_ORDER = MappingProxyType({None: 0, "selective": 1, "full": 2})
AXES: Mapping[str, Callable] = MappingProxyType({
    "tp": lambda lay: lay.tp, "pp": lambda lay: lay.pp, "cp": lambda lay: lay.cp, "dp": lambda lay: lay.dp,
    "ep": lambda lay: lay.ep, "vpp": lambda lay: lay.vpp or 1, "ZeRO": lambda lay: lay.zero_stage,
    "recompute": lambda lay: lay.recompute or "none",
    "SP": lambda lay: "on" if lay.sequence_parallel else "off",
})


def simplicity(plan) -> tuple:
    """Sort key: simpler layouts first (see the module docstring), then faster."""
    lay = plan.layout
    return (lay.cp > 1, lay.pp, -lay.dp, lay.tp, (lay.vpp or 1) > 1 or lay.zero_bubble, lay.zero_stage,
            RECOMPUTE_ORDER[lay.recompute], lay.sequence_parallel, lay.ep, lay.etp, plan.step_seconds)


def choose_plan(plans: list, tolerance: float = 0.03) -> Optional[object]:
    """The simplest fitting plan within ``tolerance`` of the fastest fitting one (None if none fits)."""
    fitting = [plan for plan in plans if plan.fits]
    if not fitting:
        return None
    best = min(plan.step_seconds for plan in fitting)
    near = [plan for plan in fitting if plan.step_seconds <= best * (1 + tolerance)]
    return min(near, key=simplicity)


def _describe(plan) -> str:
    lay = plan.layout
    return (f"tp {lay.tp} pp {lay.pp} cp {lay.cp} dp {lay.dp}" + (f" ep {lay.ep}" if lay.ep > 1 else "")
            + f" ZeRO {lay.zero_stage} recompute {lay.recompute or 'none'}")


def axis_reasons(chosen, plans: list, budget_bytes: float, tolerance: float = 0.03, spread: float = 0.0) -> list[str]:
    """One line per axis: the chosen value, and for every other value of that axis the best layout with it:
    "does not fit" (its smallest memory against the budget), "x% slower" (marked "within the model's error"
    when x is under ``spread``: ``planning.confidence``) or "within the tolerance, less simple"."""
    lines = []
    for axis, value_of in AXES.items():
        value = value_of(chosen.layout)
        others: dict = {}
        for plan in plans:
            other = value_of(plan.layout)
            if other != value:
                others.setdefault(other, []).append(plan)
        if not others:
            lines.append(f"{axis} {value}: the only value possible")
            continue
        notes = []
        for other in sorted(others, key=lambda v: (isinstance(v, str), v if not isinstance(v, str) else 0, str(v))):
            group = others[other]
            fitting = [plan for plan in group if plan.fits]
            if not fitting:
                smallest = min(group, key=lambda plan: plan.memory_bytes)
                notes.append(f"{axis} {other} does not fit ({smallest.memory_bytes / 2**30:.1f} GiB at best "
                             f"> {budget_bytes / 2**30:.0f} GiB, {_describe(smallest)})")
                continue
            fastest = min(fitting, key=lambda plan: plan.step_seconds)
            slower = fastest.step_seconds / chosen.step_seconds - 1
            if slower > tolerance:
                unsure = ", within the model's error" if slower <= spread else ""
                notes.append(f"{axis} {other} is {100 * slower:.1f}% slower ({_describe(fastest)}{unsure})")
            else:
                notes.append(f"{axis} {other} is within {100 * tolerance:g}% ({100 * slower:+.1f}%) but less simple")
        lines.append(f"{axis} {value}: " + "; ".join(notes))
    return lines


__all__ = ["choose_plan", "simplicity", "axis_reasons"]
