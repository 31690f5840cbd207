"""pretrain_gpt's loop at several layouts against the single-process run (fp32, no dropout): 10 iterations of
losses to 1e-5 relative; bf16 within 2e-2; exact resume; checkpoints that load at another layout."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.fork_server import run_python
from tests.recipe import RECIPE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = [*RECIPE, "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--eval-interval", "1000", "--log-interval", "1000",
        "--seed", "7"]


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(BASE + list(argv)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, distributed):
    return distributed(1, _train, [])[0]


def _layout(tp, pp, dp, extra=()):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]


LAYOUTS = {
    "tp2": (2, _layout(2, 1, 1)),
    "pp2": (2, _layout(1, 2, 1)),
    "dp2-zero0": (2, _layout(1, 1, 2)),
    "dp2-zero1": (2, _layout(1, 1, 2, ["--zero-stage", "1"])),
    "dp2-zero2": (2, _layout(1, 1, 2, ["--zero-stage", "2"])),
    "dp2-zero3": (2, _layout(1, 1, 2, ["--zero-stage", "3"])),
    "tp2-pp2": (4, _layout(2, 2, 1)),
    "pp2-vpp2": (2, _layout(1, 2, 1, ["--num-layers-per-virtual-pipeline-stage", "1"])),
    "pp2-uneven": (2, _layout(1, 2, 1, ["--decoder-first-pipeline-num-layers", "1"])),  # 1 + 3 layers
    "pp2-zero-bubble": (2, _layout(1, 2, 1, ["--enable-zero-bubble", "--zero-bubble-defer", "all"])),
    "pp2-dp2-zero1-zero-bubble": (4, _layout(1, 2, 2, ["--enable-zero-bubble", "--zero-stage", "1"])),
    "tp2-sp": (2, _layout(2, 1, 1, ["--sequence-parallel"])),
    "tp2-sp-overlap": (2, _layout(2, 1, 1, ["--sequence-parallel", "--tp-comm-overlap"])),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_match_single_process(distributed, reference, name):
    world, argv = LAYOUTS[name]
    losses = distributed(world, _train, argv)[0]
    assert len(losses) == 10 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=0)


def test_bf16_stays_close_to_fp32(distributed, reference):
    losses = distributed(2, _train, _layout(1, 1, 2, ["--bf16"]))[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-2, atol=0)


@pytest.mark.parametrize("world, layout", [
    (2, _layout(1, 2, 1)),
    (2, _layout(1, 1, 2, ["--zero-stage", "2", "--bf16"])),
    (2, _layout(2, 1, 1, ["--optimizer", "muon", "--muon-nesterov"])),
    (2, _layout(1, 1, 2, ["--optimizer", "dist_muon", "--bf16"])),  # Muon momentum buffers in the checkpoint
], ids=["pp2", "dp2-zero2-bf16", "tp2-muon", "dp2-dist-muon-bf16"])
def test_resume_is_exact(distributed, tmp_path, world, layout):
    straight = distributed(world, _train, [*layout, "--train-iters", "20"])[0]
    save = ["--save", str(tmp_path), "--train-iters", "20", "--exit-interval", "10"]
    first = distributed(world, _train, [*layout, *save])[0]
    second = distributed(world, _train, [*layout, "--load", str(tmp_path), "--train-iters", "20"])[0]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert first + second == straight


@pytest.mark.parametrize("save_world, save_layout, load_world, load_layout", [
    (4, _layout(2, 2, 1), 1, []),
    (4, _layout(2, 2, 1), 2, _layout(1, 1, 2, ["--zero-stage", "1"])),
    (2, _layout(1, 1, 2, ["--zero-stage", "3"]), 2, _layout(2, 1, 1)),
], ids=["tp2pp2-to-single", "tp2pp2-to-dp2-zero1", "dp2-zero3-to-tp2"])
def test_checkpoint_resumes_at_another_layout(distributed, tmp_path, save_world, save_layout, load_world, load_layout):
    uninterrupted = distributed(1, _train, ["--train-iters", "12"])[0]
    distributed(save_world, _train, [*save_layout, "--save", str(tmp_path), "--train-iters", "12",
                                     "--exit-interval", "10"])
    metadata = json.loads((tmp_path / "iter_0000010" / "metadata.json").read_text())
    assert metadata["true_vocab_size"] == 257 and any(name.startswith("optim/") for name in metadata["tensors"])
    resumed = distributed(load_world, _train, [*load_layout, "--load", str(tmp_path), "--train-iters", "12"])[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[10:]), rtol=1e-5, atol=0)


def test_unknown_flag_suggests_the_close_match():
    proc = run_python([os.path.join(ROOT, "pretrain_gpt.py"), "--tensor-model-paralel-size", "2"], timeout=120)
    assert proc.returncode == 2
    assert "did you mean --tensor-model-parallel-size?" in proc.stderr


def test_sigterm_saves_a_loadable_checkpoint_and_exits_0(distributed, tmp_path):
    import signal
    import time
    metrics = tmp_path / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--train-iters", "100000",
               "--exit-signal-handler", "--save", str(tmp_path / "ckpt"), "--metrics-file", str(metrics)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    iteration = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 3 and f"saved checkpoint at iteration {iteration}" in out
    from megatron_core.checkpointing import read_metadata
    folder, metadata = read_metadata(str(tmp_path / "ckpt"))
    assert metadata["iteration"] == iteration and not any(p.name.endswith(".partial")
                                                          for p in (tmp_path / "ckpt").iterdir())
    resumed = distributed(1, _train, ["--load", str(tmp_path / "ckpt"), "--train-iters", str(iteration + 2)])[0]
    assert len(resumed) == 2
