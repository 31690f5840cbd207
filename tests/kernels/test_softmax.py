"""Fused scaled masked softmax (padding mask and causal) under the Triton interpreter: against the torch
reference and F.softmax, fp32/bf16/fp16, sk not a power of two, fully masked rows, forward and backward."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import softmax as softmax_module
from tests.kernels._helpers import DTYPES, TOL, assert_close_all, requires_triton, run, torch_op

pytestmark = requires_triton

SCALE = 0.7


def _padding_mask(b, sq, sk):
    mask = torch.rand(b, 1, sq, sk) < 0.3
    mask[0, 0, 1] = True  # fully masked rows
    mask[1, 0, 2] = True
    return mask


def _torch_masked_softmax(x, mask, scale):
    if mask is None:
        return F.softmax(x * scale, dim=-1)
    return torch.nan_to_num(F.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1), nan=0.0)


def _torch_causal_softmax(x, scale):
    upper = torch.ones(x.shape[-2:], dtype=torch.bool).triu(1)
    return F.softmax((x * scale).masked_fill(upper, float("-inf")), dim=-1)


def _check_masked(x, mask, dtype, scale=SCALE):
    grad_out = torch.randn(x.shape).to(dtype)
    out, grads, used = run(kernels.scaled_masked_softmax, (x, mask, scale), grad_out, "triton")
    assert used["scaled_masked_softmax"] == "triton"
    assert out.dtype == dtype
    ref_out, ref_grads, used = run(kernels.scaled_masked_softmax, (x, mask, scale), grad_out, "torch")
    assert used["scaled_masked_softmax"] == "torch"
    assert_close_all([out, *grads], [ref_out, *ref_grads], TOL[dtype], "vs reference")
    torch_out, torch_grads = torch_op(lambda x_: _torch_masked_softmax(x_, mask, scale), (x,), grad_out)
    assert_close_all([out, *grads], [torch_out, *torch_grads], TOL[dtype], "vs F.softmax")
    return out, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_softmax_matches_reference_and_torch(dtype):
    x = (torch.randn(2, 2, 3, 37) * 4).to(dtype)
    mask = _padding_mask(2, 3, 37)
    out, (dx,) = _check_masked(x, mask, dtype)
    assert (out[0, :, 1] == 0).all() and (out[1, :, 2] == 0).all(), "fully masked rows must be zeros"
    assert (dx[0, :, 1] == 0).all() and (dx[1, :, 2] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_softmax_matches_reference_and_torch(dtype):
    x = (torch.randn(3, 7, 7) * 4).to(dtype)
    grad_out = torch.randn(x.shape).to(dtype)
    out, grads, used = run(kernels.scaled_upper_triang_masked_softmax, (x, SCALE), grad_out, "triton")
    assert used["scaled_upper_triang_masked_softmax"] == "triton"
    ref_out, ref_grads, used = run(kernels.scaled_upper_triang_masked_softmax, (x, SCALE), grad_out, "torch")
    assert_close_all([out, *grads], [ref_out, *ref_grads], TOL[dtype], "vs reference")
    torch_out, torch_grads = torch_op(lambda x_: _torch_causal_softmax(x_, SCALE), (x,), grad_out)
    assert_close_all([out, *grads], [torch_out, *torch_grads], TOL[dtype], "vs F.softmax")
    assert (out.triu(1) == 0).all()


def test_looped_path_for_rows_longer_than_one_block(monkeypatch):
    monkeypatch.setattr(softmax_module, "_MAX_BLOCK", 16)  # sk 37 -> three blocks per row
    x = torch.randn(2, 2, 3, 37) * 4
    out, _ = _check_masked(x, _padding_mask(2, 3, 37), torch.float32)
    assert (out[0, :, 1] == 0).all()
    causal = torch.randn(2, 20, 20) * 4
    grad_out = torch.randn(causal.shape)
    out, grads, used = run(kernels.scaled_upper_triang_masked_softmax, (causal, SCALE), grad_out, "triton")
    torch_out, torch_grads = torch_op(lambda x_: _torch_causal_softmax(x_, SCALE), (causal,), grad_out)
    assert_close_all([out, *grads], [torch_out, *torch_grads], TOL[torch.float32], "looped causal")


def test_no_mask_broadcast_mask_and_huge_scores():
    x = torch.randn(2, 2, 3, 19) * 1e4  # exp of any unshifted score overflows
    _check_masked(x, None, torch.float32, scale=1.0)
    key_padding = torch.zeros(2, 1, 1, 19, dtype=torch.bool)
    key_padding[1, ..., 11:] = True
    _check_masked(x, key_padding, torch.float32, scale=1.0)


@pytest.mark.parametrize("call, fragment", [
    (lambda: kernels.scaled_masked_softmax(torch.randn(2, 3, 4), None, 1.0),
     r"\[b, heads, sq, sk\], got shape \(2, 3, 4\)"),
    (lambda: kernels.scaled_masked_softmax(torch.randn(1, 2, 3, 4), torch.zeros(1, 1, 3, 5, dtype=torch.bool), 1.0),
     r"mask shape \(1, 1, 3, 5\) does not broadcast to x shape \(1, 2, 3, 4\)"),
    (lambda: kernels.scaled_masked_softmax(torch.randn(1, 2, 3, 4), torch.zeros(1, 1, 3, 4), 1.0), "torch.bool"),
    (lambda: kernels.scaled_upper_triang_masked_softmax(torch.randn(2, 3, 4), 1.0), r"sq == sk, got shape \(2, 3, 4\)"),
    (lambda: kernels.scaled_upper_triang_masked_softmax(torch.ones(2, 3, 3, dtype=torch.long), 1.0), "torch.int64"),
])
def test_bad_input_raises_value_error(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()
