"""ZeRO-3: gather each submodule's parameters just before it runs (forward and backward), free them after.

A *unit* is a module that owns parameters directly (``module.parameters(recurse=False)``); its parameters form
its buckets. A parameter registered in several modules (a tied weight) gets buckets of its own, which every
one of those units gathers; a parameter passed to a unit's forward as an argument (GPTModel's output layer
reads the tied embedding weight through ``weight=``) is *borrowed*: the unit gathers its buckets too. So a
tied embedding is gathered for the embedding and again for the output layer, never for the whole step.

Forward: a pre-hook all-gathers the unit (waiting for a prefetch already in flight) and starts the all-gather
of the unit that ran next in the previous forward; a post-hook frees the unit (with ``reshard_after_forward``)
and registers hooks on its outputs (pre-backward) and its inputs (post-backward). Backward: the output hook
gathers the unit again before its backward runs and prefetches the unit that ran before it in the forward;
the unit is freed when the grads of its inputs are complete (its backward is done) or when all its
parameters' grads are accumulated (``on_bucket_grads_done``), whichever comes first; whatever is still
gathered when backward ends is freed then. Freeing releases the gathered storage itself
(``Bucket.release_params``), so the views autograd saved for backward hold no memory; the backward gather
refills the same storage.

With ``reshard_after_forward`` at most ``max_live_units`` (2) units besides the root are gathered at once: a
prefetch that would exceed it waits until a unit is freed. Under activation recompute the recomputing forward
(run from inside a unit's backward) gathers and frees each unit as a forward does, without prefetching and
after dropping pending prefetches; the unit whose backward triggered it stays gathered. A parameter that a
unit returns (a bias under ``skip_bias_add``) is used by the caller: its bucket (the 1-D parameters of a unit
with ``skip_bias_add`` get buckets of their own) stays gathered until the root's forward ends and is gathered again when
the root's backward starts. A module called twice is gathered twice in forward and once in backward (its grads
accumulate once). All ranks issue the same collectives in the same order: the hooks fire in the same order on
every dp rank, and every collection iterated here is ordered (lists and dicts, never sets).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megatron_core.distributed.param_and_grad_buffer import Bucket
from megatron_core.tensor_parallel.initialization import logical_shape


def plan_units(root: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
    """Maps each unit (root first, then modules in registration order) to the trainable parameters it gathers.

    A module's unit holds the parameters registered in it; a parameter registered in several modules appears
    in each of their lists. A module with ``gathers_small_parameters = True`` (``TransformerLayer``) takes the
    1-D parameters of everything inside it (norm weights, biases) into its own unit, gathered for its whole
    forward and backward: one small gather instead of one per norm and bias, and a bias returned to the
    layer (``skip_bias_add``) needs no special keeping. A module with ``gathers_all_parameters = True`` (a
    layer compiled by ``megatron_core.transformer.compile``, or ``LocalExperts``, whose forward reads its
    experts' weights itself) is one unit of every parameter inside it, claimed before any
    ``gathers_small_parameters`` module above it takes their 1-D ones; the modules inside it are no units at
    all (its hooks run around it, none inside). Leaf modules without parameters are units with an empty list
    (they may borrow parameters passed to their forward).
    """
    claimed: dict[nn.Parameter, nn.Module] = {}
    inside_whole: set[int] = set()  # ids of modules inside a gathers_all_parameters module: no units, no hooks
    for module in root.modules():  # the outermost gathers_all_parameters modules claim everything inside them
        if id(module) in inside_whole or module is root or not getattr(module, "gathers_all_parameters", False):
            continue
        inside_whole.update(id(m) for m in module.modules() if m is not module)
        for param in module.parameters():
            if param.requires_grad:
                claimed.setdefault(param, module)
    for module in root.modules():
        if id(module) in inside_whole or not getattr(module, "gathers_small_parameters", False):
            continue
        for param in module.parameters():
            if param.requires_grad and len(logical_shape(param)) <= 1:
                claimed.setdefault(param, module)
    units: dict[nn.Module, list[nn.Parameter]] = {root: []}
    for module in root.modules():
        if id(module) in inside_whole:
            continue
        if _claims(module):
            units.setdefault(module, []).extend(dict.fromkeys(p for p, owner in claimed.items() if owner is module))
        for param in module.parameters(recurse=False):
            if param.requires_grad and param not in claimed:
                units.setdefault(module, []).append(param)
        if next(module.children(), None) is None:
            units.setdefault(module, [])  # a leaf without parameters may borrow one through its arguments
    return units


def _claims(module: nn.Module) -> bool:
    """Whether ``module`` gathers parameters of its submodules with its own (``gathers_small_parameters``: the
    1-D ones; ``gathers_all_parameters``, set on compiled layers: all of them, and no hook runs inside it)."""
    return getattr(module, "gathers_all_parameters", False) or getattr(module, "gathers_small_parameters", False)


def _counts_as_live(unit: nn.Module) -> bool:
    """A unit of only small parameters does not count against ``max_live_units``."""
    return getattr(unit, "gathers_all_parameters", False) or not getattr(unit, "gathers_small_parameters", False)


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


def _backward_uses_parameters(unit: nn.Module) -> bool:
    """False for a module whose backward needs no parameter values (an embedding lookup's weight grad is a
    scatter-add of the output grad): its backward is not preceded by a gather, its parameters only get their
    shape back (``Bucket.shape_params``). A module says so with a ``backward_uses_parameters = False``
    attribute; ``nn.Embedding`` is known."""
    return getattr(unit, "backward_uses_parameters", not isinstance(unit, nn.Embedding))


class ParameterGatherer:
    """Installs the gather / prefetch / free hooks of ZeRO-3 on ``units``.

    Args:
        root: the wrapped module (the first unit).
        unit_buckets: each unit and its buckets (a tied parameter's buckets appear under each unit using it).
        param_bucket: the bucket of every parameter (to find the buckets of borrowed parameters).
        backward_started: called from the first backward hook (queues the end-of-backward callback).
        reshard_after_forward: free each unit after its forward (else after its backward).
        max_live_units: units (besides the root) gathered or being gathered at once, with reshard_after_forward.
    Collectives: all-gather over dp of each unit's shards in forward and again in backward (``fp8=True``: with
    ``--fp8-param-gather`` the FP8 linears' weights go as FP8 bytes, ``fp8_param_gather.Fp8ShardGather``).
    """

    def __init__(self, root: nn.Module, unit_buckets: dict[nn.Module, list[Bucket]], *,
                 param_bucket: dict[nn.Parameter, Bucket], backward_started: Callable[[], None],
                 reshard_after_forward: bool = True, max_live_units: int = 2) -> None:
        self.root, self.unit_buckets, self.param_bucket = root, unit_buckets, param_bucket
        self._backward_started = backward_started
        self.reshard_after_forward = reshard_after_forward
        self.max_live_units = max_live_units if reshard_after_forward else len(unit_buckets)
        self.bucket_users: dict[Bucket, list[nn.Module]] = {}
        for unit, buckets in unit_buckets.items():
            for bucket in buckets:
                self.bucket_users.setdefault(bucket, []).append(unit)
        self.in_backward = False
        # buckets whose params a unit returned, kept until the root's end; a dict, not a set: its order (the
        # forward's) is the order of their gathers, which must be the same on every rank
        self.deferred: dict[Bucket, None] = {}
        self.borrowed: dict[nn.Module, list[Bucket]] = {}  # buckets of parameters passed to a unit's forward
        self._live: dict[Bucket, None] = {}   # buckets of non-root units gathered or in flight
        self._active: dict[nn.Module, None] = {}  # units whose backward has started and is not done
        self._pending: Optional[nn.Module] = None  # a backward prefetch waiting for room
        self._order: list[nn.Module] = []       # units in the order their forward ran (this forward)
        self._last_order: list[nn.Module] = []  # ... in the previous forward (forward prefetch)
        self._handles: list[RemovableHandle] = []
        for unit in unit_buckets:
            self._handles.append(unit.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(unit.register_forward_hook(self._post_forward, with_kwargs=True))

    # ----------------------------------------------------------------------------------------------------------
    # gather, prefetch, release
    def buckets_of(self, unit: nn.Module) -> list[Bucket]:
        return self.unit_buckets[unit] + [b for b in self.borrowed.get(unit, ()) if b not in self.unit_buckets[unit]]

    def live_units(self) -> list[nn.Module]:
        """Units other than the root whose parameters are gathered or being gathered (by first user); the
        small-parameter units of ``gathers_small_parameters`` modules do not count."""
        return list(dict.fromkeys(self.bucket_users[b][0] for b in self._live
                                  if _counts_as_live(self.bucket_users[b][0])))

    def _start(self, unit: nn.Module) -> None:
        for bucket in self.buckets_of(unit):
            bucket.start_gather(fp8=True)
            if unit is not self.root and bucket not in self.deferred:
                self._live[bucket] = None

    def _gather(self, unit: nn.Module) -> None:
        self._start(unit)
        for bucket in self.buckets_of(unit):
            bucket.wait_gather(fp8=True)

    def _prefetch(self, unit: Optional[nn.Module]) -> bool:
        """Starts gathering ``unit`` if there is room; False when it has to wait."""
        if unit is None or unit is self.root:
            return True
        live = self.live_units()
        if unit in live or all(b in self._live or b in self.deferred for b in self.buckets_of(unit)):
            return True
        if len(live) >= self.max_live_units:
            return False
        self._start(unit)
        return True

    def _prefetch_pending(self) -> None:
        if self._pending is not None and self._prefetch(self._pending):
            self._pending = None

    def release_bucket(self, bucket: Bucket) -> None:
        """Frees one bucket's gathered parameters, unless the caller of its unit still uses them (deferred) or
        a unit whose backward is running uses them."""
        if bucket in self.deferred or any(unit in self._active for unit in self.bucket_users.get(bucket, ())):
            return
        bucket.release_params()
        self._live.pop(bucket, None)

    def _release(self, unit: nn.Module) -> None:
        for bucket in self.buckets_of(unit):
            self.release_bucket(bucket)

    def on_bucket_grads_done(self, bucket: Bucket) -> None:
        """Every parameter of ``bucket`` has its grad for this backward: no use of it is left, free it."""
        bucket.release_params()
        self._live.pop(bucket, None)
        self._prefetch_pending()

    # ----------------------------------------------------------------------------------------------------------
    # hooks
    def _pre_forward(self, unit: nn.Module, args: Any, kwargs: dict) -> None:
        if unit is self.root and not self.in_backward:
            self._last_order, self._order = (self._order or self._last_order), []
        borrowed = [self.param_bucket[t] for t in _tensors((args, kwargs))
                    if isinstance(t, nn.Parameter) and t in self.param_bucket]
        self.borrowed[unit] = list(dict.fromkeys(borrowed))
        if unit is not self.root and not self.buckets_of(unit):
            return  # a leaf that holds and borrows nothing this time
        if self.in_backward and unit is not self.root:
            # activation recompute inside backward: make room by dropping prefetches (units whose backward
            # has not started), so at most this unit and the one whose backward triggered it are gathered
            for other in self.live_units():
                if other is not unit and other not in self._active:
                    self._release(other)
        self._gather(unit)
        if not self.in_backward:  # a recomputing forward (inside backward) does not prefetch
            self._order.append(unit)
            position = len(self._order)
            self._prefetch(self._last_order[position] if position < len(self._last_order) else None)

    def _post_forward(self, unit: nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        if unit is not self.root and not self.buckets_of(unit):
            return
        outputs = list(_tensors(output))
        returned = {id(t) for t in outputs}
        for bucket in self.unit_buckets[unit]:
            if any(id(p) in returned for p in bucket.params):
                self.deferred[bucket] = None  # e.g. a bias returned by skip_bias_add, used by the caller
                self._live.pop(bucket, None)
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and not self.in_backward:
            for tensor in outputs:
                if tensor.requires_grad and not isinstance(tensor, nn.Parameter):
                    tensor.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
            for tensor in _tensors((args, kwargs)):
                if tensor.requires_grad and not isinstance(tensor, nn.Parameter):
                    tensor.register_hook(lambda grad, unit=unit: self._post_backward(unit))
        if (self.reshard_after_forward or not grad_enabled) and unit not in self._active:
            self._release(unit)  # (a unit whose backward is running keeps its parameters: recompute)
        if unit is self.root and (self.reshard_after_forward or not grad_enabled):
            for bucket in self.deferred:
                bucket.release_params()

    def _pre_backward(self, unit: nn.Module) -> None:
        self.in_backward = True
        self._backward_started()
        if unit is self.root:
            for bucket in self.deferred:
                bucket.start_gather(fp8=True)
            for bucket in self.deferred:
                bucket.wait_gather(fp8=True)
        else:
            self._active[unit] = None
        if not _backward_uses_parameters(unit):
            for bucket in self.buckets_of(unit):
                bucket.shape_params()
        elif not all(bucket.gathered for bucket in self.buckets_of(unit)):
            self._gather(unit)
        if unit in self._order:
            position = len(self._order) - 1 - self._order[::-1].index(unit)
            self._pending = self._order[position - 1] if position > 0 else None
            self._prefetch_pending()

    def _post_backward(self, unit: nn.Module) -> None:
        """The grads of the unit's inputs are complete, so its backward is done: free it."""
        if unit in self._active:
            del self._active[unit]
            self._release(unit)
        self._prefetch_pending()

    def on_backward_end(self) -> None:
        """Frees every unit still gathered (e.g. parameters that received no grad)."""
        self.release_all()

    def release_all(self) -> None:
        """Frees every gathered unit."""
        for buckets in self.unit_buckets.values():
            for bucket in buckets:
                bucket.release_params()
        self._live.clear()
        self._active.clear()
        self._pending = None
        self.in_backward = False

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
