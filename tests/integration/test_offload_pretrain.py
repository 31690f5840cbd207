"""``pretrain_gpt.py`` with ``--optimizer-nvme-offload-dir`` and ZeRO-3 ``--param-offload nvme``: the checkpoint
after 4 iterations equals the in-memory run's tensor for tensor; a run killed at random moments during its
NVMe steps always leaves a newest checkpoint that loads and resumes."""
import glob
import multiprocessing
import os
import random
import signal
import time

import torch
from safetensors.torch import load_file

from tests.integration.test_reliability import TINY, _child, _free_port, latest_iteration_or_none, run_main


def _tensors(ckpt: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in glob.glob(os.path.join(ckpt, "iter_*", "*.safetensors")):
        if not os.path.basename(path).startswith("rng"):
            tensors.update(load_file(path))
    return tensors


def test_nvme_offload_checkpoint_equals_in_memory(distributed, tmp_path):
    base = [*TINY, "--train-iters", "4", "--zero-stage", "3"]
    nvme = ["--optimizer-nvme-offload-dir", str(tmp_path / "nvme"), "--param-offload", "nvme",
            "--optimizer-nvme-chunk-elements", "5000"]
    (status, err), = distributed(1, run_main, [*base, *nvme, "--save", str(tmp_path / "a")])
    assert status in (0, None), err
    (status, err), = distributed(1, run_main, [*base, "--no-fused-adam", "--save", str(tmp_path / "b")])
    assert status in (0, None), err
    offloaded, resident = _tensors(str(tmp_path / "a")), _tensors(str(tmp_path / "b"))
    assert resident and set(resident) <= set(offloaded)  # + optim/master/* (the masters are copies in files)
    assert any(key.startswith("optim/exp_avg/") for key in resident)
    for key, value in resident.items():
        assert torch.equal(offloaded[key], value), key


def test_kill_during_nvme_steps_leaves_a_loadable_checkpoint(tmp_path):
    from megatron_core.checkpointing import read_metadata
    from megatron_core.checkpointing.checkpoint import _verify
    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, "--train-iters", "100000", "--save", ckpt, "--save-interval", "1",
            "--optimizer-nvme-offload-dir", str(tmp_path / "nvme"), "--optimizer-nvme-chunk-elements", "3000"]
    context, rng = multiprocessing.get_context("fork"), random.Random(0)
    for trial in range(3):
        before = latest_iteration_or_none(ckpt)
        load = ["--load", ckpt] if before is not None else []
        proc = context.Process(target=_child, args=(argv + load, _free_port()))
        proc.start()
        deadline = time.monotonic() + 60
        while latest_iteration_or_none(ckpt) == before and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.is_alive(), f"trial {trial}: the run ended early"
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        folder, metadata = read_metadata(ckpt, fallback=False)
        _verify(folder, metadata, set(metadata["checksums"]))
        assert latest_iteration_or_none(ckpt) > (before or 0)
        assert len(os.listdir(tmp_path / "nvme")) == 1  # the killed run's files; the next run removes them
