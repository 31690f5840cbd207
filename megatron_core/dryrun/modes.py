"""The dispatch modes of a dry run: CUDA tensors fake, CPU tensors real, and every collective recorded.

``FakeCudaMode`` sends each op that touches a CUDA device (a ``device="cuda"`` argument, a CUDA or fake tensor
input) to torch's ``FakeTensorMode``, which computes output shapes, dtypes and devices without memory or
arithmetic, and runs every other op for real: the CPU bookkeeping a run does (layout grids, datasets, RNG
states, ``.tolist()`` of real tensors) keeps its values. A scalar read off a fake tensor (``.item()``,
``bool(t)``) has no value; it reads as 0 (False), which is what a healthy step's checks expect: no inf in the
gradients, a finite loss. Values are meaningless in a dry run; shapes, bytes, FLOPs and collectives are not.

``register_cuda_attention`` runs ``F.scaled_dot_product_attention`` on fake CUDA tensors through the fused kernel a
CUDA build picks (flash, else memory-efficient): a CPU build has no CUDA kernel chooser, so the call would
decompose into the math path, whose ``[s, s]`` scores a GPU never holds.

``register_cuda_silu_backward`` does the same for SwiGLU's ``silu_backward``: a CPU build has no CUDA kernel
for it either, so it would run its composite (``math_silu_backward``: sigmoid, ones, sub, mul, add, mul, mul)
with ``[tokens, ffn/tp]`` temporaries a GPU's one fused kernel never allocates (0.33 GiB at Llama-3-8B, tp 4).

``CollectiveRecorder`` records every ``c10d`` op (all-reduce, all-gather, reduce-scatter, all-to-all, send,
recv, broadcast) with its bytes and group size.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from megatron_core.context_parallel.fused import kernel_for

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
    presence is also what lets ``torch.randn(..., device="cuda")`` skip CUDA's lazy initialization. Creating
    one registers ``cuda_sdpa`` (``register_cuda_attention``) and a one-output ``silu_backward``
    (``register_cuda_silu_backward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.scalar_reads = 0
        register_cuda_attention()
        register_cuda_silu_backward()

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


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False) -> Optional[torch.Tensor]:
    """``F.scaled_dot_product_attention`` through the kernel a CUDA build chooses for these inputs (flash:
    16-bit, head dim a multiple of 8 up to 256, no mask, sm80+; else memory-efficient), so that autograd saves
    what it saves on a GPU (q, k, v, the output and its fp32 log-sum-exp). None where the call is not on CUDA
    or neither kernel takes it (the caller then runs the math path, as a CUDA build would)."""
    kernel = kernel_for(query) if query.device.type == "cuda" and not enable_gqa else None
    if kernel == "cuda_flash" and attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    if kernel is not None:
        log_sumexp = any(t.requires_grad for t in (query, key, value)) and torch.is_grad_enabled()
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, log_sumexp,
                                                                      dropout_p, is_causal, scale=scale)[0]
    return None


def _sdpa_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False) -> torch.Tensor:
    out = cuda_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out is not None:
        return out
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                             scale=scale, enable_gqa=enable_gqa)[0]


@functools.cache
def register_cuda_attention() -> torch.library.Library:
    """Registers ``cuda_sdpa`` as this process's CUDA kernel of ``aten::scaled_dot_product_attention`` (at its
    ``AutogradCUDA`` key, where a CUDA build's own chooser sits), once. Dry-run processes only: a CPU build has
    no CUDA chooser, and the op would decompose into its math path. A dispatch-level kernel, not a Python
    function mode, so that it also holds in backward (activation recompute) and on autograd's threads."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("scaled_dot_product_attention", _sdpa_on_cuda, "AutogradCUDA")
    return library  # cached, so kept alive: the registration lasts as long as the library object


def _silu_backward_on_cuda(grad_output: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    """The fused kernel's one output. Registered on CPU builds only, where every CUDA tensor is a dry run's fake
    one, whose values are meaningless."""
    return torch.empty_like(grad_output)


@functools.cache
def register_cuda_silu_backward() -> Optional[torch.library.Library]:
    """On a CPU build of torch, registers a one-output kernel of ``aten::silu_backward`` at ``AutogradCUDA``
    (where the composite ``math_silu_backward`` would otherwise run on fake CUDA tensors), once; a CUDA build
    has its fused kernel: nothing is registered (None)."""
    if torch.backends.cuda.is_built():
        return None
    library = torch.library.Library("aten", "IMPL")
    library.impl("silu_backward", _silu_backward_on_cuda, "AutogradCUDA")
    return library


class FlopCounter(TorchDispatchMode):
    """Total FLOPs of the ops run (``torch.utils.flop_counter``'s formulas). Not ``FlopCounterMode``: its module
    tracker's hooks kept every activation of a checkpointed region alive (7 GB of phantom activations in a
    dry run of 70B with full recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.total += count(*args, **kwargs, out_val=out)
        return out


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
