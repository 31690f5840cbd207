"""What each pipeline rank did and when: forward, backward, send, recv and idle intervals; the measured bubble;
a Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing) and a PNG picture of the schedule
(matplotlib)."""
from __future__ import annotations

import dataclasses
import json
import time
from types import MappingProxyType
from typing import Optional

import torch.distributed as dist

from megatron_core.utils.files import atomic_write, new_figure, save_figure

COLORS = MappingProxyType({"forward": "#4285f4", "backward": "#34a853", "weight": "#9c27b0", "send": "#fbbc05",
                           "recv": "#ea4335", "idle": "#ebebeb"})
COMPUTE = ("forward", "backward", "weight")
"""The event kinds that are compute (``weight``: the W passes of the zero-bubble schedule)."""


@dataclasses.dataclass
class Event:
    kind: str  # forward | backward | weight | send | recv | idle
    start: float  # seconds since the timeline started
    end: float
    microbatch: Optional[int] = None
    chunk: Optional[int] = None


class Timeline:
    """Records this rank's events during one schedule run (pass it as ``timeline=`` to a schedule)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.origin = time.perf_counter()
        self.finish = self.origin
        self.max_in_flight = 0
        """Most micro-batches whose forward ran and backward had not yet (activations held)."""

    def record(self, kind: str, start: float, end: float, microbatch: Optional[int] = None,
               chunk: Optional[int] = None) -> None:
        self.events.append(Event(kind, start - self.origin, end - self.origin, microbatch, chunk))
        self.finish = max(self.finish, end)

    def stop(self) -> None:
        self.finish = time.perf_counter()

    @property
    def total(self) -> float:
        return self.finish - self.origin

    def busy(self, kinds: tuple[str, ...] = COMPUTE) -> float:
        return sum(e.end - e.start for e in self.events if e.kind in kinds)

    def with_idle(self) -> list[Event]:
        """The events plus ``idle`` gaps where nothing was recorded."""
        events, cursor = [], 0.0
        for event in sorted(self.events, key=lambda e: e.start):
            if event.start > cursor:
                events.append(Event("idle", cursor, event.start))
            events.append(event)
            cursor = max(cursor, event.end)
        if self.total > cursor:
            events.append(Event("idle", cursor, self.total))
        return events

    def measured_bubble(self) -> float:
        """Time not spent computing over time spent computing, on this rank."""
        compute = self.busy()
        return (self.total - compute) / compute if compute > 0 else float("inf")


def gather_timelines(timeline: Timeline, group) -> list[list[dict]]:
    """All pipeline ranks' events (as dicts, with idle gaps), in pipeline-rank order, on one time axis.
    Collective over ``group``.

    Ranks are aligned by their start on ``time.perf_counter`` (CLOCK_MONOTONIC: shared by the processes of one
    host; across hosts each rank keeps its own origin).
    """
    mine = (timeline.origin, [dataclasses.asdict(e) for e in timeline.with_idle()])
    if group is None or dist.get_world_size(group) == 1:
        return [mine[1]]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    first = min(origin for origin, _ in gathered)
    return [[{**e, "start": e["start"] + origin - first, "end": e["end"] + origin - first} for e in events]
            for origin, events in gathered]


def write_chrome_trace(per_rank: list[list[dict]], path: str) -> None:
    """A Chrome trace: one row (tid) per pipeline rank, complete ("X") events in microseconds."""
    trace = []
    for rank, events in enumerate(per_rank):
        for e in events:
            label = e["kind"] if e["microbatch"] is None else f"{e['kind'][0].upper()}{e['microbatch']}"
            if e["chunk"] is not None and e["kind"] in COMPUTE:
                label += f".c{e['chunk']}"
            trace.append({"name": label, "cat": e["kind"], "ph": "X", "pid": 0, "tid": rank,
                          "ts": e["start"] * 1e6, "dur": (e["end"] - e["start"]) * 1e6})
    atomic_write(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}).encode())


def write_png(per_rank: list[list[dict]], path: str, *, formula: Optional[float] = None,
              title: str = "pipeline schedule", formula_label: str = "(p-1)/(v*m)") -> None:
    """A picture of the schedule: one labelled row per pipeline rank, time (ms) left to right; forward passes
    blue, backward green and weight-gradient passes (zero bubble) purple, labelled with their micro-batch
    (``F3``, ``B3``, ``W3``; ``.c1`` for virtual chunk 1), sends yellow, receives red, idle left blank. The
    title carries the measured bubble of each rank (and the formula's value when ``formula`` is given,
    written as ``formula_label``)."""
    figure = new_figure(11.0, 0.7 * len(per_rank) + 1.6)
    ax = figure.add_subplot()
    total_ms = max((e["end"] for events in per_rank for e in events), default=1.0) * 1e3
    interleaved = any(e["chunk"] for events in per_rank for e in events)
    for rank, events in enumerate(per_rank):
        for e in sorted(events, key=lambda e: e["kind"] in COMPUTE):  # compute drawn on top
            if e["kind"] == "idle":
                continue
            start, width = e["start"] * 1e3, (e["end"] - e["start"]) * 1e3
            ax.broken_barh([(start, width)], (rank - 0.38, 0.76), facecolors=COLORS[e["kind"]],
                           edgecolors="#303030" if e["kind"] in COMPUTE else "none", linewidth=0.5)
            if e["kind"] in COMPUTE and e["microbatch"] is not None and width > total_ms / 45:
                label = f"{e['kind'][0].upper()}{e['microbatch']}" + (f".c{e['chunk']}" if interleaved else "")
                ax.text(start + width / 2, rank, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(per_rank)), [f"pp rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlim(0, total_ms)
    ax.set_xlabel("time (ms)")
    bubbles = ", ".join(f"{b:.2f}" for b in measured_bubbles(per_rank))
    ax.set_title(f"{title}: measured bubble per rank {bubbles}"
                 + ("" if formula is None else f" (formula {formula_label} = {formula:.3f})"), fontsize=10)
    kinds = {e["kind"] for events in per_rank for e in events}
    legend = [kind for kind in ("forward", "backward", "weight", "send", "recv") if kind != "weight" or kind in kinds]
    handles = [ax.barh(0, 0, color=COLORS[kind], label=kind) for kind in legend]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.2 / len(per_rank)), ncol=4,
              frameon=False)
    save_figure(figure, path)


def measured_bubbles(per_rank: list[list[dict]]) -> list[float]:
    """Per rank: idle + communication time over compute time, from the rank's first to its last event."""
    bubbles = []
    for events in per_rank:
        total = max((e["end"] for e in events), default=0.0) - min((e["start"] for e in events), default=0.0)
        compute = sum(e["end"] - e["start"] for e in events if e["kind"] in COMPUTE)
        bubbles.append((total - compute) / max(compute, 1e-12))
    return bubbles


def summarize(per_rank: list[list[dict]], formula: float) -> str:
    """Per-rank measured bubble (idle + communication over compute, from the rank's first to its last
    event) next to the formula."""
    lines = [f"bubble formula (p-1)/(v*m) = {formula:.3f}"]
    lines += [f"  pp rank {rank}: measured bubble {bubble:.3f}"
              for rank, bubble in enumerate(measured_bubbles(per_rank))]
    return "\n".join(lines)
