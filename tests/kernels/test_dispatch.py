"""Implementation choice through a KernelBackend object: its modes, its record, and the fallbacks when Triton
cannot run."""
import logging

import pytest
import torch

import kernels
from kernels import KernelBackend, _dispatch
from tests.kernels._helpers import requires_triton


def _softmax(backend):
    return kernels.scaled_upper_triang_masked_softmax(torch.randn(1, 3, 3), 1.0, backend=backend)


def test_unknown_modes_are_rejected():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"):
        KernelBackend("cuda")
    with pytest.raises(ValueError, match="got 'cuda'"):
        with KernelBackend().use("cuda"):
            pass


@requires_triton
def test_use_restores_the_previous_mode_even_on_error():
    backend = KernelBackend("triton")
    with pytest.raises(KeyError):
        with backend.use("torch"):
            _softmax(backend)
            assert backend.last["scaled_upper_triang_masked_softmax"] == "torch"
            raise KeyError("boom")
    assert backend.mode == "triton"
    _softmax(backend)
    assert backend.last["scaled_upper_triang_masked_softmax"] == "triton"  # interpreter is on in tests


@requires_triton
def test_auto_never_interprets_on_the_cpu_and_each_backend_keeps_its_own_record():
    auto, triton = KernelBackend(), KernelBackend("triton")
    _softmax(auto)
    assert auto.report() == {"scaled_upper_triang_masked_softmax": "torch"}
    assert triton.report() == {}
    _softmax(None)  # no backend: a fresh "auto" one, nothing recorded anywhere
    assert auto.report() == {"scaled_upper_triang_masked_softmax": "torch"}


def test_cpu_without_interpreter_runs_torch_or_raises_when_triton_is_forced(monkeypatch):
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    assert "TRITON_INTERPRET=1" in kernels.triton_unavailable_reason(torch.device("cpu"))
    backend = KernelBackend("auto")
    _softmax(backend)
    assert backend.last["scaled_upper_triang_masked_softmax"] == "torch"
    with pytest.raises(RuntimeError, match="backend 'triton' was requested"):
        _softmax(KernelBackend("triton"))


def test_without_triton_every_op_runs_torch(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton", None)
    monkeypatch.setattr(_dispatch, "TRITON_IMPORT_ERROR", "ImportError: no module named triton")
    x, backend = torch.randn(2, 5), KernelBackend()
    kernels.rms_norm(x, torch.ones(5), backend=backend)
    kernels.cross_entropy(x, torch.tensor([1, 2]), backend=backend)
    assert backend.last["rms_norm"] == backend.last["cross_entropy_shard_stats"] == "torch"


@requires_triton
def test_unsupported_dtype_falls_back_once_logged_or_raises_when_triton_is_forced(caplog):
    x, weight = torch.randn(3, 6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    backend = KernelBackend("triton")
    with backend.use("auto"), caplog.at_level(logging.WARNING, logger="kernels._dispatch"):
        # on the CPU mode "auto" runs torch without asking the kernel: CUDA's path is what logs, so pretend
        backend._triton_missing = lambda device: None
        y1 = kernels.layer_norm(x, weight, None, backend=backend)
        kernels.layer_norm(x, weight, None, backend=backend)
    assert backend.last["layer_norm"] == "torch" and y1.dtype == torch.float64
    assert [r.getMessage() for r in caplog.records].count(
        "layer_norm: the Triton kernel does not support x dtype torch.float64 (supported: float32, float16, "
        "bfloat16); running torch") == 1
    with pytest.raises(ValueError, match="does not support x dtype torch.float64"):
        kernels.layer_norm(x, weight, None, backend=KernelBackend("triton"))
