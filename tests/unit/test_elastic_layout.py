"""The --elastic-layout rule and its refusals, the straggler report, the flags' validation."""
import pytest

from megatron_core.training.arguments import parse_args
from megatron_core.training.elastic import check_elastic_world, straggler_report

BASE = ["--global-batch-size", "16", "--micro-batch-size", "2", "--load", "ckpt", "--elastic-layout"]


def test_dp_follows_the_world_size_and_tp_pp_are_kept():
    args = parse_args([*BASE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    assert [check_elastic_world(args, world) for world in (4, 8, 16)] == [1, 2, 4]


def test_a_world_that_cannot_hold_tp_x_pp_is_refused_naming_the_values():
    args = parse_args([*BASE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ValueError, match=r"world size 6 cannot hold tensor-model-parallel-size 2 x "
                                         r"pipeline-model-parallel-size 2 x context-parallel-size 1 = 4"):
        check_elastic_world(args, 6)
    with pytest.raises(ValueError, match=r"--global-batch-size 16 is not divisible by --micro-batch-size 2 x dp 3"):
        check_elastic_world(parse_args(BASE), 3)


def test_elastic_layout_and_async_save_need_their_companions(capsys):
    for argv, message in ((["--elastic-layout", "--load", "ckpt"], "--elastic-layout needs --global-batch-size"),
                          (["--elastic-layout", "--global-batch-size", "8"], "and --load DIR"),
                          (["--async-save"], "--async-save needs --save DIR")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def _report(seconds_by_rank):
    import torch.distributed as dist

    from megatron_core import initialize_model_parallel
    state = initialize_model_parallel(1, 1)
    return straggler_report(seconds_by_rank[dist.get_rank()], state, iteration=10)


def test_straggler_report_names_the_slowest_rank_above_1_5_x_the_median(distributed):
    assert distributed(2, _report, [0.1, 0.2])[0] is None  # 1.33 x the median (0.15)
    lines = distributed(2, _report, [0.1, 0.4])
    assert lines[1] is None and "rank 1 takes 400.0 ms per step, 1.60 x the median 250.0 ms" in lines[0]


def test_a_shared_agent_store_is_named_as_what_stops_a_scale_up(monkeypatch):
    from megatron_core.training.elastic import warn_shared_agent_store
    args = parse_args(BASE)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warn_shared_agent_store(args, 0)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert warn_shared_agent_store(args, 0) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert warn_shared_agent_store(parse_args(["--global-batch-size", "16"]), 0) is None  # not elastic
