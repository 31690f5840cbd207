"""Reliability: checkpoints survive SIGKILL at any moment, corrupt files are named (and skipped when asked),
metadata cannot point outside the checkpoint, numerics policies stop or recover, a stalled or dead rank ends the
job instead of hanging, and memory stays flat over a long run."""
import hashlib
import json
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.fork_server import run_python
from tests.recipe import RECIPE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "1", "--eval-interval", "100000", "--log-interval", "100000", "--seed", "3"]


def run_main(argv):
    """``megatron_core.training.main(argv)`` in this process: (exit status, stderr)."""
    import contextlib
    import io

    from megatron_core.training import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(list(argv))
        except SystemExit as exit_:
            status = exit_.code
    return status, err.getvalue()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(argv, port):
    import torch
    torch.set_num_threads(1)  # OpenMP after fork: the parent's thread pool must not be used here
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ.pop("TRITON_INTERPRET", None)
    status, _ = run_main(argv)
    os._exit(status or 0)


def _files_digest(directory) -> dict:
    digest = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            digest[path] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return digest


def test_sigkill_during_saves_never_leaves_a_checkpoint_taken_as_complete(tmp_path):
    from megatron_core.checkpointing import latest_iteration, read_metadata
    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "100000", "--save", ckpt, "--save-interval", "1"]
    context = multiprocessing.get_context("fork")
    rng = random.Random(0)
    resumed_from = []
    for trial in range(20):
        load = ["--load", ckpt] if latest_iteration_or_none(ckpt) is not None else []
        before = latest_iteration_or_none(ckpt)
        proc = context.Process(target=_child, args=(argv + load, _free_port()))
        proc.start()
        deadline = time.monotonic() + 60
        while latest_iteration_or_none(ckpt) == before and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.is_alive() and time.monotonic() < deadline, f"trial {trial}: the run saved nothing in 60 s"
        time.sleep(rng.uniform(0.0, 0.5))  # a random moment of the save-every-iteration phase
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        newest = latest_iteration_or_none(ckpt)
        if newest is None:
            continue
        folder, metadata = read_metadata(ckpt, fallback=False)  # the pointer names a complete checkpoint
        from megatron_core.checkpointing.checkpoint import _verify
        _verify(folder, metadata, set(metadata["checksums"]))  # every file present and intact
        resumed_from.append(newest)
    assert len(resumed_from) == 20 and resumed_from == sorted(resumed_from) and resumed_from[-1] > 20
    status, err = run_main_in_child([*TINY, "--load", ckpt, "--save", ckpt, "--train-iters", str(resumed_from[-1] + 1)])
    assert status == 0, err
    assert latest_iteration(ckpt) == resumed_from[-1] + 1


def latest_iteration_or_none(directory):
    from megatron_core.checkpointing import latest_iteration
    return latest_iteration(directory) if os.path.isdir(directory) else None


def run_main_in_child(argv):
    """Runs main in a fresh process (its own single-rank process group): (status, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MASTER_PORT=str(_free_port()))
    proc = run_python([os.path.join(ROOT, "pretrain_gpt.py"), *argv], env=env, timeout=300)
    return proc.returncode, proc.stderr


def _save_two_checkpoints(distributed, ckpt):
    distributed(1, run_main, [*TINY, "--train-iters", "4", "--save", ckpt, "--save-interval", "2"])


def test_corrupt_file_is_named_and_fallback_loads_the_previous_checkpoint(distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save_two_checkpoints(distributed, ckpt)
    model_file = tmp_path / "ckpt" / "iter_0000004" / "model_tp00_pp000.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-100])  # truncated
    before = _files_digest(ckpt)
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "6", "--load", ckpt])[0]
    assert status == 2 and "model_tp00_pp000.safetensors is corrupt: it is " in err and "truncated or extended" in err
    assert _files_digest(ckpt) == before  # a failed load modifies nothing
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "6", "--load", ckpt, "--load-fallback",
                                            "--save", ckpt])[0]
    assert status == 0, err
    assert json.loads((tmp_path / "ckpt" / "iter_0000006" / "metadata.json").read_text())["iteration"] == 6


def test_metadata_cannot_point_outside_the_checkpoint(distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save_two_checkpoints(distributed, ckpt)
    meta_path = tmp_path / "ckpt" / "iter_0000004" / "metadata.json"
    metadata = json.loads(meta_path.read_text())
    for entry in metadata["tensors"].values():
        for shard in entry["shards"].values():
            shard["file"] = "../../outside.safetensors"
    meta_path.write_text(json.dumps(metadata))
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "6", "--load", ckpt])[0]
    assert status == 2 and "'../../outside.safetensors', which is not a plain file name" in err


def test_nan_check_names_iteration_and_rank(distributed):
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "20", "--lr", "1e4", "--min-lr", "1e3",
                                            "--clip-grad", "0", "--check-for-nan-in-loss-and-grad"])[0]
    assert status == 1 and "non-finite value at iteration" in err and "on rank 0" in err


def test_fp16_overflow_skips_then_recovers_and_endless_skips_abort(distributed, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    status, err = distributed(1, run_main, [*TINY, "--fp16", "--train-iters", "30", "--initial-loss-scale",
                                            "1e9", "--metrics-file", str(metrics)])[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert status == 0, err
    assert records[0]["skipped"] == 1 and records[-1]["skipped"] == 0 and records[-1]["loss_scale"] < 1e9
    status, err = distributed(1, run_main, [*TINY, "--fp16", "--train-iters", "30", "--initial-loss-scale",
                                            "1e30", "--max-consecutive-skipped-iterations", "4"])[0]
    assert status == 1 and "4 optimizer steps in a row were skipped" in err


@pytest.mark.parametrize("how", ["stall", "die"])
def test_a_stalled_or_dead_rank_ends_the_job_with_an_error(how, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--pipeline-model-parallel-size", "2",
               "--train-iters", "100000", "--metrics-file", str(metrics), "--distributed-timeout-minutes", "0.05"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.2)
        rank0, victim = _worker_pids(proc.pid)
        os.kill(victim, signal.SIGSTOP if how == "stall" else signal.SIGKILL)
        start = time.monotonic()
        while os.path.exists(f"/proc/{rank0}") and time.monotonic() - start < 60:
            time.sleep(0.1)
        rank0_failed_after = time.monotonic() - start  # the rank waiting on the stalled one gave up
        if how == "stall":
            os.kill(victim, signal.SIGCONT)  # lets torchrun's SIGTERM through at once
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert rank0_failed_after < 30, rank0_failed_after  # the 3 s timeout, plus start-up of the error path
    ours = ("rank 0 failed during the forward-backward schedule" in err or "rank 0 failed during the optimizer" in err)
    if how == "stall":  # the waiting rank gives up after the timeout and names the phase and its peers
        assert ours and "pipeline ranks (0, 1)" in err, err[-3000:]
    else:  # the launcher names the dead rank (and the survivor may report first)
        assert ours or re.search(r"rank\s*:\s*1 \(local_rank: 1\)", err), err[-3000:]


def _worker_pids(parent: int) -> list[int]:
    """The worker processes torchrun started (children of its agent), in start order."""
    pids = []
    for tid in os.listdir(f"/proc/{parent}/task"):
        children = open(f"/proc/{parent}/task/{tid}/children").read().split()
        pids += [int(pid) for pid in children]
    workers = []
    for pid in sorted(pids):
        workers += [int(c) for t in os.listdir(f"/proc/{pid}/task")
                    for c in open(f"/proc/{pid}/task/{t}/children").read().split()] or [pid]
    return sorted(workers)


def test_memory_stays_flat_over_a_long_run(tmp_path):
    """A fresh process, so that its peak resident memory (mem_bytes on a CPU) only reflects this run."""
    metrics = tmp_path / "metrics.jsonl"
    status, err = run_main_in_child(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                                     "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1000",
                                     "--eval-interval", "100000", "--log-interval", "100000",
                                     "--metrics-file", str(metrics)])
    assert status == 0, err
    memory = [json.loads(line)["mem_bytes"] for line in metrics.read_text().splitlines()]
    assert len(memory) == 1000
    assert memory[-1] <= memory[99] * 1.02, (memory[99], memory[-1])
