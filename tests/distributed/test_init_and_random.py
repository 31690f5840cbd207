"""Layout-independent initialization, the tensor-parallel RNG tracker and activation checkpointing."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.checkpointing.layout import merge_shards
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    model_parallel_seed,
)

STRIDE = 3  # as in a fused QKV weight: rank r keeps blocks r, r + tp, r + 2 tp of the output rows


def _build_layers(tp_group):
    torch.manual_seed(1234)
    return (ColumnParallelLinear(8, 24, tp_group=tp_group, stride=STRIDE),
            RowParallelLinear(16, 6, tp_group=tp_group),
            VocabParallelEmbedding(32, 4, tp_group=tp_group))


def _shards():
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    column, row, emb = _build_layers(state.tp_group)
    destroy_model_parallel(state)
    return column.weight.detach(), row.weight.detach(), emb.weight.detach()


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_at_any_tp_concatenate_to_the_tp1_weight(distributed, tp):
    column, row, emb = (layer.weight.detach() for layer in _build_layers(None))
    results = distributed(tp, _shards)
    assert torch.equal(merge_shards([r[0] for r in results], 0, STRIDE), column)
    assert torch.equal(torch.cat([r[1] for r in results], 1), row)
    assert torch.equal(torch.cat([r[2] for r in results], 0), emb)


def _dropout_masks():
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    tracker = model_parallel_seed(42, tp_rank=state.tp_rank)
    ones = torch.ones(64)
    replicated = F.dropout(ones, 0.5) != 0
    with tracker.fork():
        partitioned = F.dropout(ones, 0.5) != 0
    replicated_after = F.dropout(ones, 0.5) != 0  # the default stream continues where it stopped
    destroy_model_parallel(state)
    return replicated, partitioned, replicated_after


def test_rng_tracker_masks(distributed):
    (rep0, part0, after0), (rep1, part1, after1) = distributed(2, _dropout_masks)
    assert torch.equal(rep0, rep1) and torch.equal(after0, after1)
    assert not torch.equal(part0, part1)
    assert not torch.equal(rep0, after0)
    torch.manual_seed(42)
    assert torch.equal(F.dropout(torch.ones(64), 0.5) != 0, rep0)  # the default stream is seed 42 itself


def test_rng_tracker_errors():
    tracker = model_parallel_seed(7, tp_rank=0)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 99)
    with pytest.raises(ValueError, match="seed 2725 is already used"):
        tracker.add("other", 7 + 2718)
    with pytest.raises(ValueError, match="'missing' was never added"):
        with tracker.fork("missing"):
            pass


def _block(tracker, column, row, x):
    """Column -> dropout on the partitioned activation (tracker) -> Row -> dropout on the replicated output."""
    hidden, _ = column(x)
    with tracker.fork():
        hidden = F.dropout(F.gelu(hidden), 0.3)
    out, _ = row(hidden)
    return F.dropout(out, 0.3)


def _checkpoint_grads(use_checkpoint):
    group_world = dist.get_world_size() if dist.is_initialized() else 1
    state = initialize_model_parallel(tensor_model_parallel_size=group_world)
    torch.manual_seed(0)
    column = ColumnParallelLinear(8, 16, tp_group=state.tp_group)
    row = RowParallelLinear(16, 8, tp_group=state.tp_group)
    x = torch.randn(4, 2, 8, requires_grad=True)
    tracker = model_parallel_seed(5, tp_rank=state.tp_rank)
    if use_checkpoint:
        out = checkpoint(_block, tracker, column, row, x, rng_tracker=tracker)
    else:
        out = _block(tracker, column, row, x)
    out = out * 2 + F.dropout(out, 0.5)  # draws after the block see the same RNG position either way
    out.sum().backward()
    grads = [x.grad, column.weight.grad, column.bias.grad, row.weight.grad, row.bias.grad]
    destroy_model_parallel(state)
    return out.detach(), grads


def _compare_checkpoint():
    return _checkpoint_grads(False), _checkpoint_grads(True)


@pytest.mark.parametrize("tp", [1, 2])
def test_checkpoint_gives_identical_grads(distributed, tp):
    for (plain_out, plain_grads), (ckpt_out, ckpt_grads) in distributed(tp, _compare_checkpoint):
        assert torch.equal(plain_out, ckpt_out)
        for plain, ckpt in zip(plain_grads, ckpt_grads):
            assert torch.equal(plain, ckpt)


def test_checkpoint_without_process_group_and_with_kwargs():
    (plain_out, plain_grads), (ckpt_out, ckpt_grads) = _compare_checkpoint()
    assert torch.equal(plain_out, ckpt_out)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, ckpt_grads))
    x = torch.randn(3, requires_grad=True)
    checkpoint(lambda t, *, power: t ** power, x, power=3).sum().backward()
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)
