"""scripts/engine_example.py (a transformers GPT-2 trained through DeepSpeed's API, with its data loader, WarmupLR
and clipping) gives DeepSpeed's own losses, lrs and grad norms when run by megatron_core's engine instead, and
every lr schedule gives DeepSpeed's values. Skipped when deepspeed is not installed, except under CI (scripts/setup.sh
installs it). DeepSpeed runs in ranks of its own (it keeps global process groups) and is never imported by the test
process itself."""
import contextlib
import importlib.util
import io
import json
import multiprocessing
import os
import pathlib
import sys

import pytest
import torch

from megatron_core.engine import lr_schedules
from megatron_core.testing import DistributedPool
from tests.engine import common  # noqa: F401  (its warm-up runs before the pools fork)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
import engine_example  # noqa: E402

STAGES, STEPS = (0, 3), 4
# scripts/setup.sh installs deepspeed, so CI runs these against DeepSpeed itself; CI=true never skips them.
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None and not os.environ.get("CI"),
                                     reason="deepspeed is not installed (scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def deepspeed_ranks():
    with DistributedPool(2) as pool:
        yield pool


def _train_stages(backend, stages):
    # DeepSpeed's loader reads with 2 worker processes, which a daemonic pool rank may not start
    multiprocessing.current_process()._config["daemon"] = False
    if backend == "deepspeed":
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (deepspeed_shm_comm) when comms start:
        # 45-95 s on 2 cores in every fresh CI. Only its inference_all_reduce uses it; training reduces through
        # torch.distributed either way, so the comparison is unchanged without it.
        # (the module by name: the attribute deepspeed.comm.torch is the torch package, re-exported)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return [engine_example.train(backend, stage=stage, steps=STEPS) for stage in stages]


@needs_deepspeed
def test_same_script_gives_deepspeeds_losses(distributed, deepspeed_ranks):
    ours = distributed(2, _train_stages, "megatron_core", STAGES)[0]
    theirs = deepspeed_ranks.run(_train_stages, "deepspeed", STAGES, timeout_s=300)[0]
    for stage, mine, reference in zip(STAGES, ours, theirs):
        assert len(mine["losses"]) == STEPS
        assert mine["losses"] == pytest.approx(reference["losses"], rel=1e-5), stage
        assert mine["lrs"] == pytest.approx(reference["lrs"], rel=1e-12), stage
        for norm, expected in zip(mine["grad_norms"], reference["grad_norms"]):
            if expected is not None:  # DeepSpeed's stage 0 reports none
                assert norm == pytest.approx(expected, rel=1e-5), stage


SCHEDULES = [
    ("WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.3, warmup_num_steps=7)),
    ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=7, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=15, warmup_min_lr=0.01, warmup_max_lr=0.3, warmup_num_steps=4)),
    ("WarmupCosineLR", dict(total_num_steps=15, warmup_min_ratio=0.05, warmup_num_steps=4, cos_min_ratio=0.1)),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.2, decay_lr_rate=0.3, cycle_first_step_size=3,
                      cycle_second_step_size=5, decay_step_size=2, cycle_first_stair_count=2,
                      cycle_second_stair_count=3, decay_mom_rate=0.05)),
    ("LRRangeTest", dict(lr_range_test_min_lr=0.02, lr_range_test_step_size=3, lr_range_test_step_rate=2.0)),
]


def _schedule_values(module_name, steps=25):
    """``[(lr, betas)]`` of every schedule in ``SCHEDULES`` over ``steps`` steps, from the given module."""
    module = importlib.import_module(module_name)
    values = []
    for name, params in SCHEDULES:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.3)
        schedule = getattr(module, name)(optimizer, **params)
        for _ in range(steps):
            values.append((name, optimizer.param_groups[0]["lr"], tuple(optimizer.param_groups[0]["betas"])))
            schedule.step()
    return values


@needs_deepspeed
def test_every_schedule_gives_deepspeeds_values(deepspeed_ranks):
    theirs = deepspeed_ranks.run(_schedule_values, "deepspeed.runtime.lr_schedules")[0]
    ours = _schedule_values(lr_schedules.__name__)
    assert len(ours) == len(theirs) == 25 * len(SCHEDULES)
    for (name, lr, betas), (_, expected_lr, expected_betas) in zip(ours, theirs):
        assert lr == pytest.approx(expected_lr, rel=1e-12, abs=1e-15), name
        assert betas == pytest.approx(expected_betas), name


def _main(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine_example.main(argv)
    return out.getvalue()


def test_example_script_command_line(distributed):
    printed = distributed(2, _main, ["--backend", "megatron_core", "--zero-stage", "2", "--steps", "3"])
    result = json.loads(printed[0])
    assert printed[1] == ""  # rank 0 prints
    assert result["zero_stage"] == 2 and len(result["losses"]) == 3
    assert result["lrs"] == pytest.approx([0.0, 2.5e-4, 5e-4])  # WarmupLR, linear over 4 steps
    assert all(abs(loss - 5.545) < 0.1 for loss in result["losses"])  # ~log(256): random tokens
