"""--bind-cores-to-rank: each rank of a host gets a share of the cores of its own, for all its threads."""
import multiprocessing
import os
import threading

import pytest

from megatron_core.utils.affinity import bind_cores_to_rank, cores_for_rank


def test_cores_are_split_into_contiguous_shares_and_shared_round_robin_when_too_few():
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [cores_for_rank(r, 4, cores) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [cores_for_rank(r, 3, cores) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [cores_for_rank(r, 3, [4, 9]) for r in range(3)] == [[4], [9], [4]]
    with pytest.raises(ValueError, match="local_rank 2 is not in"):
        cores_for_rank(2, 2, cores)


def _bind_in_child(local_rank, queue):
    started = threading.Event()
    stop = threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), stop.wait()))  # a thread that exists before binding
    worker.start()
    started.wait()
    mine = bind_cores_to_rank(local_rank, 2)
    per_thread = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
    later = []
    late = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))  # and one started after
    late.start()
    late.join()
    stop.set()
    worker.join()
    queue.put((mine, per_thread, later[0]))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_binding_moves_every_thread_of_the_process_and_the_threads_it_starts_later():
    context = multiprocessing.get_context("fork")
    cores = sorted(os.sched_getaffinity(0))
    for local_rank in (0, 1):
        queue = context.Queue()
        child = context.Process(target=_bind_in_child, args=(local_rank, queue))
        child.start()
        mine, per_thread, later = queue.get(timeout=30)
        child.join(30)
        assert mine == cores_for_rank(local_rank, 2, cores)
        assert len(per_thread) >= 2 and all(affinity == mine for affinity in per_thread.values()), per_thread
        assert later == mine
