"""The multi-process harness itself: results by rank, exceptions with their rank, no hangs."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_core.testing import DistributedPool, DistributedRunError


def _rank_times(scale):
    x = torch.ones(2) * (dist.get_rank() + 1) * scale
    dist.all_reduce(x)
    return dist.get_rank(), x


def test_results_are_indexed_by_rank(distributed):
    results = distributed(4, _rank_times, 2.0)
    assert [rank for rank, _ in results] == [0, 1, 2, 3]
    assert all(torch.equal(x, torch.full((2,), 20.0)) for _, x in results)


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("only rank 1")
    dist.barrier()  # the others wait for rank 1 in a collective that never completes


def test_exception_keeps_type_and_names_rank():
    with DistributedPool(2, timeout_s=30) as pool:
        start = time.monotonic()
        with pytest.raises(KeyError, match="only rank 1") as info:
            pool.run(_fail_on_rank_one)
        assert time.monotonic() - start < 10
        assert "raised on rank 1" in info.value.__notes__[0]
        assert "_fail_on_rank_one" in info.value.__notes__[0]  # the remote traceback
        assert not pool.alive  # the stuck rank was killed


def _sleep_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(60)


def test_timeout_kills_the_pool_and_names_the_ranks():
    with DistributedPool(2) as pool:
        with pytest.raises(DistributedRunError, match=r"ranks \[0\] of 2 did not finish within 1 s"):
            pool.run(_sleep_on_rank_zero, timeout_s=1)
        assert not pool.alive


def _die_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_dead_rank_is_reported_as_the_cause():
    with DistributedPool(2, timeout_s=30) as pool:
        with pytest.raises(DistributedRunError, match=r"rank 1 died \(exit code 3\)"):
            pool.run(_die_on_rank_one)


def test_shared_pool_recovers_after_a_failure(distributed):
    with pytest.raises(KeyError):
        distributed(2, _fail_on_rank_one)
    assert [rank for rank, _ in distributed(2, _rank_times, 1.0)] == [0, 1]


def _unpicklable_result():
    return lambda: None


def test_unpicklable_result_is_an_error(distributed):
    with pytest.raises(DistributedRunError, match="could not be pickled"):
        distributed(2, _unpicklable_result)
