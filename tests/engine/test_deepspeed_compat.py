"""scripts/engine_example.py (a transformers GPT-2 trained through DeepSpeed's API, with its data loader, WarmupLR
and clipping) gives DeepSpeed's own losses, lrs and grad norms when run by megatron_core's engine instead; the
DeepSpeed half is skipped when deepspeed is not installed."""
import contextlib
import importlib.util
import io
import json
import multiprocessing
import pathlib
import sys

import pytest

from megatron_core.testing import DistributedPool
from tests.engine import common  # noqa: F401  (its warm-up runs before the pools fork)

if importlib.util.find_spec("deepspeed") is not None:  # imported before any rank pool forks (~4 s a process)
    import deepspeed  # noqa: F401

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
import engine_example  # noqa: E402

STAGES, STEPS = (0, 3), 4


def _train_stages(backend, stages):
    # DeepSpeed's loader reads with 2 worker processes, which a daemonic pool rank may not start
    multiprocessing.current_process()._config["daemon"] = False
    return [engine_example.train(backend, stage=stage, steps=STEPS) for stage in stages]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_same_script_gives_deepspeeds_losses(distributed):
    ours = distributed(2, _train_stages, "megatron_core", STAGES)[0]
    with DistributedPool(2) as pool:  # DeepSpeed keeps global process groups: ranks of its own
        theirs = pool.run(_train_stages, "deepspeed", STAGES, timeout_s=300)[0]
    for stage, mine, reference in zip(STAGES, ours, theirs):
        assert len(mine["losses"]) == STEPS
        assert mine["losses"] == pytest.approx(reference["losses"], rel=1e-5), stage
        assert mine["lrs"] == pytest.approx(reference["lrs"], rel=1e-12), stage
        for norm, expected in zip(mine["grad_norms"], reference["grad_norms"]):
            if expected is not None:  # DeepSpeed's stage 0 reports none
                assert norm == pytest.approx(expected, rel=1e-5), stage


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
