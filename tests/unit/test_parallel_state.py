"""The rank layout (pure) and the single-process state; multi-rank group creation is in tests/distributed."""
import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.parallel_state import layout_groups, rank_grid

# The listing documented in megatron_core/parallel_state.py for world size 8, tp=2, pp=2, dp=2.
WORLD8_TP2_PP2_DP2 = {
    "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
    "cp": [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
    "dp": [(0, 2), (1, 3), (4, 6), (5, 7)],
    "dp_cp": [(0, 2), (1, 3), (4, 6), (5, 7)],
    "tp_cp": [(0, 1), (2, 3), (4, 5), (6, 7)],
    "pp": [(0, 4), (1, 5), (2, 6), (3, 7)],
    "mp": [(0, 1, 4, 5), (2, 3, 6, 7)],
    "embedding": [(0, 4), (1, 5), (2, 6), (3, 7)],
}


def test_world8_listing_matches_documentation():
    assert layout_groups(8, tp=2, pp=2) == WORLD8_TP2_PP2_DP2


def test_rank_order_is_tp_cp_dp_pp():
    grid = rank_grid(16, tp=2, pp=2, cp=2)  # dp = 2
    for pp in range(2):
        for dp in range(2):
            for cp in range(2):
                for tp in range(2):
                    assert grid[pp, dp, cp, tp] == tp + 2 * (cp + 2 * (dp + 2 * pp))


def test_context_parallel_groups():
    groups = layout_groups(16, tp=2, pp=2, cp=2)
    assert groups["cp"][:2] == [(0, 2), (1, 3)]
    assert groups["dp"][:2] == [(0, 4), (1, 5)]
    assert groups["dp_cp"][:2] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert groups["tp_cp"][:2] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert groups["embedding"][0] == (0, 8)
    for kind, all_groups in groups.items():  # every rank in exactly one group of each kind
        assert sorted(r for g in all_groups for r in g) == list(range(16)), kind


def test_embedding_group_of_deep_pipeline_holds_first_and_last_stage():
    groups = layout_groups(8, tp=1, pp=4)
    assert groups["pp"][0] == (0, 2, 4, 6)
    assert groups["embedding"][0] == (0, 6)


def test_single_process_state_without_torch_distributed():
    state = initialize_model_parallel()
    assert (state.world_size, state.rank, state.tp_size, state.pp_size, state.dp_size,
            state.cp_size) == (1, 0, 1, 1, 1, 1)
    assert state.tp_group is None and state.device == torch.device("cpu")
    assert state.is_pipeline_first_stage and state.is_pipeline_last_stage
    assert state.next_pipeline_rank == state.prev_pipeline_rank == 0
    with pytest.raises(Exception):
        state.tp_size = 2  # frozen


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(tensor_model_parallel_size=2), "world_size 1 is not divisible by tensor_model_parallel_size 2"),
    (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size must be an integer >= 1, got 0"),
    (dict(pipeline_model_parallel_size=-1), "pipeline_model_parallel_size must be an integer >= 1, got -1"),
    (dict(context_parallel_size=0), "context_parallel_size must be an integer >= 1, got 0"),
    (dict(virtual_pipeline_model_parallel_size=2),
     "virtual_pipeline_model_parallel_size 2 needs pipeline_model_parallel_size > 1"),
    (dict(virtual_pipeline_model_parallel_size=0), "virtual_pipeline_model_parallel_size must be None or >= 1"),
])
def test_bad_sizes_raise_value_error_naming_values(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        initialize_model_parallel(**kwargs)
    assert "world_size=1" in str(info.value)  # every value is named


def test_rank_grid_rejects_world_size_not_divisible():
    with pytest.raises(ValueError, match=r"world_size 12 is not divisible by tensor_model_parallel_size 2 x "
                                         r"pipeline_model_parallel_size 4 x context_parallel_size 1 = 8"):
        rank_grid(12, tp=2, pp=4)
