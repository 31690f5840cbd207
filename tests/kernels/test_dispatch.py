"""Backend selection: the runtime override, the report, and the fallbacks when Triton cannot run."""
import logging

import pytest
import torch

import kernels
from kernels import _dispatch
from tests.kernels._helpers import requires_triton


def _softmax():
    return kernels.scaled_upper_triang_masked_softmax(torch.randn(1, 3, 3), 1.0)


def test_set_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"):
        kernels.set_backend("cuda")


@requires_triton
def test_use_backend_restores_the_previous_backend_even_on_error():
    assert kernels.get_backend() == "auto"
    with pytest.raises(KeyError):
        with kernels.use_backend("torch"):
            _softmax()
            assert kernels.last_backend("scaled_upper_triang_masked_softmax") == "torch"
            raise KeyError("boom")
    assert kernels.get_backend() == "auto"
    _softmax()
    assert kernels.last_backend("scaled_upper_triang_masked_softmax") == "triton"  # interpreter is on in tests


def test_cpu_without_interpreter_runs_the_reference_or_raises_when_triton_is_forced(monkeypatch):
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    assert "TRITON_INTERPRET=1" in kernels.triton_unavailable_reason(torch.device("cpu"))
    _softmax()
    assert kernels.last_backend("scaled_upper_triang_masked_softmax") == "torch"
    with kernels.use_backend("triton"), pytest.raises(RuntimeError, match="backend 'triton' was requested"):
        _softmax()


def test_without_triton_every_op_runs_the_reference(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton", None)
    monkeypatch.setattr(_dispatch, "TRITON_IMPORT_ERROR", "ImportError: no module named triton")
    x = torch.randn(2, 5)
    kernels.rms_norm(x, torch.ones(5))
    kernels.cross_entropy(x, torch.tensor([1, 2]))
    assert kernels.last_backend("rms_norm") == kernels.last_backend("cross_entropy_shard_stats") == "torch"


@requires_triton
def test_unsupported_dtype_falls_back_once_logged_or_raises_when_triton_is_forced(monkeypatch, caplog):
    monkeypatch.setattr(_dispatch, "_logged", set())
    x, weight = torch.randn(3, 6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="kernels._dispatch"):
        y1 = kernels.layer_norm(x, weight, None)
        kernels.layer_norm(x, weight, None)
    assert kernels.last_backend("layer_norm") == "torch" and y1.dtype == torch.float64
    assert [r.getMessage() for r in caplog.records].count(
        "layer_norm: the Triton kernel does not support x dtype torch.float64 (supported: float32, float16, "
        "bfloat16); running the torch reference") == 1
    with kernels.use_backend("triton"), pytest.raises(ValueError, match="does not support x dtype torch.float64"):
        kernels.layer_norm(x, weight, None)
