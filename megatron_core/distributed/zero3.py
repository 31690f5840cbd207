"""ZeRO-3: gather each submodule's parameters just before it runs (forward and backward), free them after.

A *unit* is a module that owns parameters directly (``module.parameters(recurse=False)``); its parameters form
its buckets. The wrapped root module is always a unit and also owns every *tied* parameter: one registered in
more than one module, or tagged ``shared_embedding`` (GPTModel's output layer reads the embedding weight
through a forward argument). Tied parameters therefore stay gathered for the whole forward and for the whole
backward of one micro-batch (FSDP2 keeps its root unit gathered the same way).

Forward: a pre-hook all-gathers the unit (waiting for a prefetch already in flight) and starts the
all-gather of the unit that ran next in the previous forward; a post-hook frees the unit (with
``reshard_after_forward``) and registers a hook on its outputs. Backward: that output hook gathers the unit
again before its backward runs and prefetches the unit that ran before it in the forward; a unit is freed as
soon as all its parameters' grads are accumulated (``on_bucket_grads_done``), and whatever is still gathered
when backward ends is freed then. Freeing releases the gathered storage itself (``Bucket.release_params``), so
the views autograd saved for backward hold no memory; the backward gather refills the same storage.

Besides the root, at most ``max_live_units`` (2) units are gathered at once: a prefetch that would exceed it
is skipped. Under activation recompute the recomputing forward (run from inside a unit's backward) gathers
and frees each unit as a forward does, without prefetching and after dropping pending prefetches; the unit
whose backward triggered the recompute stays gathered, and each recomputed unit is gathered again for its
own backward. A parameter that a unit returns (a bias under
``skip_bias_add``) is used by the caller: its bucket (stage-3 buckets keep 1-D and other parameters apart)
stays gathered until the root's forward ends and is gathered again when the root's backward starts. A module
called twice is gathered twice in forward and once in backward (its grads accumulate once). All ranks issue
the same collectives in the same order, because the hooks fire in the same order on every dp rank.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megatron_core.distributed.param_and_grad_buffer import Bucket

_TIED_TAGS = ("shared_embedding",)


def plan_units(root: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
    """Maps each unit (root first, then modules in registration order) to the trainable parameters it gathers."""
    owners: dict[nn.Parameter, set[int]] = {}
    for module in root.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(param, set()).add(id(module))
    tied = [p for p, mods in owners.items()
            if p.requires_grad and (len(mods) > 1 or any(getattr(p, tag, False) for tag in _TIED_TAGS))]
    units: dict[nn.Module, list[nn.Parameter]] = {root: list(tied)}
    seen = set(tied)
    for module in root.modules():
        for param in module.parameters(recurse=False):
            if param.requires_grad and param not in seen:
                seen.add(param)
                units.setdefault(module, []).append(param)
    return units


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


class ParameterGatherer:
    """Installs the gather / prefetch / free hooks of ZeRO-3 on ``units``.

    Args:
        root: the wrapped module (the first unit).
        unit_buckets: each unit and its buckets (one per bucket kind).
        backward_started: called from the first backward hook (queues the end-of-backward callback).
        reshard_after_forward: free each unit after its forward (else after its grads are reduced).
        max_live_units: units (besides the root) gathered or being gathered at once; prefetches beyond it wait.
    Collectives: all-gather over dp of each unit's shards in forward and again in backward.
    """

    def __init__(self, root: nn.Module, unit_buckets: dict[nn.Module, list[Bucket]], *,
                 backward_started: Callable[[], None], reshard_after_forward: bool = True,
                 max_live_units: int = 2) -> None:
        self.root, self.unit_buckets, self._backward_started = root, unit_buckets, backward_started
        self.reshard_after_forward, self.max_live_units = reshard_after_forward, max_live_units
        self.bucket_unit = {bucket: unit for unit, buckets in unit_buckets.items() for bucket in buckets}
        self.in_backward = False
        # buckets whose params a unit returned, kept until the root's end; a dict, not a set: its order (the
        # forward's) is the order of their gathers, which must be the same on every rank
        self.deferred: dict[Bucket, None] = {}
        self._live: set[Bucket] = set()     # buckets of non-root units gathered or in flight
        self._active: set[nn.Module] = set()  # units whose backward has started and whose grads are not done
        self._order: list[nn.Module] = []       # units in the order their forward ran (this forward)
        self._last_order: list[nn.Module] = []  # ... in the previous forward (forward prefetch)
        self._handles: list[RemovableHandle] = []
        for unit in unit_buckets:
            self._handles.append(unit.register_forward_pre_hook(self._pre_forward))
            self._handles.append(unit.register_forward_hook(self._post_forward))

    # ----------------------------------------------------------------------------------------------------------
    # gather, prefetch, release
    def live_units(self) -> set[nn.Module]:
        """Units other than the root whose parameters are gathered or being gathered."""
        return {self.bucket_unit[b] for b in self._live}

    def _start(self, unit: nn.Module) -> None:
        for bucket in self.unit_buckets[unit]:
            bucket.start_gather()
            if unit is not self.root and bucket not in self.deferred:
                self._live.add(bucket)

    def _gather(self, unit: nn.Module) -> None:
        self._start(unit)
        for bucket in self.unit_buckets[unit]:
            bucket.wait_gather()

    def _prefetch(self, unit: Optional[nn.Module]) -> None:
        if unit is None or unit is self.root:
            return
        live = self.live_units()
        if unit not in live and len(live) < self.max_live_units:
            self._start(unit)

    def release_bucket(self, bucket: Bucket) -> None:
        """Frees one bucket's gathered parameters (unless the caller of its unit still uses them)."""
        if bucket not in self.deferred:
            bucket.release_params()
            self._live.discard(bucket)

    def _release(self, unit: nn.Module) -> None:
        for bucket in self.unit_buckets[unit]:
            self.release_bucket(bucket)

    def on_bucket_grads_done(self, bucket: Bucket) -> None:
        """Every parameter of ``bucket`` has its grad for this backward: no use of it is left, free it."""
        bucket.release_params()
        self._live.discard(bucket)
        unit = self.bucket_unit.get(bucket)
        if unit is not None and not any(b.gathered for b in self.unit_buckets[unit]):
            self._active.discard(unit)

    # ----------------------------------------------------------------------------------------------------------
    # hooks
    def _pre_forward(self, unit: nn.Module, args: Any) -> None:
        if unit is self.root and not self.in_backward:
            self._last_order, self._order = (self._order or self._last_order), []
        if self.in_backward and unit is not self.root:
            # activation recompute inside backward: make room by dropping prefetches (units whose backward
            # has not started), so at most this unit and the one whose backward triggered it are gathered
            for other in self.live_units() - self._active - {unit}:
                self._release(other)
        self._gather(unit)
        if not self.in_backward:  # a recomputing forward (inside backward) runs in reverse layer order
            self._order.append(unit)
            position = len(self._order)
            self._prefetch(self._last_order[position] if position < len(self._last_order) else None)

    def _post_forward(self, unit: nn.Module, args: Any, output: Any) -> None:
        outputs = list(_tensors(output))
        returned = {id(t) for t in outputs}
        for bucket in self.unit_buckets[unit]:
            if any(id(p) in returned for p in bucket.params):
                self.deferred[bucket] = None  # e.g. a bias returned by skip_bias_add, used by the caller
                self._live.discard(bucket)
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            for tensor in outputs:
                if tensor.requires_grad and not isinstance(tensor, nn.Parameter):
                    tensor.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
        if (self.reshard_after_forward or not grad_enabled) and unit not in self._active:
            self._release(unit)  # (a unit whose backward is running keeps its parameters: recompute)
        if unit is self.root and (self.reshard_after_forward or not grad_enabled):
            for bucket in self.deferred:
                bucket.release_params()

    def _pre_backward(self, unit: nn.Module) -> None:
        self.in_backward = True
        self._backward_started()
        if unit is not self.root:
            self._active.add(unit)
        if unit is self.root:
            for bucket in self.deferred:
                bucket.start_gather()
            for bucket in self.deferred:
                bucket.wait_gather()
        if all(bucket.gathered for bucket in self.unit_buckets[unit]):
            return
        self._gather(unit)
        if unit in self._order:
            position = len(self._order) - 1 - self._order[::-1].index(unit)
            self._prefetch(self._order[position - 1] if position > 0 else None)

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
        self.in_backward = False

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
