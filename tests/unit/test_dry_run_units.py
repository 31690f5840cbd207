"""The CPU-side pieces of the dry run, and CPU tests for the bugs it found in CUDA paths."""
import importlib.util
import pathlib

import pytest
import torch

from megatron_core.distributed.param_and_grad_buffer import _same_memory
from megatron_core.transformer.rope import RotaryEmbedding
from megatron_core.utils import accelerator
from megatron_core.utils.live_memory import LiveMemoryTracker

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _dry_run_tool():
    spec = importlib.util.spec_from_file_location("dry_run_tool", ROOT / "tools" / "dry_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rotary_embedding_follows_the_positions_device():
    """The dry run's first CUDA bug: inv_freq stayed on the host, so CUDA positions x CPU inv_freq raised.
    Meta positions stand in for another device here (before the fix: 'Expected all tensors ... same device')."""
    rope = RotaryEmbedding(16)
    out = rope(torch.arange(8).unsqueeze(0).to("meta"))
    assert out.device.type == "meta" and out.shape == (8, 1, 1, 16)


def test_same_memory_without_data_ptr():
    buffer = torch.zeros(8)
    assert _same_memory(buffer[2:], buffer[2:]) and not _same_memory(buffer[2:], buffer[3:])
    assert not _same_memory(buffer, torch.zeros(8))


def test_accelerator_answers_for_the_simulated_gpu(monkeypatch):
    monkeypatch.setenv(accelerator.FAKE_CUDA_ENV, "sm_90")
    assert accelerator.cuda_available() and accelerator.device_capability() == (9, 0)
    assert "H100" in accelerator.device_name() and accelerator.multi_processor_count() == 132
    assert accelerator.max_memory_allocated() is None and accelerator.get_rng_state().numel() == 16
    assert accelerator.is_device_backend("fake") and accelerator.is_device_backend("nccl")
    assert not accelerator.is_device_backend("gloo")
    monkeypatch.setenv(accelerator.FAKE_CUDA_ENV, "sm_42")
    with pytest.raises(ValueError, match="sm_42.*sm_90"):
        accelerator.simulated_gpu()
    monkeypatch.delenv(accelerator.FAKE_CUDA_ENV)
    assert not accelerator.is_dry_run() and accelerator.cuda_available() == torch.cuda.is_available()


def test_resolve_ranks():
    tool = _dry_run_tool()
    assert tool.resolve_ranks("first-last", 128, 4) == [0, 127]
    assert tool.resolve_ranks("all-stages", 128, 4) == [0, 32, 64, 96, 127]
    assert tool.resolve_ranks("5,1,5", 8, 1) == [1, 5]
    with pytest.raises(ValueError, match="outside the world"):
        tool.resolve_ranks("8", 8, 1)
    with pytest.raises(ValueError, match="comma-separated"):
        tool.resolve_ranks("last", 8, 1)


def test_tracker_sampling_on_allocations_finds_the_same_peaks():
    """every_op=False (the dry run's) skips scans that cannot raise the peak: same peak as every op."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(6)]
    x = torch.randn(32, 64, requires_grad=True)

    def step():
        for tensor in [x] + [p for layer in layers for p in layer.parameters()]:
            tensor.grad = None
        h = x
        for layer in layers:
            h = torch.relu(layer(h)) * 2
        h.square().sum().backward()

    peaks = []
    for every_op in (True, False):
        with LiveMemoryTracker(every_op=every_op) as tracker:
            step()
        peaks.append((tracker.peak_total, tracker.peak_breakdown))
    assert peaks[0] == peaks[1] and peaks[0][0] > 6 * 32 * 64 * 4
