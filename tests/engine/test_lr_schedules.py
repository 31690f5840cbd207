"""DeepSpeed's lr schedules: values computed by hand from DeepSpeed's formulas (test_deepspeed_compat.py also
compares them with DeepSpeed's own classes when deepspeed is installed)."""
import math

import pytest
import torch

from megatron_core.engine.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _adam(lr=1.0):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(schedule, steps):
    """[lr at construction, lr after step 1, ...] of the first param group."""
    values = [schedule.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        values.append(schedule.optimizer.param_groups[0]["lr"])
    return values


def test_warmup_lr_log_and_linear():
    log = _lrs(WarmupLR(_adam(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=5), 7)
    expected = [0.1, 0.1, 0.1 + math.log(2) / math.log(5), 0.1 + math.log(3) / math.log(5),
                0.1 + math.log(4) / math.log(5), 1.1, 1.1, 1.1]
    assert log == pytest.approx(expected, abs=1e-12)
    linear = _lrs(WarmupLR(_adam(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=5,
                           warmup_type="linear"), 6)
    assert linear == pytest.approx([0.1, 0.1, 0.3, 0.5, 0.7, 0.9, 1.1], abs=1e-12)
    default_max = WarmupLR(_adam(lr=0.7), warmup_num_steps=1, warmup_type="linear")  # n = max(2, 1)
    assert _lrs(default_max, 3) == pytest.approx([0.0, 0.0, 0.35, 0.7])


def test_warmup_decay_lr():
    lrs = _lrs(WarmupDecayLR(_adam(), total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=4,
                             warmup_type="linear"), 13)
    assert lrs[1:] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 5 / 6, 4 / 6, 0.5, 2 / 6, 1 / 6, 0.0, 0.0, 0.0])


def test_warmup_cosine_lr():
    schedule = WarmupCosineLR(_adam(lr=2.0), total_num_steps=10, warmup_min_ratio=0.1, warmup_num_steps=4,
                              cos_min_ratio=0.01, warmup_type="linear")
    lrs = _lrs(schedule, 21)
    assert lrs[0] == 0.0  # before the first step the ratio is 0
    assert lrs[1] == pytest.approx(0.2) and lrs[3] == pytest.approx(2.0 * 0.55)
    cosine = (1 + math.cos(math.pi / 6)) / 2
    assert lrs[5] == pytest.approx(2.0 * (0.01 + 0.99 * cosine))
    assert lrs[10] == pytest.approx(0.02) and lrs[21] == pytest.approx(0.02)


def test_one_cycle_lr_momentum_and_decay():
    optimizer = _adam()
    schedule = OneCycle(optimizer, cycle_min_lr=0.1, cycle_max_lr=1.0, decay_lr_rate=0.5, cycle_first_step_size=4,
                        decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.1)
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.99)  # DeepSpeed sets beta2 to 0.99
    lrs, moms = [], []
    for _ in range(12):
        schedule.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        moms.append(optimizer.param_groups[0]["betas"][0])
    assert lrs[:9] == pytest.approx([0.325, 0.55, 0.775, 1.0, 0.775, 0.55, 0.325, 0.1, 0.08])
    assert lrs[11] == pytest.approx(0.05)
    assert moms[0] == pytest.approx(0.875) and moms[3] == pytest.approx(0.8) and moms[7] == pytest.approx(0.9)
    assert moms[8] == pytest.approx(0.945) and moms[11] == pytest.approx(1.08)
    stairs = OneCycle(_adam(), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4,
                      cycle_first_stair_count=2)
    assert _lrs(stairs, 5)[1:] == pytest.approx([0.1, 0.55, 0.55, 1.0, 0.55])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert not OneCycle(sgd, cycle_min_lr=0.1, cycle_max_lr=1.0).cycle_momentum  # no betas: no momentum cycle


def test_lr_range_test():
    assert _lrs(LRRangeTest(_adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2,
                            lr_range_test_step_rate=3.0), 4) == pytest.approx([0.01, 0.025, 0.04, 0.055, 0.07])
    staircase = LRRangeTest(_adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2,
                            lr_range_test_step_rate=3.0, lr_range_test_staircase=True)
    assert _lrs(staircase, 4) == pytest.approx([0.01, 0.01, 0.04, 0.04, 0.07])


def test_state_dict_resumes_the_schedule():
    first = WarmupDecayLR(_adam(), total_num_steps=20, warmup_num_steps=5)
    _lrs(first, 7)
    second = WarmupDecayLR(_adam(), total_num_steps=20, warmup_num_steps=5)
    second.load_state_dict(first.state_dict())
    assert _lrs(second, 3)[1:] == _lrs(first, 3)[1:]


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        WarmupLR(_adam(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="per-group list is not supported"):
        WarmupLR(_adam(), warmup_max_lr=[0.1, 0.2])
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(_adam(), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=0)
