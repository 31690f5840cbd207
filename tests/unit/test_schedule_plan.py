"""The pipeline orders (schedule_plan) without any process: every order runs to completion under ``simulate``,
each micro-batch's passes appear once, and with unit-cost passes the simulated bubble equals the formula
(1F1B ``(p-1)/m``; zero bubble ``(p-1)/(3m)``, a third of it, with F = B = W)."""
import pytest

from megatron_core.pipeline_parallel.schedule_plan import (
    Op,
    bubble_fraction_formula,
    one_f_one_b_ops,
    simulate,
    zero_bubble_ops,
)


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 5), (4, 8), (4, 16), (4, 3)])
def test_zero_bubble_order_runs_every_pass_once(p, m):
    for rank in range(p):
        ops = zero_bubble_ops(rank, p, m)
        for kind in "FBW":
            assert sorted(op.microbatch for op in ops if op.kind == kind) == list(range(m))
        # W after its own B; F and B in 1F1B's order
        assert all(ops.index(Op("W", 0, mb)) > ops.index(Op("B", 0, mb)) for mb in range(m))
        assert [op for op in ops if op.kind != "W"] == one_f_one_b_ops(rank, p, m)
    simulate([zero_bubble_ops(r, p, m) for r in range(p)], backward_time=1.0, weight_time=1.0)  # no deadlock


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16)])
def test_simulated_bubbles_equal_the_formulas(p, m):
    def bubble(finish, compute_per_microbatch):
        return (max(finish) - compute_per_microbatch * m) / (compute_per_microbatch * m)
    one_f_one_b = simulate([one_f_one_b_ops(r, p, m) for r in range(p)])  # F = 1, B = 2
    zero = simulate([zero_bubble_ops(r, p, m) for r in range(p)], backward_time=1.0, weight_time=1.0)
    assert bubble(one_f_one_b, 3) == pytest.approx(bubble_fraction_formula(p, m))
    assert bubble(zero, 3) == pytest.approx(bubble_fraction_formula(p, m, zero_bubble=True))
    assert bubble_fraction_formula(p, m, zero_bubble=True) == pytest.approx(bubble_fraction_formula(p, m) / 3)


def test_the_last_stage_holds_back_the_most_weight_passes():
    p, m = 4, 8
    for rank in range(p):
        ops = zero_bubble_ops(rank, p, m)
        tail = len(ops) - 1 - max(i for i, op in enumerate(ops) if op.kind == "B")
        assert tail == rank + 1  # the W of micro-batch i follows the B of micro-batch i + rank
        for mb in range(m - rank):
            assert ops.index(Op("W", 0, mb)) == ops.index(Op("B", 0, mb + rank)) + 1


def test_forward_only_has_no_weight_passes():
    assert zero_bubble_ops(1, 2, 3, forward_only=True) == [Op("F", 0, mb) for mb in range(3)]
