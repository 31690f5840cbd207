"""Fused LayerNorm / RMSNorm under the Triton interpreter: against the torch reference and F.layer_norm /
F.rms_norm, fp32/bf16/fp16, hidden sizes not a power of two, gradients of x, weight and bias."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import layernorm as layernorm_module
from tests.kernels._helpers import DTYPES, TOL, assert_close_all, requires_triton, run, torch_op

pytestmark = requires_triton

HIDDEN, EPS = 40, 1e-5


def _inputs(dtype, rows=(2, 3), hidden=HIDDEN):
    x = (torch.randn(*rows, hidden) * 3 + 1).to(dtype)  # an offset mean: centring matters
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    bias = torch.randn(hidden).to(dtype)
    return x, weight, bias, torch.randn(*rows, hidden).to(dtype)


def _check_layer_norm(x, weight, bias, grad_out, tol):
    out, grads, used = run(lambda *a, **k: kernels.layer_norm(*a, EPS, **k), (x, weight, bias), grad_out,
                           "triton")
    assert used["layer_norm"] == "triton"
    assert out.dtype == x.dtype and [g.dtype for g in grads] == [x.dtype, weight.dtype, bias.dtype]
    ref_out, ref_grads, used = run(lambda *a, **k: kernels.layer_norm(*a, EPS, **k), (x, weight, bias), grad_out,
                                   "torch")
    assert_close_all([out, *grads], [ref_out, *ref_grads], tol, "vs reference")
    torch_out, torch_grads = torch_op(lambda x_, w, b: F.layer_norm(x_, x_.shape[-1:], w, b, EPS),
                                      (x, weight, bias), grad_out)
    assert_close_all([out, *grads], [torch_out, *torch_grads], tol, "vs F.layer_norm")


def _check_rms_norm(x, weight, grad_out, tol):
    out, grads, used = run(lambda *a, **k: kernels.rms_norm(*a, EPS, **k), (x, weight), grad_out, "triton")
    assert used["rms_norm"] == "triton"
    ref_out, ref_grads, used = run(lambda *a, **k: kernels.rms_norm(*a, EPS, **k), (x, weight), grad_out, "torch")
    assert_close_all([out, *grads], [ref_out, *ref_grads], tol, "vs reference")
    torch_out, torch_grads = torch_op(lambda x_, w: F.rms_norm(x_, x_.shape[-1:], w, EPS), (x, weight), grad_out)
    assert_close_all([out, *grads], [torch_out, *torch_grads], tol, "vs F.rms_norm")


def _grad_tol(dtype):
    # dweight sums dy * xhat over rows in fp32 but rounds the low-precision inputs differently: a bit looser.
    return TOL[dtype] if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_matches_reference_and_torch(dtype):
    x, weight, bias, grad_out = _inputs(dtype)
    _check_layer_norm(x, weight, bias, grad_out, _grad_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_reference_and_torch(dtype):
    x, weight, _, grad_out = _inputs(dtype)
    _check_rms_norm(x, weight, grad_out, _grad_tol(dtype))


def test_looped_path_and_several_rows_per_program(monkeypatch):
    monkeypatch.setattr(layernorm_module, "_MAX_BLOCK", 16)  # hidden 40 -> three blocks per row
    x, weight, bias, grad_out = _inputs(torch.float32, rows=(9,))  # 9 rows over 4 backward programs
    _check_layer_norm(x, weight, bias, grad_out, TOL[torch.float32])
    _check_rms_norm(x, weight, grad_out, TOL[torch.float32])


def test_fp32_weight_with_bf16_input_and_no_bias():
    x, weight, _, grad_out = _inputs(torch.bfloat16, rows=(5,), hidden=24)
    weight = weight.float()
    out, grads, used = run(lambda x_, w, **k: kernels.layer_norm(x_, w, None, EPS, **k), (x, weight), grad_out,
                           "triton")
    assert out.dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    torch_out, torch_grads = torch_op(lambda x_, w: F.layer_norm(x_, x_.shape[-1:], w, None, EPS), (x, weight),
                                      grad_out)
    assert_close_all([out, *grads], [torch_out, *torch_grads], _grad_tol(torch.bfloat16), "vs F.layer_norm")


@pytest.mark.parametrize("call, fragment", [
    (lambda: kernels.layer_norm(torch.randn(2, 8), torch.ones(7), torch.zeros(8)),
     r"weight must be .* \[8\] tensor, got shape \(7,\)"),
    (lambda: kernels.layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(2, 8)),
     r"bias must be .* got shape \(2, 8\)"),
    (lambda: kernels.rms_norm(torch.randn(2, 8), torch.ones(8), eps=0.0), "eps must be positive, got 0.0"),
    (lambda: kernels.rms_norm(torch.ones(2, 8, dtype=torch.long), torch.ones(8)), "torch.int64"),
])
def test_bad_input_raises_value_error(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()
