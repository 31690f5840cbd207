"""Two torchrun agents on 127.0.0.1 as two "nodes": start them, find their workers, kill a node, clean up.

torchrun starts every worker in a session of its own, so killing an agent's process group leaves its workers
running: ``Agents`` remembers every worker it has seen and SIGKILLs them all (and the agents) on exit.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

from tests.recipe import RECIPE

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1",
        "--eval-interval", "100000", "--log-interval", "1", "--seed", "3"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children before grandchildren."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = [int(c) for c in open(f"/proc/{parent}/task/{tid}/children").read().split()]
            except OSError:
                continue
            found += children
            frontier += children
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Agents:
    """``len(nodes)`` torchrun agents (one per "node") of one c10d rendezvous on a free loopback port.

    Args:
        argv: pretrain_gpt.py's flags.
        nproc_per_node: workers per agent.
        nnodes: torchrun's ``--nnodes`` (``"2"`` or ``"1:2"``).
        agents: how many agents to start now (the first hosts the rendezvous store); ``start()`` adds one.
        torchrun_args: more torchrun flags (``--max-restarts 1``).
        out_dir: where each agent's stdout/stderr go (``agent0.log``...).
        script: the worker entry point and its leading arguments (default pretrain_gpt.py).

    Rendezvous keep-alives: a heartbeat every second, a node dead after 5 missed ones. Shorter expiries
    (1 s x 2 was tried) let an agent that the shared cores delay by a second look dead to the others and to
    itself: its own sync then drops it from the round it leads and a joining agent forms a second job.
    """

    def __init__(self, argv: Sequence[str], *, nproc_per_node: int, nnodes: str, agents: int = 2,
                 torchrun_args: Sequence[str] = (), out_dir: pathlib.Path,
                 script: Sequence[str] = (str(ROOT / "pretrain_gpt.py"),)) -> None:
        self.port, self.out_dir, self.seen = free_port(), out_dir, set()
        self.argv, self.nproc_per_node, self.nnodes, self.torchrun_args = list(argv), nproc_per_node, nnodes, list(
            torchrun_args)
        self.script = list(script)
        self.procs: list[subprocess.Popen] = []
        for _ in range(agents):
            self.start()

    def start(self) -> None:
        """Starts one more agent (the next node: the first one hosts the rendezvous store)."""
        node = len(self.procs)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # torchrun <= 2.13 shares its rendezvous TCPStore with the workers by default, and then a node that
        # joins a later round waits forever for MASTER_ADDR (rank 0 keeps its cached store info): see elastic.py
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", self.nnodes, "--node-rank", str(node),
                   "--nproc-per-node", str(self.nproc_per_node), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "test",
                   "--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout=3,join_timeout=60,keep_alive_interval=1,"
                   "keep_alive_max_attempt=5",
                   "--monitor-interval", "0.2", *self.torchrun_args, *self.script, *self.argv]
        log = open(self.out_dir / f"agent{node}.log", "w")
        self.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                           start_new_session=True))

    def __enter__(self) -> "Agents":
        return self

    def __exit__(self, *exc_info) -> None:
        for proc in self.procs:
            self.seen.update(descendants(proc.pid))
        for pid in sorted(self.seen):
            _kill(pid)
        for proc in self.procs:
            if proc.poll() is None:
                _kill(proc.pid)
            proc.wait(timeout=10)

    def workers(self, node: int) -> list[int]:
        """The live processes under agent ``node`` (remembered for the clean-up)."""
        pids = descendants(self.procs[node].pid)
        self.seen.update(pids)
        return pids

    def kill_node(self, node: int) -> None:
        """SIGKILLs agent ``node`` and every worker under it, as if its machine died."""
        pids = self.workers(node)
        _kill(self.procs[node].pid)
        for pid in pids:
            _kill(pid)

    def wait(self, timeout: float, *, until: Optional[Callable[[], bool]] = None) -> bool:
        """Waits for every agent to exit (or ``until()`` to hold); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in range(len(self.procs)):
                self.workers(node)
            if until is not None and until():
                return True
            if until is None and all(proc.poll() is not None for proc in self.procs):
                return True
            time.sleep(0.1)
        return False

    def log(self, node: int) -> str:
        return (self.out_dir / f"agent{node}.log").read_text()
