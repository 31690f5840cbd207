"""Two of Megatron-LM's periodic checks and cleanups around checkpoints and replicas.

- ``--save-retain-interval N``: after each save, the complete ``iter_*`` folders that are neither a multiple of
  N nor the one the pointer names are removed (the newest checkpoint and every N-th one stay, as in
  Megatron-LM). Only global rank 0 removes; folders being written (``iter_*.partial``) and newer than the
  pointer (an async save not yet published) are never touched.
- ``--check-weight-hash-across-dp-replicas-interval N``: every N iterations each rank hashes its parameters
  and the data-parallel replicas compare (``all_gather_object`` over the dp group); replicas that drifted
  apart (a faulty rank, a missed gradient reduction) stop the run naming the ranks. Expert parameters are
  replicated over the expert-data-parallel group instead and are compared there; with ZeRO-3 the parameters
  are gathered for the check (``gathered_parameters``), as for a save.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_core.checkpointing.checkpoint import latest_iteration
from megatron_core.utils.durable import remove_path


def prune_checkpoints(directory: str, retain_interval: int) -> list[str]:
    """Removes complete checkpoints of ``directory`` that ``--save-retain-interval`` does not keep; returns
    the names removed. The pointer's iteration, multiples of ``retain_interval`` and anything newer than the
    pointer stay."""
    latest = latest_iteration(directory)
    if latest is None:
        return []
    removed = []
    for entry in sorted(os.listdir(directory)):
        match = re.fullmatch(r"iter_(\d+)", entry)
        if match is None:
            continue
        iteration = int(match.group(1))
        if iteration >= latest or iteration % retain_interval == 0:
            continue
        remove_path(os.path.join(directory, entry))
        removed.append(entry)
    return removed


def _digest(params: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _compare(params: list[torch.Tensor], group, what: str) -> Optional[str]:
    if group is None or dist.get_world_size(group) == 1:
        return None
    hashes = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, _digest(params), group=group)
    if len(set(hashes)) == 1:
        return None
    ranks = dist.get_process_group_ranks(group)
    groups: dict[str, list[int]] = {}
    for rank, value in zip(ranks, hashes):
        groups.setdefault(value, []).append(rank)
    parts = "; ".join(f"ranks {members} hash {value[:12]}" for value, members in groups.items())
    return f"{what} differ across their replicas: {parts}"


def check_replica_weights(chunks, state, *, iteration: int) -> None:
    """Collective over the dp and expert-dp groups (and, with ZeRO-3, the gathers of a save): RuntimeError
    naming the ranks whose weights differ."""
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            if hasattr(chunk, "gathered_parameters"):
                stack.enter_context(chunk.gathered_parameters())
        dense, experts = [], []
        for chunk in chunks:
            for _, param in sorted(chunk.named_parameters(), key=lambda item: item[0]):
                (experts if getattr(param, "is_expert", False) else dense).append(param)
        problems = [p for p in (_compare(dense, state.dp_group, "the parameters"),
                                _compare(experts, state.expert_dp_group, "the expert parameters")) if p]
    if problems:
        raise RuntimeError(f"--check-weight-hash-across-dp-replicas-interval: at iteration {iteration} "
                           f"{'; '.join(problems)}")


__all__ = ["prune_checkpoints", "check_replica_weights"]
