"""Fake CUDA on a machine without a GPU: the runtime pieces that let ``FakeTensorMode``'s CUDA tensors go
through autograd on a CPU build of torch.

A CPU build creates fake CUDA tensors (shapes, dtypes, ``device="cuda"``; no memory, no compute) but its
autograd engine aborts on them, because no device guard and no runtime hooks are registered for CUDA.
``install()`` compiles ``fake_cuda_hooks.cpp`` (a few lines registering torch's own ``FakeGuardImpl`` and hooks
that say CUDA is present; about 2 s with the C++ compiler, once per torch version: the library is cached) and
loads it **before torch is imported**, so torch's one-time lookup of the CUDA hooks finds ours. On a CUDA build
of torch nothing is needed and nothing is loaded.

This module imports nothing from torch at module level on purpose; call ``install()`` first thing in a
dry-run process (``megatron_core.dryrun.worker`` does), then import torch.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys

TARGET_ENV = "MEGATRON_CORE_FAKE_CUDA"
"""Set by ``install()`` to the simulated target (``sm_90``); ``megatron_core.utils.accelerator`` answers for it."""

SOURCE = pathlib.Path(__file__).with_name("fake_cuda_hooks.cpp")


def _torch_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise RuntimeError("the dry run needs torch installed (pip install torch==2.13.0)")
    return pathlib.Path(spec.origin).parent


def _torch_version(torch_dir: pathlib.Path) -> str:
    text = (torch_dir / "version.py").read_text()
    return next((line.split("=", 1)[1].strip().strip("'\"") for line in text.splitlines()
                 if line.startswith("__version__")), "unknown")


def _is_cuda_build(torch_dir: pathlib.Path) -> bool:
    return any((torch_dir / "lib").glob("libtorch_cuda*.so"))


def library_path(cache_dir: os.PathLike | None = None) -> pathlib.Path:
    """The compiled hooks for this torch (built on first use into ``cache_dir``, default
    ``~/.cache/megatron_core``); RuntimeError naming the compiler's output when it cannot be built."""
    torch_dir = _torch_dir()
    key = hashlib.sha256(SOURCE.read_bytes() + _torch_version(torch_dir).encode() + str(torch_dir).encode())
    default = pathlib.Path.home() / ".cache" / "megatron_core"
    cache = pathlib.Path(cache_dir or os.environ.get("MEGATRON_CORE_CACHE", default))
    target = cache / f"fake_cuda_hooks_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [os.environ.get("CXX", "g++"), "-O1", "-shared", "-fPIC", "-std=c++20", "-w",
               "-D_GLIBCXX_USE_CXX11_ABI=1", f"-I{torch_dir / 'include'}", str(SOURCE),
               f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-o", str(partial)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except FileNotFoundError as error:
        raise RuntimeError(f"the dry run compiles a small C++ file and found no compiler ({error}); install g++ "
                           "or set CXX") from error
    if result.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    os.replace(partial, target)  # atomic: a concurrent rank sees the whole library or none
    return target


def install(target: str = "sm_90") -> bool:
    """Loads the fake CUDA hooks into this process (before ``import torch``) and sets ``TARGET_ENV`` to
    ``target``; returns False when nothing was needed (a CUDA build of torch). RuntimeError when torch was
    already imported: its CUDA hooks are looked up once and could no longer be replaced."""
    import ctypes
    os.environ[TARGET_ENV] = target
    torch_dir = _torch_dir()
    if _is_cuda_build(torch_dir):
        return False
    if "torch" in sys.modules:
        raise RuntimeError("megatron_core.dryrun.fake_cuda.install() must run before torch is imported")
    library = library_path()
    for name in ("libc10.so", "libtorch_cpu.so"):  # the same files torch loads next, so one registry
        ctypes.CDLL(str(torch_dir / "lib" / name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    return True


if __name__ == "__main__":  # python .../fake_cuda.py TARGET ARGS...: one dry-run rank (megatron_core.dryrun.worker)
    sys.path.pop(0)  # this folder, not a package root: its file names must not shadow top-level modules
    install(sys.argv[1])
    from megatron_core.dryrun.worker import main
    sys.exit(main(sys.argv[2:]))
