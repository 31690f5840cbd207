"""scripts/bench_kernels.py: without a GPU it says so and exits 0."""
import importlib.util
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the benchmark would run for real")
def test_exits_zero_without_a_gpu(capsys):
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--iters", "2"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
