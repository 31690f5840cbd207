"""``tensor_parallel.all_to_all`` at world size 2, even and uneven splits: each rank's forward output, input
gradient and byte count against a single-process reference of the exchange.

``SPLITS[r][j]`` is the number of rows rank r sends to rank j; rank r's input is ``_rows(r, SPLITS[r])`` and
it back-propagates ``_grad_rows(r, column r of SPLITS)``, so every row's value names where it came from.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_core import tensor_parallel as tp_ops

ROW = (3, 2)  # the trailing dims of every row
SPLITS = {
    "even": [[2, 2], [2, 2]],
    "uneven": [[1, 3], [2, 0]],  # rank 1 sends nothing to itself; rank 0 receives 1 + 2, rank 1 receives 3
}


def _rows(rank: int, sizes: list[int], offset: float = 0.0) -> torch.Tensor:
    """``[sum(sizes), *ROW]``, distinct per rank."""
    n = sum(sizes)
    return torch.arange(n * 6, dtype=torch.float32).reshape(n, *ROW) / 7.0 + 10.0 * rank + offset


def _exchange(inputs: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """Single-process reference: rank j receives block j of every rank's input, in rank order."""
    world = len(inputs)
    blocks = [x.split(splits[r]) for r, x in enumerate(inputs)]
    return [torch.cat([blocks[r][j] for r in range(world)]) for j in range(world)]


def _run(case: str):
    splits = SPLITS[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    send = splits[rank]
    receive = [splits[r][rank] for r in range(world)]
    x = _rows(rank, send).requires_grad_()
    stats = type("Stats", (), {"bytes_sent": 0})()
    kwargs = {} if case == "even" else dict(output_split_sizes=receive, input_split_sizes=send)
    out = tp_ops.all_to_all(x, group, stats=stats, **kwargs)
    out.backward(_rows(rank, receive, offset=0.5))
    return out.detach(), x.grad, stats.bytes_sent


@pytest.mark.parametrize("case", sorted(SPLITS))
def test_all_to_all_matches_single_process_exchange(distributed, case):
    splits, world = SPLITS[case], 2
    inputs = [_rows(r, splits[r]) for r in range(world)]
    transposed = [[splits[r][j] for r in range(world)] for j in range(world)]  # rows rank j sends back to r
    grads_out = [_rows(j, transposed[j], offset=0.5) for j in range(world)]
    expected_out = _exchange(inputs, splits)
    expected_grad = _exchange(grads_out, transposed)  # backward: the exchange with the splits swapped
    row_bytes = ROW[0] * ROW[1] * 4
    for rank, (out, grad, bytes_sent) in enumerate(distributed(world, _run, case)):
        torch.testing.assert_close(out, expected_out[rank], rtol=0, atol=0, msg=f"{case} forward, rank {rank}")
        torch.testing.assert_close(grad, expected_grad[rank], rtol=0, atol=0, msg=f"{case} grad, rank {rank}")
        sent_rows = sum(splits[rank][j] + splits[j][rank] for j in range(world) if j != rank)
        assert bytes_sent == sent_rows * row_bytes, (case, rank, bytes_sent)


def test_all_to_all_without_group_is_identity():
    x = torch.randn(4, 2, requires_grad=True)
    assert tp_ops.all_to_all(x, None) is x
    assert tp_ops.all_to_all(x, None, output_split_sizes=[4], input_split_sizes=[4]) is x


@pytest.mark.parametrize("kwargs, match", [
    (dict(output_split_sizes=[4]), "both split lists or neither"),
    (dict(output_split_sizes=[4], input_split_sizes=[3]), "summing to dim 0"),
    (dict(output_split_sizes=[2, 2], input_split_sizes=[2, 2]), "group of size 1 needs 1 output"),
])
def test_all_to_all_bad_splits_name_the_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tp_ops.all_to_all(torch.zeros(4, 2), None, **kwargs)


def _indivisible():
    tp_ops.all_to_all(torch.zeros(3, 2), dist.new_group([0, 1]))


def test_all_to_all_even_splits_need_divisible_rows(distributed):
    with pytest.raises(ValueError, match=r"dim 0 of the input \(3, 2\) divisible by the group size 2"):
        distributed(2, _indivisible)
