"""Shared helpers for the kernel tests: tolerances per dtype and forward+backward runs on a chosen backend."""
from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch

import kernels

# tests/conftest.py sets TRITON_INTERPRET=1 before anything imports kernels, so the kernels run interpreted.
_REASON = kernels.triton_unavailable_reason(torch.device("cpu"))
requires_triton = pytest.mark.skipif(_REASON is not None, reason=f"Triton cannot run on CPU here: {_REASON}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Kernel vs reference: both compute in fp32 and round once to the output dtype (the interpreter's rounding to
# bf16 may differ from torch's by one unit in the last place).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=1e-3)}


def run(fn: Callable, inputs: Sequence, grad_out: torch.Tensor, mode: str):
    """``fn(*inputs, backend=KernelBackend(mode))`` forward and backward; returns (output, grads of the float
    inputs, ``{op: implementation}`` the backend recorded)."""
    leaves = [t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point()
              else t for t in inputs]
    backend = kernels.KernelBackend(mode)
    out = fn(*leaves, backend=backend)
    out.backward(grad_out)
    grads = [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return out.detach(), grads, backend.report()


def torch_op(fn: Callable, inputs: Sequence, grad_out: torch.Tensor):
    """``fn`` (a torch op) forward and backward on fp32 copies of the inputs; returns (output, grads)."""
    leaves = [t.detach().float().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point()
              else t for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.float())
    return out.detach(), [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def assert_close_all(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], tol: dict, what: str):
    """assert_close on each pair (in fp32), naming the pair's index on failure; also rejects NaN/inf."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert torch.isfinite(a).all(), f"{what}[{i}] has non-finite values"
        torch.testing.assert_close(a.float(), e.float(), **tol, msg=lambda m: f"{what}[{i}]: {m}")
