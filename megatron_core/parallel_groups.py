"""The rank lists of every group of a parallel layout, as pure functions of the sizes (no process group):
``layout_groups`` (the tp-cp-dp-pp grid and the expert grid), ``distributed_optimizer_groups`` (the partial
distributed optimizer's instances) and ``hierarchical_groups`` (the levels of hierarchical cp), with the
checks of the sizes. ``parallel_state`` documents every group with examples and creates them."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

# The grid axes, slowest first; ``torch.arange(world).view(pp, dp, cp, tp)``.
_AXES = ("pp", "dp", "cp", "tp")


def validate_sizes(world_size: int, tp: int, pp: int, cp: int, vpp: Optional[int], ep: int = 1,
                    etp: int = 1) -> None:
    values = (
        f"world_size={world_size}, tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}, "
        f"context_parallel_size={cp}, virtual_pipeline_model_parallel_size={vpp}, expert_model_parallel_size={ep}, "
        f"expert_tensor_parallel_size={etp}"
    )
    sizes = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "context_parallel_size": cp,
             "expert_model_parallel_size": ep}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {size!r} ({values})")
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size must be None or >= 1, got {vpp!r} ({values})")
        if vpp > 1 and pp == 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size {vpp} needs pipeline_model_parallel_size > 1 "
                f"({values}); drop the virtual pipeline size or raise the pipeline size"
            )
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world_size {world_size} is not divisible by tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp} x context_parallel_size {cp} = {tp * pp * cp} ({values})"
        )
    per_stage = world_size // pp
    if per_stage % ep != 0:
        raise ValueError(
            f"expert_model_parallel_size {ep} does not divide the {per_stage} ranks of a pipeline stage (world_size "
            f"{world_size} / pipeline_model_parallel_size {pp} = tp x cp x dp) ({values}); choose an ep that "
            "divides tp x cp x dp"
        )
    if not isinstance(etp, int) or etp < 1:
        raise ValueError(f"expert_tensor_parallel_size must be an integer >= 1, got {etp!r} ({values})")
    if per_stage % (ep * etp) != 0:
        raise ValueError(f"expert_model_parallel_size {ep} x expert_tensor_parallel_size {etp} = {ep * etp} does not "
                         f"divide the {per_stage} ranks of a pipeline stage (tp x cp x dp) ({values}); choose ep and "
                         "etp whose product divides tp x cp x dp")


def rank_grid(world_size: int, tp: int, pp: int, cp: int = 1) -> torch.Tensor:
    """The global ranks laid out as ``[pp, dp, cp, tp]`` (tp fastest). Pure: no process group needed."""
    validate_sizes(world_size, tp, pp, cp, None)
    dp = world_size // (tp * pp * cp)
    return torch.arange(world_size).view(pp, dp, cp, tp)


def _groups_along(grid: torch.Tensor, axes: Sequence[str]) -> list[tuple[int, ...]]:
    """All rank groups that vary along ``axes`` of the grid (and are fixed along the others)."""
    keep = sorted(_AXES.index(a) for a in axes)  # grid order, so each group lists its ranks ascending
    others = [i for i in range(grid.dim()) if i not in keep]
    group_size = math.prod(grid.shape[i] for i in keep)
    return [tuple(row.tolist()) for row in grid.permute(*others, *keep).reshape(-1, group_size)]


def layout_groups(world_size: int, tp: int, pp: int, cp: int = 1,
                  ep: Optional[int] = None, etp: int = 1) -> dict[str, list[tuple[int, ...]]]:
    """Every group of the layout as lists of global ranks, keyed tp, cp, dp, dp_cp, tp_cp, pp, mp, embedding, and,
    when ``ep`` is given, etp, ep, expert_dp, expert_mp (expert grid ``[pp, expert_dp, ep, etp]``, etp fastest)."""
    validate_sizes(world_size, tp, pp, cp, None, ep or 1, etp)
    grid = rank_grid(world_size, tp, pp, cp)
    groups = {
        "tp": _groups_along(grid, ["tp"]),
        "cp": _groups_along(grid, ["cp"]),
        "dp": _groups_along(grid, ["dp"]),
        "dp_cp": _groups_along(grid, ["dp", "cp"]),
        "tp_cp": _groups_along(grid, ["tp", "cp"]),
        "pp": _groups_along(grid, ["pp"]),
        "mp": _groups_along(grid, ["pp", "tp"]),
    }
    groups["embedding"] = [tuple(sorted({ranks[0], ranks[-1]})) for ranks in groups["pp"]]
    if ep is None:
        return groups
    expert_dp = world_size // (pp * ep * etp)
    expert_grid = torch.arange(world_size).view(pp, expert_dp, ep, etp)  # [pp, expert_dp, ep, etp]
    groups["etp"] = [tuple(row.tolist()) for row in expert_grid.reshape(-1, etp)]
    groups["ep"] = [tuple(row.tolist()) for row in expert_grid.permute(0, 1, 3, 2).reshape(-1, ep)]
    groups["expert_dp"] = [tuple(row.tolist()) for row in expert_grid.permute(0, 2, 3, 1).reshape(-1, expert_dp)]
    groups["expert_mp"] = [tuple(sorted(row.tolist()))
                           for row in expert_grid.permute(1, 0, 2, 3).reshape(expert_dp, -1)]
    return groups


def distributed_optimizer_groups(groups: dict[str, list[tuple[int, ...]]],
                                 instances: int) -> dict[str, list[tuple[int, ...]]]:
    """The partial distributed optimizer's groups (module docstring) from ``layout_groups``' output: keyed
    intra_dp_cp, intra_expert_dp (when expert groups are present) and inter_dist_opt.

    Raises:
        ValueError: ``instances`` < 1 or not dividing the dp x cp (or expert-dp) size.
    """
    dp_cp, expert_dp = len(groups["dp_cp"][0]), len(groups["expert_dp"][0]) if "expert_dp" in groups else None
    if not isinstance(instances, int) or instances < 1 or dp_cp % instances:
        raise ValueError(f"num_distributed_optimizer_instances {instances!r} must be an integer >= 1 dividing "
                         f"dp x cp = {dp_cp}: each instance holds dp x cp / N ranks; choose one of "
                         f"{[n for n in range(1, dp_cp + 1) if dp_cp % n == 0]}")
    if expert_dp is not None and expert_dp % instances:
        raise ValueError(f"num_distributed_optimizer_instances {instances} does not divide the expert-data-parallel "
                         f"size {expert_dp} (tp x cp x dp / (ep x etp)): expert states are split into the same "
                         "instances; lower --expert-model-parallel-size or choose an N dividing both")

    def split(all_ranks: list[tuple[int, ...]]) -> tuple[list, list]:
        cut = [torch.tensor(ranks).view(instances, -1) for ranks in all_ranks]  # [instance, position]
        return ([tuple(row.tolist()) for c in cut for row in c], [tuple(row.tolist()) for c in cut for row in c.t()])

    result = {}
    result["intra_dp_cp"], result["inter_dist_opt"] = split(groups["dp_cp"])
    if expert_dp is not None:
        result["intra_expert_dp"], inter_expert = split(groups["expert_dp"])
        assert sorted(inter_expert) == sorted(result["inter_dist_opt"]), (inter_expert, result["inter_dist_opt"])
    return result


def hierarchical_groups(cp_groups: Sequence[tuple[int, ...]],
                        sizes: Sequence[int]) -> list[list[tuple[int, ...]]]:
    """Per level, the groups of hierarchical context parallelism (Megatron-LM's ``create_hierarchical_groups``):
    level ``l`` of a cp group holds the ranks that differ only in digit ``l`` of their cp rank written in the
    mixed radix ``sizes`` (innermost first), so level 0 is ``sizes[0]`` consecutive ranks."""
    levels = []
    for level, size in enumerate(sizes):
        inner, outer = math.prod(sizes[:level]), math.prod(sizes[level + 1:])
        levels.append([tuple(row.tolist()) for ranks in cp_groups
                       for row in torch.tensor(ranks).view(outer, size, inner).permute(0, 2, 1).reshape(-1, size)])
    return levels


def check_hierarchical_sizes(sizes: Optional[Sequence[int]], cp: int) -> Optional[tuple[int, ...]]:
    if sizes is None:
        return None
    sizes = tuple(sizes)
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes) or math.prod(sizes) != cp:
        raise ValueError(f"hierarchical_context_parallel_sizes {list(sizes)} must be integers >= 1 whose product is "
                         f"context_parallel_size {cp}; e.g. --hierarchical-context-parallel-sizes 2 {max(cp // 2, 1)} "
                         "for an all-to-all over 2 ranks and a p2p ring over the rest")
    return sizes


__all__ = ["check_hierarchical_sizes", "distributed_optimizer_groups", "hierarchical_groups", "layout_groups",
           "rank_grid", "validate_sizes"]
