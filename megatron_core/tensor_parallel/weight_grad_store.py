"""Deferred weight-gradient GEMMs for zero-bubble pipelining (Qi et al. 2023, arXiv 2401.10241).

A linear layer's backward is two GEMMs: the input gradient ``dX = dY W`` (which the previous pipeline stage
waits for) and the weight gradient ``dW = dY^T X`` (which nobody waits for until the optimizer step). The
zero-bubble schedule runs them as separate passes: B computes every input gradient and sends it at once, and a
later W pass computes the weight gradients, filling time a 1F1B rank would spend idle.

``WeightGradStore`` is held by the ``ParallelState`` (``state.weight_grad_store``) and given to every
column-/row-parallel linear built with it. A zero-bubble schedule runs inside ``with store.schedule():``.
The forward of a micro-batch whose backward will be split runs inside ``with store.deferrable_forward():``,
where the linears run ``linear_deferrable`` (our own autograd function) instead of ``F.linear``. Inside
``with store.backward_pass():`` that function's backward computes ``dX`` (and the bias grad) only and queues
the ``dW`` GEMM with the tensors it needs (``X`` and ``dY``, held until W runs). ``run_weight_pass()`` runs
the oldest backward pass's queue as one autograd run: each queued GEMM is the backward of a small node whose
input is the weight, so ``dW`` is computed only when the engine reaches it, lands in ``weight.grad`` through
the usual grad accumulator, and the accumulator's hooks (a data-parallel wrapper's bucket hooks) fire as in
any backward. Outside ``deferrable_forward()`` the linears run ``F.linear``, untouched.

Other parameters (norms, biases, embeddings) get their grads in B, as usual: they are a few percent of the
weight-gradient FLOPs. The chunked ``tp_comm_overlap`` GEMMs are not deferred, nor are the GEMMs inside
``--compile``'s compiled layers (as in torch pipelining's zero bubble, which refuses torch.compile).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

WeightGrad = Callable[[], torch.Tensor]


class WeightGradStore:
    """Queues the weight-gradient GEMMs of backward passes and runs them later, one pass at a time (FIFO)."""

    def __init__(self) -> None:
        self.in_schedule = False
        """A schedule that defers weight gradients is running."""
        self.active = False
        """A forward whose backward will defer its weight gradients is running: linears build deferrable nodes
        (``deferrable_forward``)."""
        self.deferring = False
        """A B pass is running: deferrable nodes queue their weight GEMM instead of running it."""
        self._current: list[tuple[torch.Tensor, WeightGrad]] = []
        self._passes: collections.deque[list[tuple[torch.Tensor, WeightGrad]]] = collections.deque()

    @property
    def pending_passes(self) -> int:
        """Backward passes whose weight gradients have not been computed yet."""
        return len(self._passes)

    @contextlib.contextmanager
    def schedule(self) -> Iterator[None]:
        """Scope of one zero-bubble schedule run. On exit every queued pass must have run (else an error:
        weight gradients would be lost); on an exception the queue is dropped."""
        if self.in_schedule:
            raise RuntimeError("a zero-bubble schedule is already running with this WeightGradStore")
        self.in_schedule = True
        try:
            yield
        except BaseException:
            self.clear()
            raise
        finally:
            self.in_schedule = self.active = False
        if self._passes or self._current:
            pending = len(self._passes)
            self.clear()
            raise RuntimeError(f"{pending} backward pass(es) ended the schedule with their weight gradients not "
                               "computed: every B needs its W (run_weight_pass)")

    @contextlib.contextmanager
    def deferrable_forward(self, enabled: bool = True) -> Iterator[None]:
        """Scope of an F pass whose B will defer its weight gradients (with ``enabled``; a forward whose
        backward runs whole keeps torch's own linear, which costs less)."""
        previous, self.active = self.active, enabled
        try:
            yield
        finally:
            self.active = previous

    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        """Scope of one B pass: the weight GEMMs of its deferrable nodes are queued as one unit. (Activation
        recompute inside it rebuilds the forward as that forward ran: with deferrable linears.)"""
        previous, self.deferring, self.active = self.active, True, True
        try:
            yield
        finally:
            self.deferring, self.active = False, previous
            self._passes.append(self._current)
            self._current = []

    def defer(self, weight: torch.Tensor, weight_grad: WeightGrad) -> None:
        self._current.append((weight, weight_grad))

    def run_weight_pass(self) -> None:
        """Computes and accumulates the weight gradients of the oldest queued B pass (one autograd run)."""
        if not self._passes:
            raise RuntimeError("run_weight_pass: no backward pass is waiting for its weight gradients")
        queued = self._passes.popleft()
        if not queued:
            return
        with torch.enable_grad():
            roots = [_WeightGradNode.apply(weight, weight_grad) for weight, weight_grad in queued]
        torch.autograd.backward(roots, [torch.ones((), dtype=r.dtype, device=r.device) for r in roots])

    def clear(self) -> None:
        self._current, self._passes = [], collections.deque()


class _WeightGradNode(torch.autograd.Function):
    """A scalar whose backward is ``weight``'s queued gradient: gives the deferred GEMM an autograd node, so
    its result goes through ``weight``'s grad accumulator (and its hooks) when the engine reaches it."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, weight_grad: WeightGrad) -> torch.Tensor:
        ctx.weight_grad = weight_grad
        return torch.zeros((), dtype=weight.dtype, device=weight.device)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        grad, ctx.weight_grad = ctx.weight_grad(), None
        return grad, None


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient may be deferred (see the module docstring).

    Shapes: x ``[..., in]``, weight ``[out, in]``, bias ``[out]`` -> ``[..., out]``. No communication."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        ctx.weight = deferrable_target(weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_input = grad_output @ weight if needs_input else None
        grad_weight = grad_bias = None
        if needs_weight:
            def weight_grad() -> torch.Tensor:
                return weight_gradient(grad_output, x)
            if ctx.store.deferring and ctx.weight is not None:
                ctx.store.defer(ctx.weight, weight_grad)
            else:
                grad_weight = weight_grad()
        if ctx.has_bias and needs_bias:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias, None


def weight_gradient(grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dW = dY^T X`` ``[out, in]`` for grad_output ``[..., out]`` and x ``[..., in]``. With out > in it is
    computed as ``(X^T dY)^T`` (a transposed view, as torch's own linear backward returns), which on CPU reads
    cold operands up to 1.4x faster (a deferred weight gradient finds its operands out of cache)."""
    grad_2d, x_2d = grad_output.reshape(-1, grad_output.shape[-1]), x.reshape(-1, x.shape[-1])
    if grad_2d.shape[1] > x_2d.shape[1]:
        return (x_2d.t() @ grad_2d).t()
    return grad_2d.t() @ x_2d


def deferrable_target(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor a deferred weight gradient goes to: the weight itself when it is a leaf (a parameter), kept
    from forward, since the copy backward unpacks may be a detached alias (activation recompute saves
    ``weight.detach()``); None (no deferral) for a weight computed from others."""
    return weight if weight.requires_grad and weight.grad_fn is None else None


def deferring_forward(store: Optional[WeightGradStore]) -> bool:
    """Whether a linear running now should build a deferrable node: in ``store.deferrable_forward()``, with
    grad enabled, and not while torch.compile traces (a compiled graph cannot queue Python closures)."""
    return (store is not None and store.active and torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def linear_deferrable(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      store: Optional[WeightGradStore]) -> torch.Tensor:
    """``F.linear``, or, in a ``store.deferrable_forward()``, the same GEMM with a deferrable weight gradient
    (not inside a compiled region: ``--compile``'s layers run whole backwards)."""
    if not deferring_forward(store):
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias, store)
