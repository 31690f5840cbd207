"""Optimizer states in the layout-independent form: one tensor per (state, parameter), shaped like the
parameter's tp shard, so they reshard across tp, pp, dp and ZeRO stages exactly like the weights.

The optimizer (``megatron_core.optimizer.MegatronOptimizer``) keeps, per *piece* (a parameter, or with
ZeRO 1-3 this dp rank's slice of its flattened elements ``[lo, hi)``), an fp32 master (unless it is the model
storage itself) and the inner optimizer's state (Adam ``exp_avg`` / ``exp_avg_sq``, SGD
``momentum_buffer``). Saving gathers the slices of every dp rank to dp rank 0, which writes
``optim/<state>/<global parameter name>`` (MoE experts: over expert-dp to its rank 0); loading cuts each rank's
slices out of the re-split tensors. With a partial distributed optimizer (N instances, each a full copy) only the
first instance gathers, over its own ranks; the files are the same as without it, so a run resumes at any N.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_core.parallel_state import ParallelState

INNER_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _piece_states(optimizer: Any, piece: Any) -> dict[str, torch.Tensor]:
    states = optimizer.piece_states(piece)  # wherever they live: device, host or NVMe files
    return {key: value.detach().reshape(-1).float().cpu() for key, value in states.items()
            if key == "master" or key in INNER_STATES}


def collect_optimizer_state(optimizer: Any, named: dict[str, Any],
                            state: ParallelState) -> tuple[dict[str, tuple[torch.Tensor, Any]], dict]:
    """``({"optim/<state>/<name>": (tensor shaped like the param's tp shard, param)}, scalars)`` on dp rank 0
    (empty tensors elsewhere); ``named`` maps this rank's global parameter names to its parameters. Collective over the
    data(-and-context)-parallel group when ZeRO shards it."""
    names = {id(param): name for name, param in named.items()}
    tensors = {}
    groups = ((False, state.dp_cp_group, state.dp_cp_ranks, state.dp_cp_rank),
              (True, state.expert_dp_group, state.expert_dp_ranks, state.expert_dp_rank))
    if state.num_distributed_optimizer_instances > 1:  # every instance holds the same states: the first one saves
        if state.inter_dist_opt_ranks.index(state.rank) != 0:
            return tensors, _scalars(optimizer)
        groups = tuple((expert, group, ranks, ranks.index(state.rank)) for expert, group, ranks in
                       ((False, state.intra_dp_cp_group, state.intra_dp_cp_ranks),
                        (True, state.intra_expert_dp_group, state.intra_expert_dp_ranks)))
    for expert, group, ranks, rank in groups:
        pieces = [p for p in optimizer.pieces if p.is_expert == expert]
        tensors.update(_gather_to_first(optimizer, pieces, names, named, group=group, ranks=ranks, rank=rank))
    return tensors, _scalars(optimizer)


def _gather_to_first(optimizer: Any, pieces: list, names: dict[int, str], named: dict[str, Any], *, group,
                     ranks: tuple[int, ...], rank: int) -> dict[str, tuple[torch.Tensor, Any]]:
    """The states of ``pieces`` gathered over ``group`` (the group that shards them: dp x cp for dense
    parameters, expert-dp for experts) to its first rank, as full tensors there; empty elsewhere."""
    sharded = any(piece.is_shard for piece in pieces)
    if rank != 0 and not sharded:  # replicated states: the first rank has them all, nothing to copy here
        return {}
    mine = [(names[id(piece.param)], piece.param_range, piece.param_shape, _piece_states(optimizer, piece))
            for piece in pieces]
    gathered = [mine]
    if sharded and dist.is_initialized() and group is not None and len(ranks) > 1:
        gathered = [None] * len(ranks) if rank == 0 else None
        dist.gather_object(mine, gathered, dst=ranks[0], group=group)
    if rank != 0:
        return {}
    flat: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for pieces in gathered:
        for name, (lo, hi), shape, states in pieces:
            shapes[name] = shape
            for key, values in states.items():
                buffer = flat.setdefault(f"optim/{key}/{name}", torch.zeros(_numel(shape), dtype=torch.float32))
                buffer[lo:hi] = values
    tensors = {}
    for key, buffer in flat.items():
        name = key.split("/", 2)[2]
        tensors[key] = (buffer.view(shapes[name]), named[name])
    return tensors


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _scalars(optimizer: Any) -> dict:
    scaler = optimizer.grad_scaler.state_dict() if optimizer.grad_scaler is not None else None
    return {"step": optimizer.step_count(),
            "grad_scaler": {k: float(v) for k, v in scaler.items()} if scaler else None}


@torch.no_grad()
def restore_optimizer_state(optimizer: Any, names: dict[int, str], scalars: dict,
                            read: Callable[[str, Any], Optional[torch.Tensor]]) -> None:
    """Fills each piece's master and inner state from ``read(tensor name, parameter)`` (the tensor re-split
    for this rank's tp shard, or None when the checkpoint lacks it)."""
    cache: dict[str, Optional[torch.Tensor]] = {}
    # masters that are copies start from the loaded weights: a checkpoint of a run whose masters were the
    # model storage (fp32, no offload) has none to restore; the loop below overwrites those it has
    optimizer.reload_model_params()
    for piece in optimizer.pieces:
        name = names[id(piece.param)]
        lo, hi = piece.param_range
        for key in ("master",) + INNER_STATES:
            if key == "master" and piece.aliased:
                continue
            full_name = f"optim/{key}/{name}"
            if full_name not in cache:
                cache[full_name] = read(full_name, piece.param)
            full = cache[full_name]
            if full is None:
                continue
            optimizer.set_piece_state(piece, key, full.reshape(-1)[lo:hi], step=scalars.get("step", 0.0))
    if optimizer.grad_scaler is not None and scalars.get("grad_scaler"):
        optimizer.grad_scaler.load_state_dict(scalars["grad_scaler"])
