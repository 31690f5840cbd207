"""What each pipeline rank did and when: forward, backward, send, recv and idle intervals; the measured bubble;
a Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing) and a PNG picture of the schedule."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional

import torch.distributed as dist

from megatron_core.utils.png import atomic_write, encode_png

COLORS = {"forward": (66, 133, 244), "backward": (52, 168, 83), "send": (251, 188, 5), "recv": (234, 67, 53),
          "idle": (235, 235, 235)}


@dataclasses.dataclass
class Event:
    kind: str  # forward | backward | send | recv | idle
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

    def busy(self, kinds: tuple[str, ...] = ("forward", "backward")) -> float:
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
            if e["chunk"] is not None and e["kind"] in ("forward", "backward"):
                label += f".c{e['chunk']}"
            trace.append({"name": label, "cat": e["kind"], "ph": "X", "pid": 0, "tid": rank,
                          "ts": e["start"] * 1e6, "dur": (e["end"] - e["start"]) * 1e6})
    atomic_write(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}).encode())


def write_png(per_rank: list[list[dict]], path: str, *, width: int = 1200, row_height: int = 28) -> None:
    """A picture of the schedule: one row per rank, time left to right, colored by event kind
    (forward blue, backward green, send yellow, recv red, idle grey)."""
    total = max((e["end"] for events in per_rank for e in events), default=1.0) or 1.0
    height = row_height * len(per_rank)
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    for rank, events in enumerate(per_rank):
        for e in sorted(events, key=lambda e: e["kind"] in ("forward", "backward")):  # compute drawn on top
            x0, x1 = int(e["start"] / total * (width - 1)), max(int(e["end"] / total * (width - 1)), 0)
            for y in range(rank * row_height + 2, (rank + 1) * row_height - 2):
                for x in range(x0, x1 + 1):
                    pixels[y][x] = COLORS[e["kind"]]
            if e["kind"] in ("forward", "backward") and x1 - x0 > 2:  # a dark edge separates passes
                for y in range(rank * row_height + 2, (rank + 1) * row_height - 2):
                    pixels[y][x0] = (40, 40, 40)
    atomic_write(path, encode_png(pixels))


def summarize(per_rank: list[list[dict]], formula: float) -> str:
    """Per-rank measured bubble (idle + communication over compute, from the rank's first to its last
    event) next to the formula."""
    lines = [f"bubble formula (p-1)/(v*m) = {formula:.3f}"]
    for rank, events in enumerate(per_rank):
        total = max((e["end"] for e in events), default=0.0) - min((e["start"] for e in events), default=0.0)
        compute = sum(e["end"] - e["start"] for e in events if e["kind"] in ("forward", "backward"))
        lines.append(f"  pp rank {rank}: measured bubble {(total - compute) / max(compute, 1e-12):.3f}")
    return "\n".join(lines)
