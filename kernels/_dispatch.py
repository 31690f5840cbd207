"""Backend selection shared by the fused ops: Triton (compiled or interpreted) or the plain-torch reference.

Rules, checked per call in this order:

1. ``set_backend("torch")`` (or ``with use_backend("torch")``) runs the torch reference everywhere.
2. A CUDA tensor runs the compiled Triton kernel when ``import triton`` works.
3. A CPU tensor runs the Triton kernel under the Triton interpreter when ``TRITON_INTERPRET=1`` was set before
   ``kernels`` was imported (that is when the kernels are defined; the flag is read once, then).
4. Anything else runs the torch reference.

Under ``set_backend("triton")`` rule 4 raises RuntimeError instead, and an input a kernel does not cover
(say float64) raises ValueError naming it; under the default ``"auto"`` such input runs the reference and the
fallback is logged once per op and reason. ``last_backend(op)`` says which backend the op's last forward used.

Triton is imported here, guarded: when the import fails every op runs its reference and importing ``kernels``
still succeeds.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

try:  # guarded: kernels must import on machines without a GPU or a working Triton
    import triton
    import triton.language as tl
    TRITON_IMPORT_ERROR: Optional[str] = None
except Exception as exc:  # noqa: BLE001 - any failure (missing, broken install) means "use the reference"
    triton, tl = None, None
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if triton is None and torch.cuda.is_available():  # a GPU without Triton: loud, never a silent slow path
    logger.warning("kernels: triton could not be imported on a CUDA machine (%s); every fused op runs its torch "
                   "fallback, slower: install triton==3.7.1", TRITON_IMPORT_ERROR)

# Read once, when the kernels are defined: triton.jit makes interpreted functions only if it was set then.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")

BACKENDS = ("auto", "torch", "triton")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_mode = "auto"
_last: dict[str, str] = {}
_logged: set[tuple[str, str]] = set()


def jit(fn: Callable) -> Callable:
    """``triton.jit`` when Triton imported, else the plain function (never launched: dispatch picks torch)."""
    return triton.jit(fn) if triton is not None else fn


def set_backend(name: str) -> None:
    """Sets the process-wide backend: ``"auto"`` (the rules above), ``"torch"`` or ``"triton"``."""
    global _mode
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _mode = name


def get_backend() -> str:
    """The process-wide backend set by ``set_backend`` (``"auto"`` by default)."""
    return _mode


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: ``set_backend(name)`` inside the block, the previous backend restored after it."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def last_backend(op: str) -> Optional[str]:
    """``"triton"`` or ``"torch"``: the backend the last forward call of ``op`` ran; None before any call.

    ``op`` is the public function's name, e.g. ``"layer_norm"`` or ``"cross_entropy_shard_stats"``.
    """
    return _last.get(op)


def backend_report() -> dict[str, str]:
    """A copy of ``{op: backend of its last forward call}`` for every op called so far."""
    return dict(_last)


def clear_backend_report() -> None:
    """Forgets the recorded backends (``last_backend`` returns None until the op runs again)."""
    _last.clear()


def triton_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why Triton cannot run on ``device`` here, or None when it can."""
    if triton is None:
        return f"triton could not be imported ({TRITON_IMPORT_ERROR})"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        return None if INTERPRET else "CPU tensors need TRITON_INTERPRET=1 set before kernels is imported"
    return f"there is no Triton backend for device type {device.type!r}"


def unsupported_dtype(what: str, tensor: torch.Tensor) -> Optional[str]:
    """A reason string when ``tensor``'s dtype is not one the kernels take (fp32, fp16, bf16), else None."""
    if tensor.dtype in SUPPORTED_DTYPES:
        return None
    return f"{what} dtype {tensor.dtype} (supported: float32, float16, bfloat16)"


_capture: Optional[list] = None  # launches recorded instead of run (``capture_launches``)


@contextlib.contextmanager
def capture_launches() -> Iterator[list]:
    """Inside the block every op takes its Triton path on any device and each kernel launch is recorded as
    ``(kernel, args, kwargs)`` instead of run (the outputs stay uninitialized): what ``kernels.aot`` compiles
    ahead of time for a GPU target, on a machine without one."""
    global _capture
    previous, _capture = _capture, []
    try:
        yield _capture
    finally:
        _capture = previous


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or its record under ``capture_launches``."""
    if _capture is not None:
        _capture.append((kernel, args, kwargs))
    else:
        kernel[grid](*args, **kwargs)


def would_run_triton(device: torch.device) -> bool:
    """Whether an op on ``device`` would run Triton now (the backend mode and rules 2-4), without recording."""
    if _capture is not None:
        return True
    return _mode != "torch" and triton_unavailable_reason(device) is None


def select(op: str, device: torch.device, unsupported: Optional[str] = None) -> str:
    """Picks and records the backend for one call of ``op`` on ``device``.

    Args:
        op: the public op name, the key of ``last_backend``.
        device: the device of the op's input.
        unsupported: why the kernel cannot take this input (shape, dtype), or None.

    Returns:
        ``"triton"`` or ``"torch"``.
    """
    if _capture is not None and unsupported is None:
        backend = "triton"
    elif _mode == "torch":
        backend = "torch"
    else:
        missing = triton_unavailable_reason(device)
        if _mode == "triton" and missing is not None:
            raise RuntimeError(f"{op}: backend 'triton' was requested but {missing}; use set_backend('auto')")
        if _mode == "triton" and unsupported is not None:
            raise ValueError(f"{op}: the Triton kernel does not support {unsupported}")
        if missing is not None:
            backend = "torch"
        elif unsupported is not None:
            if (op, unsupported) not in _logged:
                _logged.add((op, unsupported))
                logger.warning("%s: the Triton kernel does not support %s; running the torch reference", op,
                               unsupported)
            backend = "torch"
        else:
            backend = "triton"
    record(op, backend)
    return backend


def record(op: str, implementation: str) -> None:
    """Notes that ``op`` ran ``implementation`` (what ``last_backend`` / ``backend_report`` return). Not while
    dynamo traces (``torch.compile``): a compiled region's side effects would break its graph."""
    if not torch.compiler.is_compiling():
        _last[op] = implementation


def block_size(n: int, max_block: int) -> tuple[int, bool]:
    """``(BLOCK, ONE_BLOCK)``: the power of two covering ``n`` when at most ``max_block``, else ``max_block``."""
    block = max(16, 1 << max(int(n) - 1, 0).bit_length())
    return (block, True) if block <= max_block else (max_block, False)


def num_warps(block: int) -> int:
    """Warps for a program working on ``block`` elements at a time: about 8 elements per thread, 1 to 16."""
    return max(1, min(16, block // 256))
