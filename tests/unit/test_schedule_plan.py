"""The pipeline orders (schedule_plan) without any process: every order runs to completion under ``simulate``,
each micro-batch's passes appear once, and with unit-cost passes the simulated bubble equals the formula
(1F1B ``(p-1)/m``; zero bubble ``(p-1)/(3m)``, a third of it, with F = B = W; its "cooldown" variant in
between)."""
import pytest

from megatron_core.pipeline_parallel.schedule_plan import (
    Op,
    bubble_fraction_formula,
    one_f_one_b_ops,
    simulate,
    zero_bubble_ops,
)


@pytest.mark.parametrize("defer", ["all", "cooldown"])
@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 5), (4, 8), (4, 16), (4, 3)])
def test_zero_bubble_order_runs_every_pass_once(p, m, defer):
    for rank in range(p):
        ops = zero_bubble_ops(rank, p, m, defer=defer)
        assert [op for op in ops if op.kind != "W"] == one_f_one_b_ops(rank, p, m)  # F and B in 1F1B's order
        split = sorted(op.microbatch for op in ops if op.kind == "W")
        # rank 0 sends no input gradients: its backwards run whole
        expected = [] if rank == 0 else list(range(m)) if defer == "all" else list(range(max(m - rank, 0), m))
        assert split == expected
        assert all(ops.index(Op("W", 0, mb)) > ops.index(Op("B", 0, mb)) for mb in split)
    simulate([zero_bubble_ops(r, p, m, defer=defer) for r in range(p)], backward_time=1.0, weight_time=1.0)


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16)])
def test_simulated_bubbles_equal_the_formulas(p, m):
    def bubble(finish):
        return (max(finish) - 3 * m) / (3 * m)
    one_f_one_b = simulate([one_f_one_b_ops(r, p, m) for r in range(p)])  # F = 1, B = 2
    zero = simulate([zero_bubble_ops(r, p, m) for r in range(p)], backward_time=1.0, weight_time=1.0)
    cooldown = simulate([zero_bubble_ops(r, p, m, defer="cooldown") for r in range(p)], backward_time=1.0,
                        weight_time=1.0)
    assert bubble(one_f_one_b) == pytest.approx(bubble_fraction_formula(p, m))
    assert bubble(zero) == pytest.approx(bubble_fraction_formula(p, m, zero_bubble=True))
    assert bubble(zero) < bubble(cooldown) < bubble(one_f_one_b)
    assert bubble_fraction_formula(p, m, zero_bubble=True) == pytest.approx(bubble_fraction_formula(p, m) / 3)


def test_zb_h1_holds_back_r_weight_passes_on_rank_r():
    p, m = 4, 8
    for rank in range(1, p):
        ops = zero_bubble_ops(rank, p, m)
        tail = len(ops) - 1 - max(i for i, op in enumerate(ops) if op.kind == "B")
        assert tail == rank + 1  # the W of micro-batch i follows the B of micro-batch i + rank
        for mb in range(m - rank):
            assert ops.index(Op("W", 0, mb)) == ops.index(Op("B", 0, mb + rank)) + 1


def test_forward_only_has_no_weight_passes_and_bad_defer_is_refused():
    assert zero_bubble_ops(1, 2, 3, forward_only=True) == [Op("F", 0, mb) for mb in range(3)]
    with pytest.raises(ValueError, match="defer must be one of"):
        zero_bubble_ops(1, 2, 3, defer="some")
