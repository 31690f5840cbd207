"""The point-to-point all-gather and reduce-scatter that DistributedDataParallel uses on gloo: exact results at
3 and 4 ranks (odd and even pairings), several in flight at once on one tag, bad sizes rejected."""
import pytest
import torch
import torch.distributed as dist

from megatron_core.distributed.p2p_collectives import all_gather_p2p, reduce_scatter_p2p


def _values(rank: int, numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + rank))


def _collectives(numel: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunk = numel // world
    group = dist.new_group(list(range(world)))
    # two reduce-scatters and two gathers in flight at once, waited for in reverse order
    fulls = [_values(rank, numel, seed) for seed in (1, 2)]
    expected_sums = [sum(_values(r, numel, seed) for r in range(world))[rank * chunk:(rank + 1) * chunk]
                     for seed in (1, 2)]
    scatters = [reduce_scatter_p2p(full, group) for full in fulls]
    outputs = [torch.zeros(numel) for _ in range(2)]
    shards = [_values(rank, chunk, seed) for seed in (3, 4)]
    gathers = [all_gather_p2p(out, shard, group) for out, shard in zip(outputs, shards)]
    for work in reversed(scatters + gathers):
        work.wait()
    in_place = torch.zeros(numel)
    in_place[rank * chunk:(rank + 1) * chunk] = _values(rank, chunk, 5)
    all_gather_p2p(in_place, None, group).wait()
    errors = []
    with pytest.raises(ValueError, match="does not split over"):
        all_gather_p2p(torch.zeros(numel + 1), None, group)
    errors.append("ok")
    return ([(full[rank * chunk:(rank + 1) * chunk], want) for full, want in zip(fulls, expected_sums)],
            outputs, in_place, errors)


@pytest.mark.parametrize("world", [3, 4])
def test_point_to_point_collectives_are_exact(distributed, world):
    numel = 12 * world
    chunk = numel // world
    for rank, (sums, outputs, in_place, errors) in enumerate(distributed(world, _collectives, numel)):
        for got, want in sums:  # the same summation order on every rank: exact up to float addition order
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for out, seed in zip(outputs, (3, 4)):
            torch.testing.assert_close(out, torch.cat([_values(r, chunk, seed) for r in range(world)]), rtol=0, atol=0)
        torch.testing.assert_close(in_place, torch.cat([_values(r, chunk, 5) for r in range(world)]), rtol=0, atol=0)
        assert errors == ["ok"], rank
