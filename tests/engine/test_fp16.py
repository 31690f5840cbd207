"""fp16 with DeepSpeed's dynamic loss scaling: an inf on one rank skips the step on every rank (weights, lr
schedule unchanged, skipped_steps counted), the scale halves after ``hysteresis`` overflows, doubles after
``loss_scale_window`` good steps, and an overflow at ``min_loss_scale`` stops the run as DeepSpeed does."""
import pytest
import torch

from megatron_core import engine as deepspeed
from tests.engine.common import ds_config, full_state, reference, sequential, train_steps


def _fp16_run(*, overflow_steps=(), hysteresis=1, window=1000, min_scale=1.0, steps=4, consecutive=False):
    config = {**ds_config(1), "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 4,
                                       "hysteresis": hysteresis, "loss_scale_window": window,
                                       "min_loss_scale": min_scale, "consecutive_hysteresis": consecutive},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10, "warmup_type": "linear"}}}
    model = sequential()
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=config)

    def inject(engine, step, loss):  # one rank's loss overflows
        return loss * float("inf") if step in overflow_steps and engine.state.dp_rank == 1 else loss
    records = []
    for step in range(steps):
        before = full_state(engine)
        losses = train_steps(engine, "sequential", range(step, step + 1), before_backward=inject)
        after = full_state(engine)
        records.append({"scale": engine.loss_scale, "skipped": engine.skipped_steps, "global": engine.global_steps,
                        "applied": engine.was_step_applied(), "lr": engine.get_lr()[0],
                        "schedule": scheduler.last_batch_iteration, "loss": losses[0],
                        "changed": any(not torch.equal(before[k], after[k]) for k in before),
                        "dtype": next(engine.module.parameters()).dtype})
    return records


def test_overflow_on_one_rank_skips_the_step_everywhere_and_halves_the_scale(distributed):
    for records in distributed(2, _fp16_run, overflow_steps=(1,)):
        assert [r["scale"] for r in records] == [16.0, 8.0, 8.0, 8.0]
        assert [r["applied"] for r in records] == [True, False, True, True]
        assert [r["changed"] for r in records] == [True, False, True, True]
        assert [r["skipped"] for r in records] == [0, 1, 1, 1]
        assert [r["global"] for r in records] == [1, 2, 3, 4]  # a skipped step still counts (DeepSpeed's too)
        assert [r["schedule"] for r in records] == [0, 0, 1, 2]  # ...but does not advance the lr schedule
        assert [r["lr"] for r in records] == pytest.approx([1e-3, 1e-3, 1.9e-3, 2.8e-3])
        assert records[0]["dtype"] == torch.float16


def test_hysteresis_window_and_consecutive_hysteresis(distributed):
    records = distributed(2, _fp16_run, overflow_steps=(1, 2), hysteresis=2)[0]
    assert [r["scale"] for r in records] == [16.0, 16.0, 8.0, 8.0]  # the second overflow halves
    records = distributed(2, _fp16_run, hysteresis=2, window=2)[0]
    assert [r["scale"] for r in records] == [16.0, 32.0, 32.0, 64.0]
    # consecutive_hysteresis refills the counter after every good step: overflows apart never halve
    records = distributed(2, _fp16_run, overflow_steps=(1, 3), hysteresis=2, consecutive=True, steps=5)[0]
    assert [r["scale"] for r in records] == [16.0] * 5
    records = distributed(2, _fp16_run, overflow_steps=(1, 3), hysteresis=2, steps=5)[0]
    assert [r["scale"] for r in records] == [16.0, 16.0, 16.0, 8.0, 8.0]


def test_overflow_at_the_minimum_scale_stops(distributed):
    with pytest.raises(RuntimeError, match="minimum loss scale 16.0"):
        distributed(2, _fp16_run, overflow_steps=(1,), min_scale=16.0)


def test_fp16_training_tracks_fp32(distributed):
    fp32, _, _ = reference("sequential")
    records = distributed(2, _fp16_run, steps=4, window=1000)[0]
    # the lr warms up from 0 here, so compare the first step (same weights, lr 0 before it) tightly
    assert records[0]["loss"] == pytest.approx(fp32[0], rel=2e-3)
