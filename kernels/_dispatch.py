"""Which implementation each fused op runs: Triton (compiled on CUDA, interpreted on CPU) or torch.

The choice is an object, ``KernelBackend``, that the caller holds and passes to every op as ``backend=``
(a model holds its layout's: ``ParallelState.kernels``). Its ``mode`` decides, per call, in this order:

1. ``"torch"`` runs the torch implementation everywhere.
2. A CUDA tensor runs the compiled Triton kernel when ``import triton`` works (``"auto"`` and ``"triton"``).
3. A CPU tensor runs the Triton kernel under the Triton interpreter only in mode ``"triton"`` and when
   ``TRITON_INTERPRET=1`` was set before ``kernels`` was imported (the flag is read once, when the kernels
   are defined). ``"auto"`` never interprets: on the CPU it runs torch, the fast path there.
4. Anything else runs the torch implementation.

In mode ``"triton"`` rule 4 raises RuntimeError instead, and an input a kernel does not cover (say float64)
raises ValueError naming it; under ``"auto"`` such input runs torch and the fallback is logged once per op and
reason. ``backend.last[op]`` says what the op's last forward used; ``backend.report()`` all of them. An op called
without a backend uses a fresh ``KernelBackend()`` (mode "auto", nothing recorded).

Triton is imported here, guarded: when the import fails every op runs torch and importing ``kernels`` still
succeeds.
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

def jit(fn: Callable) -> Callable:
    """``triton.jit`` when Triton imported, else the plain function (never launched: dispatch picks torch)."""
    return triton.jit(fn) if triton is not None else fn


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


class KernelBackend:
    """The implementation choice of the fused ops, and what they ran (see the module docstring).

    Args:
        mode: ``"auto"`` (default), ``"torch"`` or ``"triton"``.

    Attributes:
        last: ``{op: "triton" | "torch"}`` of each op's last forward call through this backend.
        capture: while ``capture_launches`` is active, the recorded launches.
    """

    def __init__(self, mode: str = "auto") -> None:
        if isinstance(mode, KernelBackend):
            mode = mode.mode
        if mode not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {mode!r}")
        self.mode = mode
        self.last: dict[str, str] = {}
        self._logged: set[tuple[str, str]] = set()
        self.capture: Optional[list] = None

    def __repr__(self) -> str:
        return f"KernelBackend({self.mode!r})"

    @contextlib.contextmanager
    def use(self, mode: str) -> Iterator["KernelBackend"]:
        """Mode ``mode`` inside the block, the previous one restored after it."""
        if mode not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {mode!r}")
        previous, self.mode = self.mode, mode
        try:
            yield self
        finally:
            self.mode = previous

    def report(self) -> dict[str, str]:
        """A copy of ``last``: the implementation of every op called so far."""
        return dict(self.last)

    @contextlib.contextmanager
    def capture_launches(self) -> Iterator[list]:
        """Inside the block every op takes its Triton path on any device and each kernel launch is recorded as
        ``(kernel, args, kwargs)`` instead of run (the outputs stay uninitialized): what ``kernels.aot``
        compiles ahead of time for a GPU target, on a machine without one."""
        previous, self.capture = self.capture, []
        try:
            yield self.capture
        finally:
            self.capture = previous

    def launch(self, kernel, grid: tuple, *args, **kwargs) -> None:
        """``kernel[grid](*args, **kwargs)``, or its record under ``capture_launches`` (tensors recorded as
        empty meta tensors of their dtype: a record must not keep a run's activations alive)."""
        if self.capture is not None:
            self.capture.append((kernel, tuple(_stand_in(a) for a in args),
                                 {k: _stand_in(v) for k, v in kwargs.items()}))
        else:
            kernel[grid](*args, **kwargs)

    def _triton_missing(self, device: torch.device) -> Optional[str]:
        missing = triton_unavailable_reason(device)
        if missing is None and device.type == "cpu" and self.mode == "auto":
            return "mode 'auto' does not run the Triton interpreter on the CPU"
        return missing

    def would_run_triton(self, device: torch.device) -> bool:
        """Whether an op on ``device`` would run Triton now, without recording."""
        if self.capture is not None:
            return True
        return self.mode != "torch" and self._triton_missing(device) is None

    def select(self, op: str, device: torch.device, unsupported: Optional[str] = None) -> str:
        """Picks and records the implementation of one call of ``op`` on ``device``.

        Args:
            op: the public op name, the key of ``last``.
            device: the device of the op's input.
            unsupported: why the kernel cannot take this input (shape, dtype), or None.

        Returns:
            ``"triton"`` or ``"torch"``.
        """
        if self.capture is not None and unsupported is None:
            backend = "triton"
        elif self.mode == "torch":
            backend = "torch"
        else:
            missing = self._triton_missing(device)
            if self.mode == "triton" and missing is not None:
                raise RuntimeError(f"{op}: backend 'triton' was requested but {missing}; use KernelBackend('auto')")
            if self.mode == "triton" and unsupported is not None:
                raise ValueError(f"{op}: the Triton kernel does not support {unsupported}")
            if missing is not None:
                backend = "torch"
            elif unsupported is not None:
                if (op, unsupported) not in self._logged:
                    self._logged.add((op, unsupported))
                    logger.warning("%s: the Triton kernel does not support %s; running torch", op, unsupported)
                backend = "torch"
            else:
                backend = "triton"
        self.record(op, backend)
        return backend

    def record(self, op: str, implementation: str) -> None:
        """Notes that ``op`` ran ``implementation`` (``last``, ``report``). Not while dynamo traces
        (``torch.compile``): a compiled region's side effects would break its graph."""
        if not torch.compiler.is_compiling():
            self.last[op] = implementation


def resolve(backend: Optional[KernelBackend]) -> KernelBackend:
    """``backend``, or a fresh ``KernelBackend()`` (mode "auto") when None."""
    return backend if backend is not None else KernelBackend()


def block_size(n: int, max_block: int) -> tuple[int, bool]:
    """``(BLOCK, ONE_BLOCK)``: the power of two covering ``n`` when at most ``max_block``, else ``max_block``."""
    block = max(16, 1 << max(int(n) - 1, 0).bit_length())
    return (block, True) if block <= max_block else (max_block, False)


def num_warps(block: int) -> int:
    """Warps for a program working on ``block`` elements at a time: about 8 elements per thread, 1 to 16."""
    return max(1, min(16, block // 256))


def _stand_in(value):
    """A launch argument as ``capture_launches`` records it: a tensor becomes an empty meta tensor of its dtype
    (what ahead-of-time compilation needs: the pointer type), anything else stays."""
    return torch.empty(0, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value
