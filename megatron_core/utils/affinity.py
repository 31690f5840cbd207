"""CPU core binding: each rank of a host on a share of its cores of its own (DeepSpeed's
``--bind_cores_to_rank``), so that a rank's collective threads (gloo's) take time from that rank's compute
only, not from a neighbour's. On this repository's 2-core machine at dp 2 it turns a 7-8 ms backward
imbalance between the ranks (rank 0 then waits for rank 1 at every step) into about 1 ms
(``scripts/benchmark.py`` binds its ranks the same way, for every peer alike)."""
from __future__ import annotations

import os


def cores_for_rank(local_rank: int, local_world_size: int, cores: list[int]) -> list[int]:
    """Rank ``local_rank``'s contiguous share of ``cores`` (one core, shared round-robin, when there are fewer
    cores than ranks)."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank {local_rank} is not in [0, {local_world_size}): pass the rank on this "
                         "host and the number of ranks on it (LOCAL_RANK, LOCAL_WORLD_SIZE)")
    if len(cores) < local_world_size:
        return [cores[local_rank % len(cores)]]
    share = len(cores) // local_world_size
    return cores[local_rank * share:(local_rank + 1) * share]


def bind_cores_to_rank(local_rank: int, local_world_size: int) -> list[int]:
    """Pins every thread of this process (and so the threads it starts later) to the rank's share of the
    cores it may use; returns those cores. Linux only (elsewhere: returns [] and binds nothing)."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    mine = cores_for_rank(local_rank, local_world_size, sorted(os.sched_getaffinity(0)))
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except (ProcessLookupError, PermissionError):  # a thread that just ended, or one we may not move
            pass
    return mine
