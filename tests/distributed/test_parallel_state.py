"""initialize_model_parallel on real gloo ranks: groups match the documented listing, errors never hang."""
import pytest
import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from tests.unit.test_parallel_state import WORLD8_TP2_PP2_DP2


def _describe_layout(tp, pp, cp=1, vpp=None):
    state = initialize_model_parallel(tp, pp, vpp, cp)
    # Each group must really connect its ranks: all-reducing the global rank gives the sum of the listing.
    sums = {}
    for kind in ("tp", "cp", "dp", "dp_cp", "tp_cp", "pp", "mp", "embedding"):
        group = getattr(state, f"{kind}_group")
        if group is None:  # middle pipeline stages hold no embedding group
            sums[kind] = None
            continue
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value, group=group)
        sums[kind] = value.item()
    description = {
        "ranks": {kind: getattr(state, f"{kind}_ranks") for kind in ("tp", "cp", "dp", "dp_cp", "tp_cp", "pp", "mp",
                                                                     "embedding")},
        "sums": sums,
        "sizes": (state.tp_size, state.cp_size, state.dp_size, state.pp_size, state.vpp_size),
        "ranks_in_axes": (state.tp_rank, state.cp_rank, state.dp_rank, state.pp_rank),
        "first_last": (state.is_pipeline_first_stage, state.is_pipeline_last_stage),
        "next_prev": (state.next_pipeline_rank, state.prev_pipeline_rank),
        "device": str(state.device),
        "chunks": (state.is_first_model_chunk(0), state.is_last_model_chunk((vpp or 1) - 1)),
    }
    destroy_model_parallel(state)
    return description


def test_world8_groups_match_listing(distributed):
    results = distributed(8, _describe_layout, 2, 2)
    for rank, desc in enumerate(results):
        for kind, listing in WORLD8_TP2_PP2_DP2.items():
            (mine,) = [g for g in listing if rank in g]
            assert desc["ranks"][kind] == mine, (rank, kind)
            assert desc["sums"][kind] == sum(mine), (rank, kind)
        tp_rank, dp_rank, pp_rank = rank % 2, (rank // 2) % 2, rank // 4
        assert desc["ranks_in_axes"] == (tp_rank, 0, dp_rank, pp_rank)
        assert desc["sizes"] == (2, 1, 2, 2, None)
        assert desc["first_last"] == (pp_rank == 0, pp_rank == 1)
        assert desc["next_prev"] == ((rank + 4) % 8, (rank + 4) % 8)
        assert desc["device"] == "cpu"


def test_virtual_pipeline_chunks(distributed):
    results = distributed(4, _describe_layout, 1, 4, 1, 2)
    assert [r["chunks"] for r in results] == [(True, False), (False, False), (False, False), (False, True)]
    assert [r["next_prev"] for r in results] == [(1, 3), (2, 0), (3, 1), (0, 2)]
    assert all(r["ranks"]["embedding"] == (0, 3) for r in results)
    assert [r["sums"]["embedding"] for r in results] == [3.0, None, None, 3.0]


def test_context_parallel_layout(distributed):
    results = distributed(4, _describe_layout, 1, 1, 2)  # cp=2, dp=2
    assert [r["ranks"]["cp"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["ranks"]["dp"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all(r["ranks"]["dp_cp"] == (0, 1, 2, 3) for r in results)
    assert [r["ranks"]["tp_cp"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["sums"]["tp_cp"] for r in results] == [1.0, 1.0, 5.0, 5.0]


def _initialize(**kwargs):
    initialize_model_parallel(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(tensor_model_parallel_size=3), "world_size 4 is not divisible by tensor_model_parallel_size 3"),
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4), "= 8"),
    (dict(context_parallel_size=0), "context_parallel_size must be an integer >= 1, got 0"),
])
def test_world_size_mismatch_raises_on_every_rank_without_hanging(distributed, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        distributed(4, _initialize, **kwargs)
    assert "raised on rank 0" in info.value.__notes__[0]
    assert not any("were still running" in note for note in info.value.__notes__)
