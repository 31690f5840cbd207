"""How sure the planner is: the step-time model's error where a measurement exists, and which alternatives
that error cannot tell apart from the chosen layout.

The evidence is the published runs of ``planning.published``, planned at the layout their authors used and
set against what they measured: Narayanan et al. 2021's ten GPT models on A100s, and Megatron-Bridge's three
Llama-3 FP8 recipes (8B, 70B, 405B) on H100s. ``measured / predicted`` step time (= predicted / measured
TFLOP/s) over a profile's runs spans ``low`` to ``high``. A ranking compares two predictions, and each can be
off anywhere in that range, so two layouts whose predicted times differ by less than ``high / low - 1`` (the
**spread**) are not told apart by the model: only timing a few steps of each would. A constant error (every
prediction 5% fast) would not change the ranking; the spread is what can.

H200 shares H100's compute and links and is reported against the H100 runs; profiles without published runs
of their own (B200, a JSON from ``--calibrate``) against the A100 runs (the largest set), and say so.

Memory has its own error: the predicted peak is held within ``MEMORY_MARGIN`` (10%) of the measured one by
the tests (``tests/distributed/test_planner.py``: real CPU steps; ``tests/dryrun/test_dry_run.py``: dry runs of
Llama-3-70B, Mixtral, 8B layouts on fake CUDA), so a layout predicted within 10% of the device's memory may
not fit: the report says so, and points at ``tools/dry_run.py`` to measure it.
"""
from __future__ import annotations

import dataclasses
import functools

from megatron_core.planning.hardware import PROFILES

MEMORY_MARGIN = 0.10
"""The bound the planner's memory tests hold measured / predicted peak within (``0.90 < ratio < 1.10``)."""


@dataclasses.dataclass(frozen=True)
class ModelError:
    """``measured / predicted`` step time over ``runs`` published runs on ``profile``: ``low`` to ``high``."""

    low: float
    high: float
    runs: int
    profile: str
    source: str

    @property
    def spread(self) -> float:
        """The largest relative error between two of the runs' predictions (``high / low - 1``)."""
        return self.high / self.low - 1

    def describe(self) -> str:
        return (f"measured / predicted step time {self.low:.2f}-{self.high:.2f} over {self.runs} published "
                f"run{'s' if self.runs > 1 else ''} on {self.profile} ({self.source})")


@functools.lru_cache(maxsize=None)
def _narayanan_2021() -> ModelError:
    from megatron_core.planning.published import NARAYANAN_2021
    ratios = [run.plan().tflops_per_device / run.tflops_per_gpu for run in NARAYANAN_2021]
    return ModelError(min(ratios), max(ratios), len(ratios), "a100", "Narayanan et al. 2021, Table 1")


@functools.lru_cache(maxsize=None)
def _megatron_bridge(systems: tuple[str, ...]) -> ModelError:
    from megatron_core.planning.published import MEGATRON_BRIDGE
    ratios = [run.measured_step_seconds / run.plan().step_seconds for run in MEGATRON_BRIDGE if run.system in systems]
    return ModelError(min(ratios), max(ratios), len(ratios), "/".join(systems), "Megatron-Bridge's Llama-3 FP8 recipes")


def model_error(hardware_name: str) -> tuple[ModelError, str]:
    """(the evidence for a profile named ``hardware_name``, a note on how it applies): a profile's own
    published runs (a100, h100; h200 takes h100's; b200 its own with h100's), else the A100 runs."""
    a100 = _narayanan_2021()
    name = hardware_name.lower()
    if name == "a100":
        return a100, ""
    if name in ("h100", "h200"):
        note = "" if name == "h100" else "H200 has H100's compute and links: the H100 runs are the nearest"
        return _megatron_bridge(("h100",)), note
    if name == "b200":
        return _megatron_bridge(("h100", "b200")), ("B200's two runs with H100's three (the same recipes and "
                                                    "software): two runs alone would understate the spread")
    if name in PROFILES:
        return a100, f"no published run on {hardware_name}: the A100 evidence is the nearest"
    return a100, (f"{hardware_name} is not a shipped profile: the A100 evidence is shown; a calibrated machine's "
                  "own check is `python scripts/benchmark.py --only planner` (measured vs predicted steps)")


def uncertain_alternatives(chosen, plans: list, spread: float) -> list:
    """Fitting plans with another (tp, pp, cp) than ``chosen`` whose predicted step time is within ``spread`` of
    the fastest fitting plan, the fastest of each (tp, pp, cp) first: the layouts worth timing."""
    fitting = [plan for plan in plans if plan.fits]
    if not fitting:
        return []
    best = min(plan.step_seconds for plan in fitting)
    seen, shown = {_model_axes(chosen)}, []
    for plan in sorted(fitting, key=lambda plan: plan.step_seconds):
        if plan.step_seconds > best * (1 + spread):
            break
        if _model_axes(plan) not in seen:
            seen.add(_model_axes(plan))
            shown.append(plan)
    return shown


def _model_axes(plan) -> tuple[int, int, int]:
    return plan.layout.tp, plan.layout.pp, plan.layout.cp


def how_sure(chosen, plans: list, hardware_name: str, *, names: int = 4) -> str:
    """One paragraph: the model's measured error, its spread, and the (tp, pp, cp) layouts inside it."""
    from megatron_core.planning.report import layout_name
    error, note = model_error(hardware_name)
    others = uncertain_alternatives(chosen, plans, error.spread)
    text = (f"how sure: {error.describe()}{'; ' + note if note else ''}. Two predictions can be off by up to "
            f"{100 * error.spread:.0f}% relative to each other, ")
    if not others:
        return text + "and no fitting layout with another tp, pp or cp is predicted within that of the fastest: " \
                      "the choice of these axes is firm."
    fastest = min((plan for plan in plans if plan.fits), key=lambda plan: plan.step_seconds)
    listed = ", ".join(f"{layout_name(plan)} ({_versus(plan, fastest)})" for plan in others[:names])
    more = f" and {len(others) - names} more" if len(others) > names else ""
    return (text + f"so {len(others)} other tp/pp/cp choice{'s are' if len(others) > 1 else ' is'} within the "
            f"model's error of the fastest: {listed}{more} (vs the fastest). The model cannot rank these; time a "
            "few steps of each to choose.")


def _versus(plan, fastest) -> str:
    """``plan``'s predicted step time against the fastest's: ``+4.7%``, or ``the fastest`` itself (when the
    tolerance chose a simpler layout)."""
    if plan.step_seconds == fastest.step_seconds:
        return "the fastest"
    return f"{100 * (plan.step_seconds / fastest.step_seconds - 1):+.1f}%"


def memory_note(chosen, plans: list, budget_bytes: float) -> str:
    """One sentence on the chosen layout's predicted peak against ``budget_bytes`` and ``MEMORY_MARGIN``."""
    share = chosen.memory_bytes / budget_bytes
    tight = sum(plan.fits and plan.memory_bytes * (1 + MEMORY_MARGIN) > budget_bytes for plan in plans)
    text = (f"Memory: the chosen layout's predicted peak is {chosen.memory_bytes / 2**30:.1f} GiB, {100 * share:.0f}% "
            f"of {budget_bytes / 2**30:.0f} GiB; measured peaks are held within {100 * MEMORY_MARGIN:.0f}% of the "
            "prediction, ")
    if share * (1 + MEMORY_MARGIN) > 1:
        return text + ("so it may not fit: measure it with tools/dry_run.py (the same flags, --world-size) before "
                       "a long run, or lower --micro-batch-size.")
    return text + (f"so it fits with room ({tight} other fitting layout{'s are' if tight != 1 else ' is'} within "
                   "that of the budget).")


__all__ = ["MEMORY_MARGIN", "ModelError", "model_error", "uncertain_alternatives", "how_sure", "memory_note"]
