"""Every f/g mapping at tp 2 and 4: forward values and input gradients against hand-computed expectations.

Rank r feeds ``(r + 1) * base`` (or the same ``base`` where the input is replicated) and back-propagates
``(r + 1) * grad_base``, so sums over ranks carry the factor ``tp (tp + 1) / 2``.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core import tensor_parallel as tp_ops

S, B, H = 8, 2, 8  # [s, b, h]; s and h divisible by 4


def _base(shape, offset=0.0):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 7.0 + offset


def _run_mapping(name, in_shape, out_shape, replicated_input, **kwargs):
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    scale = 1.0 if replicated_input else float(state.tp_rank + 1)
    x = (_base(in_shape) * scale).requires_grad_()
    out = getattr(tp_ops, name)(x, state.tp_group, **kwargs)
    out.backward(_base(out_shape, offset=1.0) * (state.tp_rank + 1))
    destroy_model_parallel(state)
    return out.detach(), x.grad


def _expectations(name, tp, **kwargs):
    """(input shape, output shape, replicated input?, expected output of rank r, expected input grad of r)."""
    tri = tp * (tp + 1) / 2  # sum over ranks of (r + 1)
    full, last_split, first_split = (S, B, H), (S, B, H // tp), (S // tp, B, H)
    chunk = lambda t, r, dim: t.chunk(tp, dim=dim)[r]  # noqa: E731
    cat_ranks = lambda shape, dim: torch.cat([_base(shape, 1.0) * (q + 1) for q in range(tp)], dim=dim)  # noqa: E731
    if name == "copy_to_tensor_model_parallel_region":
        return full, full, False, lambda r: _base(full) * (r + 1), lambda r: _base(full, 1.0) * tri
    if name == "reduce_from_tensor_model_parallel_region":
        return full, full, False, lambda r: _base(full) * tri, lambda r: _base(full, 1.0) * (r + 1)
    if name == "scatter_to_tensor_model_parallel_region":
        return full, last_split, True, lambda r: chunk(_base(full), r, -1), lambda r: cat_ranks(last_split, -1)
    if name == "gather_from_tensor_model_parallel_region":
        return (last_split, full, False, lambda r: torch.cat([_base(last_split) * (q + 1) for q in range(tp)], -1),
                lambda r: chunk(_base(full, 1.0), r, -1) * (r + 1))
    if name == "scatter_to_sequence_parallel_region":
        return full, first_split, True, lambda r: chunk(_base(full), r, 0), lambda r: cat_ranks(first_split, 0)
    if name == "gather_from_sequence_parallel_region":
        gathered = lambda r: torch.cat([_base(first_split) * (q + 1) for q in range(tp)], 0)  # noqa: E731
        if kwargs.get("tensor_parallel_output_grad", True):  # reduce-scatter of the partial-sum grads
            return first_split, full, False, gathered, lambda r: chunk(_base(full, 1.0), r, 0) * tri
        return first_split, full, False, gathered, lambda r: chunk(_base(full, 1.0), r, 0) * (r + 1)
    if name == "reduce_scatter_to_sequence_parallel_region":
        return full, first_split, False, lambda r: chunk(_base(full), r, 0) * tri, lambda r: cat_ranks(first_split, 0)
    raise AssertionError(name)


CASES = [
    ("copy_to_tensor_model_parallel_region", {}),
    ("reduce_from_tensor_model_parallel_region", {}),
    ("scatter_to_tensor_model_parallel_region", {}),
    ("gather_from_tensor_model_parallel_region", {}),
    ("scatter_to_sequence_parallel_region", {}),
    ("gather_from_sequence_parallel_region", {}),
    ("gather_from_sequence_parallel_region", {"tensor_parallel_output_grad": False}),
    ("reduce_scatter_to_sequence_parallel_region", {}),
]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name, kwargs", CASES)
def test_mapping_forward_and_backward(distributed, tp, name, kwargs):
    in_shape, out_shape, replicated, expected_out, expected_grad = _expectations(name, tp, **kwargs)
    results = distributed(tp, _run_mapping, name, in_shape, out_shape, replicated, **kwargs)
    for rank, (out, grad) in enumerate(results):
        torch.testing.assert_close(out, expected_out(rank), rtol=1e-6, atol=1e-6, msg=f"{name} forward, rank {rank}")
        torch.testing.assert_close(grad, expected_grad(rank), rtol=1e-6, atol=1e-6, msg=f"{name} grad, rank {rank}")


@pytest.mark.parametrize("name, _", CASES)
def test_mapping_without_group_is_identity(name, _):
    x = torch.randn(4, 2, 4, requires_grad=True)
    out = getattr(tp_ops, name)(x, None)
    assert out is x


def _scatter_indivisible():
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    try:
        tp_ops.scatter_to_sequence_parallel_region(torch.zeros(5, 2, 4), state.tp_group)
    finally:
        destroy_model_parallel(state)


def test_split_of_indivisible_dim_names_sizes(distributed):
    with pytest.raises(ValueError, match=r"dim 0 of size 5 \(shape \(5, 2, 4\)\) is not divisible by the "
                                         r"tensor-parallel group size 2"):
        distributed(2, _scatter_indivisible)
