"""(f) 20 SIGKILL trials during --async-save: each trial is a forked training process that resumes the
checkpoint folder (--load), saves every iteration with --async-save and is SIGKILLed at a random moment
of its save cycle. After each kill the newest checkpoint (the pointer file) must be complete: metadata.json
readable, every file present with the sha256 metadata.json records, every tensor it lists readable. The
next trial's --load of that folder is a second check."""
import os
import random
import signal
import time

import torch
from safetensors import safe_open

from megatron_core.checkpointing.checkpoint import _verify, read_metadata
from megatron_core.training.arguments import parse_args
from megatron_core.training.loop import pretrain  # imported before the forks: a child only trains
from tests.recipe import RECIPE

TRIALS = 20
ARGV = [*RECIPE, "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "600", "--lr", "1e-3",
        "--eval-interval", "100000", "--log-interval", "100000", "--seed", "3", "--save-interval", "1",
        "--async-save"]


def _child(directory: str) -> None:
    """Trains from ``directory`` forever (until killed); never returns into pytest."""
    try:
        torch.set_num_threads(1)
        pretrain(parse_args([*ARGV, "--save", directory, "--load", directory]))
    finally:
        os._exit(1)


def _warm_up(directory: str) -> None:
    """One iteration in this process first, so that each forked child finds torch's lazy imports done and the
    dataset index cache built (a child then starts training within a fraction of a second)."""
    import torch.distributed as dist
    pretrain(parse_args([*ARGV, "--exit-interval", "1", "--save", directory]))
    if dist.is_initialized():
        dist.destroy_process_group()


def _pointer(directory):
    try:
        return open(os.path.join(directory, "latest_checkpointed_iteration.txt")).read()
    except OSError:
        return None


def _check_newest(directory):
    folder, metadata = read_metadata(directory)  # the pointer's checkpoint, no fallback
    _verify(folder, metadata, set(metadata["checksums"]))
    files = {}
    for name, entry in metadata["tensors"].items():
        for shard in entry["shards"].values():
            files.setdefault(shard["file"], []).append((name, shard["shape"]))
    for file, tensors in files.items():
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            for name, shape in tensors:
                assert list(handle.get_tensor(name).shape) == shape, (file, name)
    return metadata["iteration"]


def test_sigkill_during_async_saves_always_leaves_a_loadable_newest_checkpoint(tmp_path):
    directory, rng = str(tmp_path / "ckpt"), random.Random()
    newest, interrupted = [], 0
    _warm_up(str(tmp_path / "warm_up"))
    for _ in range(TRIALS):
        before = _pointer(directory)
        pid = os.fork()
        if pid == 0:
            _child(directory)
        deadline = time.monotonic() + 60
        while _pointer(directory) == before and time.monotonic() < deadline:  # this trial published a save
            time.sleep(0.005)
        assert _pointer(directory) != before, "the trial never published a checkpoint"
        time.sleep(rng.uniform(0.0, 0.08))  # a random point of the next save cycles
        in_flight = any(e.endswith(".partial") for e in os.listdir(directory))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        interrupted += in_flight
        newest.append(_check_newest(directory))
    assert newest == sorted(newest) and newest[-1] > newest[0], newest
    assert interrupted >= TRIALS // 4, f"only {interrupted} of {TRIALS} kills hit a save in flight"
