"""The dispatch modes of a dry run: CUDA tensors fake, CPU tensors real, and every collective recorded.

``FakeCudaMode`` sends each op that touches a CUDA device (a ``device="cuda"`` argument, a CUDA or fake tensor
input) to torch's ``FakeTensorMode``, which computes output shapes, dtypes and devices without memory or
arithmetic, and runs every other op for real: the CPU bookkeeping a run does (layout grids, datasets, RNG
states, ``.tolist()`` of real tensors) keeps its values. A scalar read off a fake tensor (``.item()``,
``bool(t)``) has no value; it reads as 0 (False), which is what a healthy step's checks expect: no inf in the
gradients, a finite loss. Values are meaningless in a dry run; shapes, bytes, FLOPs and collectives are not.

``CollectiveRecorder`` records every ``c10d`` op (all-reduce, all-gather, reduce-scatter, all-to-all, send,
recv, broadcast) with its bytes and group size.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_SCALAR_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


def _touches_cuda(args, kwargs) -> bool:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        return True
    return any(isinstance(leaf, FakeTensor) or (isinstance(leaf, torch.Tensor) and leaf.is_cuda)
               for leaf in tree_leaves((args, kwargs)))


def _zero_of(tensor: torch.Tensor) -> Any:
    if tensor.dtype == torch.bool:
        return False
    return 0.0 if tensor.dtype.is_floating_point or tensor.dtype.is_complex else 0


class FakeCudaMode(TorchDispatchMode):
    """CUDA tensors fake, the rest real (module docstring). ``scalar_reads`` counts the value-less reads.

    It holds a ``FakeTensorMode`` entered with it: torch runs that mode after every user mode, and its
    presence is also what lets ``torch.randn(..., device="cuda")`` skip CUDA's lazy initialization."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.scalar_reads = 0

    def __enter__(self):
        self.fake.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.fake.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _touches_cuda(args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in _SCALAR_READS:
            self.scalar_reads += 1
            return _zero_of(args[0])
        if func == torch.ops.aten._pin_memory.default:
            return args[0]
        if func == torch.ops.aten.is_pinned.default:
            return False
        return func(*args, **kwargs)  # on to the FakeTensorMode


@dataclasses.dataclass
class Collective:
    """One kind of collective seen: its op, group size and message bytes, how often per step."""

    op: str
    group_size: int
    bytes: int
    count: int = 0


class CollectiveRecorder(TorchDispatchMode):
    """Records each ``c10d`` op's name, group size and tensor bytes (the inputs of the op)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple, Collective] = collections.OrderedDict()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname not in ("wait", "barrier", "monitored_barrier"):
            leaves = tree_leaves((args, kwargs))
            groups = [dist.ProcessGroup.unbox(a) for a in leaves
                      if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())]
            size = groups[0].size() if groups else 0
            nbytes = max((sum(t.numel() * t.element_size() for t in tree_leaves(arg) if isinstance(t, torch.Tensor))
                          for arg in args[:2]), default=0)  # the larger of output and input: the full message
            key = (func._opname, size, nbytes)
            entry = self.seen.setdefault(key, Collective(func._opname, size, nbytes))
            entry.count += 1
        return func(*args, **kwargs)

    def summary(self) -> list[dict]:
        return [dataclasses.asdict(c) for c in self.seen.values()]
