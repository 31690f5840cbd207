"""Shared pieces of the hostile-file tests: the real entry point as a subprocess, a tiny base checkpoint made
once per module, digests of folders and canaries, and a private mount namespace for disk faults."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from typing import Optional, Sequence

from tests.fork_server import run_python
from tests.recipe import RECIPE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "1", "--eval-interval", "100000", "--log-interval", "100000", "--seed", "3",
        "--mock-data"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ENV.pop("TRITON_INTERPRET", None)


def pretrain_command(argv: Sequence[str]) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, *argv]


def run_pretrain(argv: Sequence[str], *, timeout: float = 120, preexec_fn=None) -> subprocess.CompletedProcess:
    """``python pretrain_gpt.py TINY argv`` in a process of its own (forked from a server that imported torch:
    ``tests.fork_server``): (returncode, stdout, stderr)."""
    return run_python(pretrain_command(argv)[1:], timeout=timeout, cwd=ROOT, env=ENV, preexec_fn=preexec_fn)


def assert_named_failure(proc: subprocess.CompletedProcess, status: int, *fragments: str) -> None:
    """Exit ``status``, one ``pretrain_gpt.py: error:`` paragraph holding every fragment, no traceback."""
    err = proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode}, expected {status}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert "pretrain_gpt.py: error:" in err, err[-3000:]
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err[-3000:]}"


def digest(path: str) -> dict:
    """``{relative path: sha256}`` of every file under ``path`` (or of ``path`` itself), links as their target
    names."""
    if os.path.isfile(path):
        return {".": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    found = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if os.path.islink(full):
                found[rel] = "link -> " + os.readlink(full)
            elif os.path.isfile(full):
                found[rel] = hashlib.sha256(open(full, "rb").read()).hexdigest()
    return found


def make_base_checkpoint(folder: str, *extra: str, iters: int = 2) -> str:
    """A tiny checkpoint of iteration ``iters`` in ``folder`` (made by the real entry point)."""
    proc = run_pretrain(["--train-iters", str(iters), "--save", folder, *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def copy_checkpoint(base: str, target: str) -> str:
    shutil.copytree(base, target, symlinks=True)
    return target


def pointer(folder: str) -> str:
    return open(os.path.join(folder, "latest_checkpointed_iteration.txt")).read().strip()


def loadable(folder: str) -> dict:
    """The metadata of the newest checkpoint of ``folder`` after verifying every file of it."""
    from megatron_core.checkpointing.checkpoint import read_metadata
    _, metadata = read_metadata(folder, fallback=True)
    return metadata


def rewrite_metadata(ckpt_folder: str, edit) -> None:
    """Applies ``edit(metadata)`` to ``ckpt_folder/metadata.json`` (which no checksum covers)."""
    path = os.path.join(ckpt_folder, "metadata.json")
    metadata = json.load(open(path))
    edit(metadata)
    with open(path, "w") as handle:
        json.dump(metadata, handle)


def namespace_available() -> Optional[str]:
    """None if ``unshare -m`` with a tmpfs mount works here, else the reason it does not."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"a private mount namespace is not permitted here ({probe.stderr.strip()[:200]})"
    return None


def run_in_namespace(script: str, *, timeout: float = 180) -> subprocess.CompletedProcess:
    """``sh -c script`` in a private mount namespace (mounts made there vanish with it)."""
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=ENV)
