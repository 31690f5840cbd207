"""The README's main job, end to end under torchrun: tp=2 x dp=2 with sequence parallelism on 4 gloo ranks."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_tp_demo_matches_single_process_reference():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # as the README runs it
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(ROOT / "scripts" / "tp_demo.py"), "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--train-iters", "10"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: tensor x data parallel training matches the single-process run" in proc.stdout
    assert "layout: world=4 tp=2 dp=2 sequence_parallel=True" in proc.stdout
