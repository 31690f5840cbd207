"""Every Triton launch the ops make on GPT shapes (fp32 / bf16 / fp16; odd, long and looped rows; with and
without bias, mask, label smoothing) compiles to a cubin for sm_80 and sm_90, on this machine without a GPU:
a kernel change that only the interpreter accepts fails here. Runs ``python -m kernels.aot`` in a process of
its own, because the kernels must be defined without ``TRITON_INTERPRET`` to be compiled."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_gpt_launch_compiles_for_sm80_and_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.aot", "80", "90"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("sm_")]
    assert [line.split(":")[0] for line in lines] == ["sm_80", "sm_90"], result.stdout
    for line in lines:
        launches = int(line.split(":")[1].split()[0])
        assert launches >= 60, line  # every op x dtype x shape family, forward and backward


def test_capture_records_launches_without_running_them():
    import torch

    import kernels
    x, backend = torch.randn(2, 8), kernels.KernelBackend("triton")
    with backend.capture_launches() as launches:
        kernels.rms_norm(x, torch.ones(8), backend=backend)
    assert [launch[0].fn.__name__ for launch in launches] == ["_norm_fwd_kernel"]
    assert backend.capture is None
