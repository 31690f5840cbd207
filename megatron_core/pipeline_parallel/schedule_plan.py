"""The order of forward and backward passes each pipeline rank runs (pure: no communication).

A schedule is, per rank, a list of ``Op(kind, chunk, microbatch)``; the executor (``executor.py``) runs it
and derives every transfer from it (an F of a chunk that is not the model's first receives an activation,
an F of a chunk that is not the model's last sends one; likewise for gradients of B). Keeping the order
separate from the communication makes each schedule a few lines and lets ``simulate`` check, without any
process, that every rank's order can run to completion (no deadlock) and how large the bubble is.

1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r runs ``min(p - r - 1, m)`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards; it holds at most ``p - r``
micro-batches' activations. Interleaved 1F1B (same paper, section 2.2): each rank holds v model chunks;
virtual micro-batch k runs on chunk ``(k // p) % v`` (backward: reversed) for micro-batch
``(k // (p v)) p + k % p``, with ``2 (p - r - 1) + (v - 1) p`` warm-up forwards. Bubble fraction
(idle over compute time) is ``(p - 1) / (v m)``.

Zero bubble, ZB-H1 (Qi et al. 2023, arXiv 2401.10241): backward is split into B (input gradients, which the
previous stage waits for) and W (weight gradients, which nobody waits for). Rank r runs the 1F1B order of F
and B, and the W of micro-batch i after the B of micro-batch ``i + r``; its last r W passes run after its last
B, while the ranks before it finish their backwards. The later a stage, the more W passes it holds back
(the last stage, the bottleneck of a 1F1B pipeline, sends each input gradient a W pass earlier); a held-back
W keeps only the inputs and output gradients of the linear layers, so no rank holds more than rank 0's p
micro-batches of 1F1B. With F = B = W the bubble is ``(p - 1) / (3 m)``, a third of 1F1B's. The "cooldown"
variant holds back only the last r W passes of rank r (``zero_bubble_ops(defer=...)``).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

ZERO_BUBBLE_DEFER = ("all", "cooldown")


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "F" (forward), "B" (backward; input gradients only under zero bubble) or "W" (weight gradients)
    chunk: int  # model chunk index on this rank (0 without interleaving)
    microbatch: int


def no_pipelining_ops(num_microbatches: int, *, forward_only: bool = False) -> list[Op]:
    """One stage: forward and backward of each micro-batch in turn."""
    ops = []
    for mb in range(num_microbatches):
        ops.append(Op("F", 0, mb))
        if not forward_only:
            ops.append(Op("B", 0, mb))
    return ops


def one_f_one_b_ops(pp_rank: int, pp_size: int, num_microbatches: int, *, forward_only: bool = False) -> list[Op]:
    """The 1F1B order of pipeline rank ``pp_rank``."""
    m = num_microbatches
    if forward_only:
        return [Op("F", 0, mb) for mb in range(m)]
    warmup = min(pp_size - pp_rank - 1, m)
    ops = [Op("F", 0, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", 0, warmup + i), Op("B", 0, i)]
    ops += [Op("B", 0, mb) for mb in range(m - warmup, m)]
    return ops


def resolve_zero_bubble_defer(defer: Optional[str], device_type: str) -> str:
    """The split a zero-bubble run uses: ``defer`` when given, else "cooldown" on CPU (where a split
    backward costs more than it saves) and "all" (ZB-H1) on accelerators."""
    if defer is None:
        return "cooldown" if device_type == "cpu" else "all"
    if defer not in ZERO_BUBBLE_DEFER:
        raise ValueError(f"zero-bubble defer must be one of {ZERO_BUBBLE_DEFER}, got {defer!r}")
    return defer


def zero_bubble_ops(pp_rank: int, pp_size: int, num_microbatches: int, *, forward_only: bool = False,
                    defer: str = "all") -> list[Op]:
    """The zero-bubble order of pipeline rank ``pp_rank``: 1F1B's F and B, plus the W passes of the backwards
    that are split (a B without a W in the order computes its weight gradients too: rank 0's, whose input
    gradients nobody waits for).

    ``defer="all"`` (ZB-H1): on rank r > 0 every backward is split, and the W of micro-batch i runs after the B
    of micro-batch ``i + r``. ``defer="cooldown"``: only the last r backwards of rank r are split, their W
    passes after the last B, while the earlier stages finish their backwards (the end of ZB-H1's order,
    without splitting the steady-state backwards, where on CPU a split costs more than it saves).
    """
    if defer not in ZERO_BUBBLE_DEFER:
        raise ValueError(f"zero-bubble defer must be one of {ZERO_BUBBLE_DEFER}, got {defer!r}")
    one_f_one_b = one_f_one_b_ops(pp_rank, pp_size, num_microbatches, forward_only=forward_only)
    if forward_only or pp_rank == 0:
        return one_f_one_b
    m, r = num_microbatches, pp_rank
    split = range(m) if defer == "all" else range(max(m - r, 0), m)
    ops, weights_done = [], split[0] if split else m
    for op in one_f_one_b:
        ops.append(op)
        if defer == "all" and op.kind == "B" and op.microbatch >= r:
            ops.append(Op("W", 0, weights_done))  # B passes come in micro-batch order: W_i follows B_(i+r)
            weights_done += 1
    return ops + [Op("W", 0, mb) for mb in range(weights_done, m)]


def _virtual_table(num_microbatches: int, vpp_size: int, group_size: int) -> list[tuple[int, int]]:
    """``(chunk, microbatch)`` of each virtual micro-batch: groups of ``group_size`` micro-batches (the last
    group takes the rest) run on chunk 0, then on chunk 1, ... (Megatron's ``get_schedule_table``)."""
    table = []
    for start in range(0, num_microbatches, group_size):
        group = range(start, min(start + group_size, num_microbatches))
        table += [(chunk, mb) for chunk in range(vpp_size) for mb in group]
    return table


def interleaved_ops(pp_rank: int, pp_size: int, vpp_size: int, num_microbatches: int, *,
                    forward_only: bool = False, group_size: Optional[int] = None) -> list[Op]:
    """The interleaved 1F1B order of pipeline rank ``pp_rank``: micro-batches in groups of ``group_size``
    (default pp_size; Megatron's ``microbatch_group_size_per_vp_stage``) per virtual stage, with
    ``2 (p - r - 1) + (v - 1) group_size`` warm-up forwards (see ``check_microbatch_group`` for the sizes)."""
    group_size = group_size or pp_size
    total = num_microbatches * vpp_size
    table = _virtual_table(num_microbatches, vpp_size, group_size)
    forwards = [Op("F", chunk, mb) for chunk, mb in table]
    if forward_only:
        return forwards
    backwards = [Op("B", vpp_size - 1 - chunk, mb) for chunk, mb in table]
    warmup = min(2 * (pp_size - pp_rank - 1) + (vpp_size - 1) * group_size, total)
    ops = forwards[:warmup]
    for i in range(total - warmup):
        ops += [forwards[warmup + i], backwards[i]]
    return ops + backwards[total - warmup:]


def check_microbatch_group(num_microbatches: int, pp_size: int, group_size: Optional[int] = None) -> None:
    """Raises ValueError naming the values unless the interleaved schedule can run ``num_microbatches`` in
    groups of ``group_size`` (default pp_size): pp_size <= group_size <= num_microbatches, and the last group
    empty or of at least pp_size micro-batches (Megatron's rule: a smaller one would stall the pipeline)."""
    if group_size is None or group_size == pp_size:
        if num_microbatches % pp_size != 0:
            raise ValueError(f"num_microbatches {num_microbatches} is not divisible by pipeline_model_parallel_size "
                             f"{pp_size}, which the interleaved schedule requires")
        return
    rest = num_microbatches % group_size
    if not pp_size <= group_size <= num_microbatches or 0 < rest < pp_size:
        raise ValueError(f"microbatch_group_size_per_vp_stage {group_size} does not fit num_microbatches "
                         f"{num_microbatches} at pipeline_model_parallel_size {pp_size}: it must lie in [pp, "
                         f"num_microbatches] and leave a last group of 0 or >= pp micro-batches (here {rest})")


def bubble_fraction_formula(pp_size: int, num_microbatches: int, vpp_size: Optional[int] = None, *,
                            zero_bubble: bool = False) -> float:
    """``(p - 1) / (v m)``: pipeline idle time over ideal compute time; ``(p - 1) / (3 m)`` for ZB-H1
    (``zero_bubble``, with F = B = W)."""
    if zero_bubble:
        return (pp_size - 1) / (3 * num_microbatches)
    return (pp_size - 1) / ((vpp_size or 1) * num_microbatches)


def pass_inputs(rank_ops: list[list[Op]], vpp_size: int = 1) -> list[list[list[tuple[str, int, int, int]]]]:
    """For each rank's each pass, the passes ``(kind, rank, chunk, microbatch)`` whose output it needs: a
    forward the previous model chunk's forward, a backward its own forward and the next chunk's backward, a W
    its own B (``simulate``'s dependencies; reusable for one set of orders)."""
    p = len(rank_ops)
    last_chunk = (p - 1, vpp_size - 1)

    def inputs(rank: int, op: Op) -> list[tuple[str, int, int, int]]:
        if op.kind == "F":
            if (rank, op.chunk) == (0, 0):
                return []
            prev = (rank - 1, op.chunk) if rank > 0 else (p - 1, op.chunk - 1)
            return [("F", *prev, op.microbatch)]
        if op.kind == "W":
            return [("B", rank, op.chunk, op.microbatch)]
        deps = [("F", rank, op.chunk, op.microbatch)]
        if (rank, op.chunk) != last_chunk:
            nxt = (rank + 1, op.chunk) if rank < p - 1 else (0, op.chunk + 1)
            deps.append(("B", *nxt, op.microbatch))
        return deps

    return [[inputs(rank, op) for op in ops] for rank, ops in enumerate(rank_ops)]


def simulate(rank_ops: list[list[Op]], vpp_size: int = 1, *, forward_time: float = 1.0,
             backward_time: float = 2.0, weight_time: float = 1.0,
             durations: Optional[dict[tuple[int, str, int, int], float]] = None,
             rank_times: Optional[list[tuple[float, float, float]]] = None,
             inputs: Optional[list] = None) -> list[float]:
    """Runs every rank's order with unit-cost passes and instant transfers; returns each rank's finish time.
    (Under zero bubble, give B the input-gradient time: ``backward_time=1``; W costs ``weight_time``, and a
    B without a W of its own costs both.)

    ``durations`` maps ``(rank, kind, chunk, microbatch)`` to a pass's time (e.g. measured), overriding
    ``forward_time`` / ``backward_time`` for the passes it names; ``rank_times`` gives each rank its own
    ``(forward_time, backward_time, weight_time)``; ``inputs``: ``pass_inputs(rank_ops, vpp_size)``, when the
    caller keeps it for many runs of the same orders.

    An op starts once this rank finished its previous op and its input exists: the activation from the
    previous model chunk's forward, the gradient from the next chunk's backward (and for B, the own F; for W,
    the own B). Raises ValueError if some rank can never proceed (the orders would deadlock).
    """
    p = len(rank_ops)
    split = [{(op.chunk, op.microbatch) for op in ops if op.kind == "W"} for ops in rank_ops]
    has_weight_passes = any(split)
    done: dict[tuple[str, int, int, int], float] = {}
    position, clock = [0] * p, [0.0] * p

    # A rank runs its ops in order until one waits on an input; a rank's inputs come from its two neighbours
    # in the chunk ring, so only those are looked at again after it advanced (every op's start time is fixed
    # by its inputs and its rank's previous op: the order ranks are visited in does not change it).
    times = rank_times or [(forward_time, backward_time, weight_time)] * p
    costs = [{"F": f, "B": b, "W": w} for f, b, w in times]
    deps_of = inputs if inputs is not None else pass_inputs(rank_ops, vpp_size)
    waiting, queued = collections.deque(range(p)), [True] * p
    while waiting:
        rank = waiting.popleft()
        queued[rank] = False
        ops, deps_at, rank_costs, whole_backward = rank_ops[rank], deps_of[rank], costs[rank], split[rank]
        first, now = position[rank], clock[rank]
        at = first
        while at < len(ops):
            start = now  # the latest of this rank's clock and its inputs' finish times
            for dep in deps_at[at]:
                finished = done.get(dep)
                if finished is None:
                    break
                start = finished if finished > start else start
            else:
                op = ops[at]
                cost = rank_costs[op.kind]
                if op.kind == "B" and has_weight_passes and (op.chunk, op.microbatch) not in whole_backward:
                    cost += rank_costs["W"]  # a whole backward (zero bubble: no W of its own)
                if durations is not None:
                    cost = durations.get((rank, op.kind, op.chunk, op.microbatch), cost)
                now = start + cost
                done[(op.kind, rank, op.chunk, op.microbatch)] = now
                at += 1
                continue
            break  # an input is missing: this rank waits
        position[rank], clock[rank] = at, now
        for other in ({(rank - 1) % p, (rank + 1) % p} if at > first else ()):
            if not queued[other] and position[other] < len(rank_ops[other]):
                waiting.append(other)
                queued[other] = True
    stuck = {r: rank_ops[r][position[r]] for r in range(p) if position[r] < len(rank_ops[r])}
    if stuck:
        raise ValueError(f"the pipeline orders deadlock; ranks wait at {stuck}")
    return clock
