"""``python SCRIPT ARGS`` for tests, without paying torch's import in every process.

Many tests run the real entry points (``pretrain_gpt.py``, ``tools/checkpoint_convert.py``) in a process of
their own, to see what a user sees: the exit status, stderr, no traceback, files left behind. Each such
process spends about 3 s of this 2-core machine importing torch, torch._dynamo (the optimizer imports it)
and megatron_core before it does 0.3 s of work. ``run_python`` instead asks a server process that has
imported them once to ``fork``; the child takes the request's cwd, environment, argv and ``sys.path[0]``,
sends its stdin/stdout/stderr to /dev/null and two files, and runs the script as ``__main__``
(``runpy.run_path``); its ``SystemExit`` (or uncaught exception) gives the status, and the child does what
the interpreter's shutdown does that anyone can see (non-daemon threads joined, atexit handlers, output
flushed) before ``os._exit``: tearing down torch's modules would cost 0.85 s more. The caller gets a
``subprocess.CompletedProcess`` (text output), or ``subprocess.TimeoutExpired`` after killing the child's
process group.

One server per environment (ignoring ``RUNTIME_ONLY`` variables, which nothing reads at import), started at
first use with that environment, so that import-time readers (``OMP_NUM_THREADS``, ``TRITON_INTERPRET``) see
what a fresh process would. ``preexec_fn`` (a callable of the test process) falls back to ``subprocess.run``.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Mapping, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ("torch", "torch._dynamo", "megatron_core.training", "megatron_core.training.arguments",
           "megatron_core.training.loop")
RUNTIME_ONLY = ("MASTER_PORT", "MASTER_ADDR", "PYTEST_CURRENT_TEST")  # pytest sets the last one per test phase


class _Server:
    """A ``python -m tests.fork_server`` process serving fork requests over its stdin/stdout."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fork_server"], cwd=ROOT, env=dict(env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        atexit.register(self.close)

    def request(self, message: dict) -> int:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()
        return self._reply()["pid"]

    def _reply(self, timeout: Optional[float] = None) -> Optional[dict]:
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited with status {self.proc.wait()}")
        return json.loads(line)

    def wait(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """The child's exit status (negative: killed by that signal), or None after ``timeout`` seconds."""
        reply = self._reply(timeout)
        if reply is None:
            return None
        assert reply["pid"] == pid, (reply, pid)
        return reply["status"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@functools.cache
def _server(env_key: frozenset) -> _Server:
    return _Server(dict(env_key))


def run_python(args: Sequence[str], *, cwd: str = ROOT, env: Optional[Mapping[str, str]] = None,
               timeout: Optional[float] = None, preexec_fn=None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from a server that imported torch and megatron_core (module docstring).
    ``args[0]``: the script (relative to ``cwd`` or absolute)."""
    env = dict(os.environ if env is None else env)
    command = [sys.executable, *args]
    if preexec_fn is not None:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=preexec_fn)
    server = _server(frozenset((k, v) for k, v in env.items() if k not in RUNTIME_ONLY))
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        pid = server.request(dict(args=list(args), cwd=os.path.abspath(cwd), env=env, stdout=out, stderr=err))
        status = server.wait(pid, timeout)
        if status is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait(pid, None)
        output = open(out, errors="replace").read(), open(err, errors="replace").read()
    if status is None:
        raise subprocess.TimeoutExpired(command, timeout, output=output[0], stderr=output[1])
    return subprocess.CompletedProcess(command, status, stdout=output[0], stderr=output[1])


# ------------------------------------------------------------------------------------------------------------
# the server side


def _become(request: dict) -> None:
    """In the forked child: the request's process group, cwd, environment, standard streams and argv."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    script = os.path.abspath(request["args"][0])
    sys.argv = [request["args"][0], *request["args"][1:]]
    sys.path[0] = os.path.dirname(script)


def _exit_status(stop: SystemExit) -> int:
    """The process status ``raise SystemExit(code)`` gives (a non-integer code is printed, status 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def _run_child(request: dict) -> int:
    """Runs the script as ``__main__`` and then what the interpreter's shutdown does that a caller can see
    (non-daemon threads joined, atexit handlers, stdio flushed); returns the exit status. The rest of the
    shutdown (tearing down every module: 0.85 s with torch loaded) is skipped by ``os._exit``."""
    _become(request)
    try:
        runpy.run_path(os.path.abspath(request["args"][0]), run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return status


def serve() -> None:
    """Imports ``PRELOAD``, then forks one child per request line (JSON: args, cwd, env, stdout, stderr) and
    answers ``{"pid"}`` at once and ``{"pid", "status"}`` when it ends (``_run_child``)."""
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    for line in iter(requests.readline, b""):
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_run_child(request))
        replies.write((json.dumps({"pid": pid}) + "\n").encode())
        replies.flush()
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        replies.write((json.dumps({"pid": pid, "status": status}) + "\n").encode())
        replies.flush()


if __name__ == "__main__":
    serve()
