"""Run a function on N torch.distributed (gloo) ranks on this machine and collect each rank's result.

Process start-up dominates multi-process tests on a small machine, so ranks live in a reusable pool:
workers are forked once (about 0.2 s for 4 ranks, against ~12 s for ``torchrun``), rendezvous through a
``FileStore`` in a temporary folder (no port to race for), initialize the default process group once and
then run task after task. Each worker uses one intra-op thread.

    from megatron_core.testing import run_distributed

    def body(scale):                        # module-level, so it pickles by reference
        x = torch.ones(2) * (dist.get_rank() + 1) * scale
        dist.all_reduce(x)
        return x

    results = run_distributed(4, body, 2.0)  # [tensor([20., 20.])] * 4, indexed by rank

A rank's exception is re-raised in the caller with its type kept (``pytest.raises`` works) and a note
naming the rank and carrying its traceback. A run that exceeds its timeout, or a rank that dies, raises
``DistributedRunError`` naming the ranks; the pool is then torn down (ranks stuck in a collective are
killed, never left hanging) and rebuilt on the next call.
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

DEFAULT_TIMEOUT_S = float(os.environ.get("MEGATRON_CORE_TEST_TIMEOUT", "120"))
_ERROR_GRACE_S = 2.0  # after one rank fails, how long to wait for the others before killing the pool


class DistributedRunError(RuntimeError):
    """A distributed run timed out, or a rank died or returned something that cannot be pickled."""


def _worker_main(rank: int, world_size: int, store_path: str, backend: str, timeout_s: float, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as error:  # noqa: BLE001 - reported to the caller, then this rank exits
        conn.send_bytes(pickle.dumps(("error", (error, traceback.format_exc()))))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            break
        if not message:
            break
        conn.send_bytes(_run_task(message))
        _free_leftovers()
    dist.destroy_process_group()


def _free_leftovers() -> None:
    """Frees what a task left behind, so a long-lived worker does not slow down: each gloo process group holds
    three threads until the group object is freed. Groups still registered are destroyed; when many threads
    remain, the garbage collector frees the cycles (model, wrapper and hooks) that still reference groups."""
    import gc

    import torch.distributed as dist

    world = dist.GroupMember.WORLD
    for group in [g for g in list(dist.distributed_c10d._world.pg_map) if g is not world]:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - already destroyed or never completed: nothing left to free
            pass
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks) or len(os.listdir(tasks)) > 64:
        gc.collect()


def _run_task(message: bytes) -> bytes:
    """Unpickles ``(sys_path, fn, args, kwargs)``, runs it and pickles ``(status, payload)``."""
    try:
        sys_path, fn, args, kwargs = _unpickle_task(message)
        import torch
        torch.manual_seed(0)  # every task starts from the same RNG state on every rank, whatever ran before
        payload = ("ok", fn(*args, **kwargs))
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller
        payload = ("error", (error, traceback.format_exc()))
    try:
        return pickle.dumps(payload)
    except Exception as pickling_error:  # noqa: BLE001
        if payload[0] == "ok":
            detail = f"the result could not be pickled: {pickling_error!r}"
        else:
            detail = payload[1][1]
        return pickle.dumps(("error", (DistributedRunError(detail), detail)))


def _unpickle_task(message: bytes):
    sys_path, payload = pickle.loads(message)
    for entry in sys_path:  # modules imported by the caller after the fork must be importable here too
        if entry not in sys.path:
            sys.path.append(entry)
    return (sys_path, *pickle.loads(payload))


class DistributedPool:
    """``world_size`` forked gloo ranks that run tasks until ``close()``."""

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        self._tmpdir = tempfile.mkdtemp(prefix="megatron_core_pool_")
        context = multiprocessing.get_context("fork")
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent_conn, child_conn = context.Pipe()
            proc = context.Process(
                target=_worker_main, daemon=True, name=f"megatron_core-rank{rank}",
                args=(rank, world_size, os.path.join(self._tmpdir, "store"), backend, timeout_s, child_conn),
            )
            proc.start()
            child_conn.close()
            self._conns.append(parent_conn)
            self._procs.append(proc)
        self._collect(timeout_s, what="process group start-up")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: Optional[float] = None, **kwargs: Any) -> list:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results indexed by rank."""
        if not self.alive:
            raise DistributedRunError("the pool is closed or a rank has died; build a new pool")
        message = pickle.dumps((list(sys.path), pickle.dumps((fn, args, kwargs))))
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(timeout_s or self.timeout_s, what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, timeout_s: float, *, what: str) -> list:
        results: dict[int, Any] = {}
        errors: dict[int, tuple[BaseException, str]] = {}
        deadline = time.monotonic() + timeout_s
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            if errors:
                remaining = min(remaining, _ERROR_GRACE_S)
            if remaining <= 0:
                break
            sentinels = {self._procs[rank].sentinel: rank for rank in pending}
            ready = multiprocessing.connection.wait([*pending.values(), *sentinels], timeout=remaining)
            if not ready:
                break
            for rank, conn in list(pending.items()):
                if conn in ready or self._procs[rank].sentinel in ready:
                    del pending[rank]
                    self._receive(rank, conn, results, errors)
        if errors or pending:
            self.close(kill=True)
        if errors:
            _raise_first(errors, pending)
        if pending:
            raise DistributedRunError(
                f"{what}: ranks {sorted(pending)} of {self.world_size} did not finish within {timeout_s:.0f} s "
                f"(ranks {sorted(results)} did); the pool was killed"
            )
        return [results[rank] for rank in range(self.world_size)]

    def _receive(self, rank: int, conn, results: dict, errors: dict) -> None:
        try:
            reply = conn.recv_bytes()
        except (EOFError, OSError):
            proc = self._procs[rank]
            proc.join(timeout=1.0)
            message = f"rank {rank} died (exit code {proc.exitcode})"
            errors[rank] = (DistributedRunError(message), message)
            return
        try:
            status, payload = pickle.loads(reply)
        except Exception as error:  # noqa: BLE001 - e.g. an exception class whose __init__ needs arguments
            message = f"rank {rank}'s reply could not be unpickled here: {error!r}"
            errors[rank] = (DistributedRunError(message), message)
            return
        if status == "error":
            errors[rank] = payload
        else:
            results[rank] = payload

    def close(self, *, kill: bool = False) -> None:
        """Stops the workers (politely, or at once with ``kill``) and removes the rendezvous folder."""
        for conn in self._conns:
            if not kill:
                try:
                    conn.send_bytes(b"")
                except OSError:
                    pass
            conn.close()
        for proc in self._procs:
            if kill:
                proc.kill()
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conns, self._procs = [], []
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> "DistributedPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _raise_first(errors: dict[int, tuple[BaseException, str]], unfinished: dict) -> None:
    """Raises the root cause: a rank that died (its peers then fail with connection errors), else the
    lowest failing rank's exception; the other failures are listed as notes."""
    deaths = [r for r, (error, _) in errors.items() if isinstance(error, DistributedRunError)]
    rank = min(deaths or errors)
    error, remote_traceback = errors[rank]
    error.add_note(f"[raised on rank {rank}; remote traceback follows]\n{remote_traceback}")
    for other in sorted(set(errors) - {rank}):
        error.add_note(f"[rank {other} also raised {type(errors[other][0]).__name__}: {errors[other][0]}]")
    if unfinished:
        error.add_note(f"[ranks {sorted(unfinished)} were still running and were killed]")
    raise error


class PoolCache:
    """Pools by world size, started on first use, restarted when broken and reused across runs (the test
    suite holds one for the whole session: ``tests/conftest.py``'s ``distributed`` fixture). A context
    manager; ``close()`` ends every pool (also registered to run at interpreter exit)."""

    def __init__(self) -> None:
        self._pools: dict[int, DistributedPool] = {}
        atexit.register(self.close)

    def get(self, world_size: int) -> DistributedPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = DistributedPool(world_size)
        return pool

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: Optional[float] = None,
            **kwargs: Any) -> list:
        """Runs ``fn(*args, **kwargs)`` on ``world_size`` ranks of this cache's pool; results indexed by rank."""
        return self.get(world_size).run(fn, *args, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        while self._pools:
            self._pools.popitem()[1].close()

    def __enter__(self) -> "PoolCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any,
                    timeout_s: Optional[float] = None, **kwargs: Any) -> list:
    """Runs ``fn(*args, **kwargs)`` once on ``world_size`` gloo ranks of a pool started for this call (about
    0.2 s for 4 ranks); results indexed by rank. Use a ``PoolCache`` to run many functions on the same ranks."""
    pool = DistributedPool(world_size)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
    finally:
        pool.close()
