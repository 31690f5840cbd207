"""``DistributedDataParallel``: bucketed, overlapped gradient reduction over dp, and ZeRO stages 2-3.

Wraps any ``nn.Module``. Gradients land in contiguous buffers (``param.main_grad`` is a view) cut into
buckets, in reverse registration order (roughly the order backward produces them). A hook on each
parameter's grad accumulator (``register_post_accumulate_grad_hook``) moves the grad into its bucket and,
once every parameter of the bucket has its grad, launches the bucket's asynchronous collective, so the
communication overlaps the rest of backward. Buckets are launched strictly in index order (a ready bucket
waits for the ones before it), so every dp rank issues the same collectives in the same order.

Collectives per backward: stage 0 all-reduces each bucket's grads over dp and stage 1 reduce-scatters them
(none inside ``no_sync()``: grads accumulate in the full buffer); stages 2-3 reduce-scatter each bucket into
the rank's 1/dp grad shard after every backward (``no_sync()`` does not defer them: keeping full grads
across micro-batches would undo the grad sharding, so they accumulate in the shard, as in DeepSpeed). On
gloo the reduce-scatters and all-gathers are batches of isend/irecv (``p2p_collectives``: a fifth of the CPU
time of gloo's own). Transient full-size buckets (stages 2-3) never outlive the backward.
Stage 2 keeps two: the newest bucket's reduction runs while the next one fills, and is waited for when that
one launches (DeepSpeed's ``overlap_comm`` double buffer), so the peak is fixed. Stage 3 keeps one: the
reductions in flight (which overlapped the unit's backward) finish before the next unit's bucket exists.
Stage 3 also all-gathers parameters around every submodule (see ``zero3``); at stages 1-2 the optimizer's
updated shards are all-gathered after the step, last bucket first (with ``overlap_param_gather``, waited on
by each module just before its next forward). Grad buffers are zeroed lazily: a parameter's first grad after
``zero_grad_buffer()`` is copied into its slot.

Mixture of experts: parameters tagged ``is_expert`` are held by the ranks of the expert-data-parallel group
only, so they go to buckets of their own (launched after the dense ones of the same position, in the same
order on every rank) reduced and sharded over ``expert_dp_group``; their grads are pre-scaled by the same
1/dp as the dense ones (each expert receives the tokens of its whole ep group, so the sum over expert-dp
covers every dp replica's tokens once).

Partial distributed optimizer (Megatron's ``--num-distributed-optimizer-instances N``, stages 1-2): ``dp_group``
(and ``expert_dp_group``) is this rank's optimizer instance and ``inter_dist_opt_group`` the N ranks at its position
in every instance (``ParallelState.intra_dp_cp_group`` / ``inter_dist_opt_group``). Each bucket is reduce-scattered
within the instance, its shard all-reduced across instances (after the reduce-scatters, in bucket order:
``Bucket.start_replica_reduce``), and the updated shards all-gathered within the instance, so the optimizer state
per rank is 1/(dp/N) of the total and every instance holds a full copy of it.

Sharded construction: a module built on the meta device (``GPTModel`` with a ``ParallelState`` whose device
is meta) is materialized here at stage 3, each rank writing only its shard from the parameters' init
recipes (``tensor_parallel.initialization``), so the full model never exists on any rank.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.distributed.ddp_config import DistributedDataParallelConfig
from megatron_core.distributed.fp8_param_gather import attach_fp8_param_gather
from megatron_core.distributed.param_and_grad_buffer import Bucket, BucketKind
from megatron_core.distributed.zero3 import ParameterGatherer, plan_units
from megatron_core.tensor_parallel.initialization import init_flat_values, logical_shape, swap_meta_parameters_
from megatron_core.tensor_parallel.utils import group_size
from megatron_core.utils import accelerator

logger = logging.getLogger(__name__)

_FULL_GRAD_TAGS = ("sequence_parallel", "shared_embedding")
_SAME_AS_DP: Any = object()  # expert_dp_group's default: the dp group


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper of ``module`` over ``dp_group`` (ZeRO stage from ``config``).

    Args:
        module: any module; its trainable parameters move into the buffers (stage 3: into 1/dp shards).
        config: bucket size, stage, overlap, grad dtype.
        dp_group: the group to reduce over (``state.dp_cp_group`` with context parallelism, else
            ``state.dp_group``); None means one rank.
        expert_dp_group: the group expert parameters (``is_expert``) are reduced over
            (``state.expert_dp_group``; None = one rank); default ``dp_group`` (right at ep 1 without tp).
        inter_dist_opt_group: with a partial distributed optimizer, the inter-instance group the grad shards are
            all-reduced over (``state.inter_dist_opt_group``; then ``dp_group`` and ``expert_dp_group`` are the
            intra-instance groups); None: one instance.
        device: where buffers live when the module is on the meta device (default: cuda for nccl, else cpu).

    Per-rank shapes: the wrapped module's forward is unchanged (stage 3 parameters are full while in use).
    Attributes not found on the wrapper are looked up on ``module``.
    """

    def __init__(self, module: nn.Module, *, config: DistributedDataParallelConfig, dp_group,
                 expert_dp_group=_SAME_AS_DP, device: Optional[torch.device] = None,
                 inter_dist_opt_group=None) -> None:
        super().__init__()
        if not isinstance(config, DistributedDataParallelConfig):
            raise ValueError(f"config must be a DistributedDataParallelConfig, got {type(config).__name__}")
        self.module, self.config, self.dp_group = module, config, dp_group
        self.expert_dp_group = dp_group if expert_dp_group is _SAME_AS_DP else expert_dp_group
        self.inter_dist_opt_group = inter_dist_opt_group
        instances = group_size(inter_dist_opt_group)
        if instances > 1 and config.zero_stage not in (1, 2):
            raise ValueError(f"{instances} distributed optimizer instances need zero_stage 1 or 2 (the distributed "
                             f"optimizer, --use-distributed-optimizer), got zero_stage {config.zero_stage}: use "
                             "--num-distributed-optimizer-instances 1 or ZeRO stage 1-2")
        self.dp_size = group_size(dp_group) * instances  # the dp x cp ranks the grads are averaged over
        if config.average_in_collective and dp_group is not None and dist.get_backend(dp_group) == "gloo":
            raise ValueError("average_in_collective=True needs ReduceOp.AVG, which the gloo backend lacks; "
                             "use average_in_collective=False (grads are pre-scaled by 1/dp)")
        self._reduce_op = dist.ReduceOp.AVG if config.average_in_collective else dist.ReduceOp.SUM
        self._grad_scale = 1.0 if config.average_in_collective else 1.0 / self.dp_size
        self._sync_enabled, self._next_launch, self._callback_queued = True, 0, False
        self.launch_log: list[int] = []  # bucket indices in launch order since the last zero_grad_buffer()
        self._in_flight: list[Bucket] = []  # launched reduce-scatters of transient (stage 2-3) buckets
        self.device = self._storage_device(device)
        self.buckets = self._build_buckets()
        self._param_to_bucket = {p: b for b in self.buckets for p in b.params}
        self._allocate_storage()
        attach_fp8_param_gather(self.buckets)  # tagged FP8 weights (--fp8-param-gather), stages 1-3
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_grad_hook(self))
                       for p in self._param_to_bucket]
        self.gatherer: Optional[ParameterGatherer] = None
        self.param_offload = "none"  # where stage-3 shards live between uses: see offload_param_shards
        if config.zero_stage == 3:
            units = {unit: list(dict.fromkeys(self._param_to_bucket[p] for p in params))
                     for unit, params in self._units.items()}
            self.gatherer = ParameterGatherer(module, units, param_bucket=self._param_to_bucket,
                                              backward_started=self._queue_backward_end,
                                              reshard_after_forward=config.reshard_after_forward)
        self._param_sync_hooks = self._install_param_sync_hooks() if config.overlap_param_gather else []

    # ----------------------------------------------------------------------------------------------------------
    # construction
    def _kind(self, param: nn.Parameter) -> BucketKind:
        grad_dtype = torch.float32 if self.config.grad_reduce_in_fp32 else param.dtype
        full_grads = any(getattr(param, t, False) for t in _FULL_GRAD_TAGS)
        stage = self.config.zero_stage
        return BucketKind(param.dtype, grad_dtype, shard_grads=stage >= 2 and not full_grads,
                          reduce_scatter=stage >= 1 and not full_grads, expert=bool(getattr(param, "is_expert", False)))

    def _build_buckets(self) -> list[Bucket]:
        """Stages 0-2: greedy buckets of ``bucket_size`` elements over the parameters in reverse order.
        Stage 3: one bucket per unit and kind (1-D parameters apart when the unit returns its bias; tied
        parameters apart), units in reverse order."""
        groups: list[tuple[BucketKind, list[nn.Parameter]]] = []
        if self.config.zero_stage == 3:
            self._units = plan_units(self.module)
            users: dict[nn.Parameter, int] = {}
            for params in self._units.values():
                for param in params:
                    users[param] = users.get(param, 0) + 1
            placed: set[nn.Parameter] = set()
            for unit, params in reversed(list(self._units.items())):
                # a unit that returns its bias (skip_bias_add) keeps 1-D parameters in a bucket of their own,
                # which stays gathered for the caller while the weights are freed
                returns_bias = getattr(unit, "skip_bias_add", False)
                by_kind: dict[tuple[BucketKind, bool, bool], list[nn.Parameter]] = {}
                for param in params:
                    if param not in placed:  # a tied parameter: buckets of its own, under its first unit
                        placed.add(param)
                        key = (self._kind(param), returns_bias and len(logical_shape(param)) <= 1, users[param] > 1)
                        by_kind.setdefault(key, []).append(param)
                groups.extend((kind, group) for (kind, _, _), group in by_kind.items())
        else:
            params = list(dict.fromkeys(p for p in self.module.parameters() if p.requires_grad))
            limit = self.config.resolved_bucket_size(self.dp_size, total_numel=sum(p.numel() for p in params))
            open_groups: dict[BucketKind, list[nn.Parameter]] = {}
            for param in reversed(params):
                kind = self._kind(param)
                group = open_groups.setdefault(kind, [])
                group.append(param)
                if sum(p.numel() for p in group) >= limit:
                    groups.append((kind, open_groups.pop(kind)))
            groups.extend(open_groups.items())
        return [Bucket(index=i, kind=kind, params=params, dp_group=group,
                       shard_params=self.config.zero_stage == 3, device=self.device,
                       p2p_collectives=self._p2p_collectives(group), replica_group=self.inter_dist_opt_group)
                for i, (kind, params) in enumerate(groups)
                for group in [self.expert_dp_group if kind.expert else self.dp_group]]

    def _p2p_collectives(self, group) -> bool:
        """``config.p2p_collectives``, or (None) whether ``group`` is a gloo group."""
        if self.config.p2p_collectives is not None:
            return self.config.p2p_collectives
        return group is not None and dist.get_backend(group) == "gloo"

    def _storage_device(self, device: Optional[torch.device]) -> torch.device:
        """The device of the buffers; a meta-device module (sharded construction) needs stage 3."""
        params = list(self.module.parameters())
        on_meta = any(p.is_meta for p in params) or any(b.is_meta for b in self.module.buffers())
        if not on_meta:
            return device or (params[0].device if params else torch.device("cpu"))
        if self.config.zero_stage != 3:
            raise ValueError(f"the module has parameters on the meta device, which only zero_stage 3 materializes "
                             f"(each rank its shard); got zero_stage {self.config.zero_stage}: build the model on "
                             "a real device or use zero_stage=3 (--use-megatron-fsdp)")
        if device is None:
            on_device = self.dp_group is not None and accelerator.is_device_backend(dist.get_backend(self.dp_group))
            device = torch.device("cuda", accelerator.current_device()) if on_device else torch.device("cpu")
        swap_meta_parameters_(self.module, device=device)
        return device

    def _allocate_storage(self) -> None:
        """One contiguous parameter buffer and one gradient buffer per bucket kind, cut into the buckets."""
        self.param_buffers: dict[BucketKind, torch.Tensor] = {}
        self.grad_buffers: dict[BucketKind, torch.Tensor] = {}
        for kind in dict.fromkeys(b.kind for b in self.buckets):
            buckets = [b for b in self.buckets if b.kind == kind]
            device = self.device
            param_sizes = [b.shard_size if b.shard_params else b.numel for b in buckets]
            grad_sizes = [b.shard_size if kind.shard_grads else b.numel for b in buckets]
            params = torch.empty(sum(param_sizes), dtype=kind.param_dtype, device=device)
            grads = torch.zeros(sum(grad_sizes), dtype=kind.grad_dtype, device=device)
            self.param_buffers[kind], self.grad_buffers[kind] = params, grads
            for bucket, p_views, g_views in zip(buckets, params.split(param_sizes), grads.split(grad_sizes)):
                bucket.attach_storage(p_views, g_views, values=init_flat_values)
                for param in bucket.params:
                    param.__dict__.pop("unmaterialized_shape", None)

    # ----------------------------------------------------------------------------------------------------------
    # forward and attribute access
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    # ----------------------------------------------------------------------------------------------------------
    # gradient synchronization
    def _may_launch(self, bucket: Bucket) -> bool:
        """Sharded grads are reduce-scattered after every backward; full grads not inside ``no_sync()``."""
        return self._sync_enabled or bucket.kind.shard_grads

    def _queue_backward_end(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        if param.grad is None:  # no grad arrived (a weight gradient the zero-bubble B pass deferred to its W)
            return
        bucket = self._param_to_bucket[param]
        self._queue_backward_end()
        if bucket.launched:
            if not bucket.kind.shard_grads:
                raise RuntimeError(
                    f"a grad arrived for bucket {bucket.index}, already reduced in this step: wrap all but the "
                    "last micro-batch's backward in no_sync(), or call finish_grad_sync() and zero_grad_buffer() "
                    "between steps")
            self._retire(bucket)
        if bucket.kind.shard_grads and bucket.grad_data is None:
            # a new transient bucket. Stage 2: the newest reduction stays in flight while this bucket fills
            # (two full-size buckets, as DeepSpeed's overlap_comm double buffer); stage 3: the reductions in
            # flight had this unit's backward to overlap with, and finishing them keeps one full-size bucket
            keep = 1 if self.config.zero_stage == 2 else 0
            for older in list(self._in_flight[:len(self._in_flight) - keep]):
                self._retire(older)
        if bucket.add_grad(param):
            if self.gatherer is not None:
                self.gatherer.on_bucket_grads_done(bucket)
            # stages 2-3 launch from the hooks even without overlap_grad_reduce: deferred to the backward's
            # end, every transient bucket would exist at once (the whole model's grads in fp32)
            if self.config.overlap_grad_reduce or self.config.zero_stage >= 2:
                self._launch_in_order(force=False)
        if self.config.zero_stage == 3:
            self._retire_completed()  # (stage 2 frees its buckets at fixed points: a predictable peak)

    def _retire(self, bucket: Bucket) -> None:
        """Waits for ``bucket``'s reduce-scatter; its transient full-size grads are freed."""
        bucket.wait_grad_sync()
        if bucket in self._in_flight:
            self._in_flight.remove(bucket)

    def _retire_completed(self) -> None:
        """Frees the transient buckets whose reduce-scatter has completed (keeps the launch order)."""
        while self._in_flight and (self._in_flight[0]._grad_work is None
                                   or self._in_flight[0]._grad_work.is_completed()):
            self._retire(self._in_flight[0])

    def _scale(self, bucket: Bucket) -> float:
        """1/dp for every bucket; under ``ReduceOp.AVG`` (which divides by the bucket's group size) expert
        buckets need ``expert_dp / dp`` on top."""
        if bucket.kind.expert and self.config.average_in_collective:
            return bucket.dp_size * bucket.replica_size / self.dp_size
        return self._grad_scale

    def _launch(self, bucket: Bucket) -> None:
        if bucket.kind.shard_grads:  # one reduce-scatter in flight: the older ones finish first (bounds memory:
            for older in list(self._in_flight):  # their receive buffers go before this one's exist)
                self._retire(older)
        bucket.launch_grad_sync(scale=self._scale(bucket), op=self._reduce_op)
        self.launch_log.append(bucket.index)
        if bucket.kind.shard_grads:
            self._in_flight.append(bucket)

    def _launch_in_order(self, *, force: bool) -> None:
        """Launches buckets from the next unlaunched one while they are ready (all, with ``force``; buckets
        that received no grad at all are skipped, the same on every rank)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            may_launch = self._may_launch(bucket)
            if may_launch and not (bucket.ready or force):
                return
            if may_launch and bucket.dirty and not bucket.launched:
                self._launch(bucket)
            self._next_launch += 1

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self._launch_in_order(force=True)
        self._next_launch = 0
        for bucket in list(self._in_flight):  # no full-size grads outlive the backward
            self._retire(bucket)
        for bucket in self.buckets:
            if not bucket.launched:
                bucket.reset_pending()
        if self.gatherer is not None:
            self.gatherer.on_backward_end()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: grads of backward passes inside are only accumulated (stages 0-1)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Launches the collective of every bucket holding unreduced grads (in bucket order)."""
        for bucket in self.buckets:
            if bucket.dirty and not bucket.launched:
                self._launch(bucket)

    def finish_grad_sync(self) -> None:
        """Launches what is left and waits for every bucket's collective. Afterwards each rank holds the
        dp-summed (x 1/dp) grads: full ``main_grad`` (stages 0-1), or its 1/dp shard (stages 2-3)."""
        self.start_grad_sync()
        for bucket in self.buckets:  # (all reduce-scatters first, then the all-reduces across instances)
            bucket.start_replica_reduce()
        for bucket in self.buckets:
            bucket.wait_grad_sync()
            bucket.fill_unwritten()  # a bucket (or its shard) no grad reached this step
            bucket.fill_unwritten_shard()
        self._in_flight, self._next_launch = [], 0

    def zero_grad_buffer(self) -> None:
        """Zeros every grad buffer and shard (call once per step, before the first micro-batch)."""
        for bucket in self.buckets:
            bucket.wait_grad_sync()
            bucket.zero_grad()
        self._in_flight, self._next_launch, self.launch_log = [], 0, []
        for param in self.module.parameters():
            param.grad = None

    # ----------------------------------------------------------------------------------------------------------
    # parameters
    def start_param_sync(self) -> None:
        """Stages 1-2: starts the all-gather of the optimizer's updated shards into the full parameters, last
        bucket first (the next forward needs the first layers first). Stage 0 gathers nothing: every rank
        applied the same all-reduced grads to whole parameters."""
        if self.config.zero_stage == 0:
            return
        for bucket in reversed(self.buckets):
            bucket.start_param_sync()

    def finish_param_sync(self) -> None:
        """Waits for every parameter all-gather (with ``overlap_param_gather`` the forward waits per module)."""
        for bucket in self.buckets:
            bucket.wait_param_sync()

    def restore_exact_params(self) -> None:
        """``--fp8-param-gather``: gives the FP8-gathered weights their exact values on every rank again (a plain
        all-gather of each bucket holding dequantized ones (stage 3: still gathered), in bucket order)."""
        self.finish_param_sync()
        for bucket in self.buckets:
            if bucket.fp8_gather is not None:
                bucket.fp8_gather.restore_exact()

    def _install_param_sync_hooks(self) -> list:
        """Forward pre-hooks that wait, just before a module's first use, for the gather of its buckets."""
        if self.config.zero_stage not in (1, 2):
            return []
        handles = []
        for module in self.module.modules():
            buckets = list(dict.fromkeys(self._param_to_bucket[p] for p in module.parameters(recurse=False)
                                         if p in self._param_to_bucket))
            if buckets:
                def wait(_module, _args, buckets=buckets) -> None:
                    for bucket in buckets:
                        bucket.wait_param_sync()
                handles.append(module.register_forward_pre_hook(wait))
        return handles

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Every parameter full and exact inside the context (e.g. for export): stage 3 gathers them, stages 1-2
        restore FP8-gathered weights (``restore_exact_params``)."""
        self.restore_exact_params()
        for bucket in self.buckets:
            bucket.wait_gather()
        try:
            yield
        finally:
            if self.gatherer is not None:
                self.gatherer.release_all()

    def gathered_buckets(self) -> Iterator[list[nn.Parameter]]:
        """Yields the parameters of one bucket at a time, full while the caller holds them: at stage 3 each
        bucket is all-gathered (collective over its dp group, the same order on every rank) before and
        released after its turn, so at most one bucket's full parameters exist beyond the shards; at other
        stages the parameters are full already (exact: ``restore_exact_params``) and are yielded in one list. Then
        the parameters outside buckets (frozen ones), if any."""
        self.restore_exact_params()
        if self.config.zero_stage != 3:
            yield list(self.module.parameters())
            return
        for bucket in self.buckets:
            was_gathered = bucket.gathered
            bucket.wait_gather()
            try:
                yield list(bucket.params)
            finally:
                if not was_gathered:
                    bucket.release_params()
        rest = [p for p in self.module.parameters() if p not in self._param_to_bucket]
        if rest:
            yield rest

    # ----------------------------------------------------------------------------------------------------------
    # parameter offload (stage 3)
    def offload_param_shards(self, make_home: Callable[[Bucket], Any], *, tier: str) -> None:
        """Stage 3: moves each bucket's parameter shard to the home ``make_home(bucket)`` builds (host or NVMe;
        use ``megatron_core.optimizer.offload.offload_parameters``) and frees the device copy; shards come back
        for each gather and for the optimizer step. Call it before building the optimizer."""
        if self.config.zero_stage != 3:
            raise ValueError(f"parameter offload needs zero_stage 3, got {self.config.zero_stage}")
        for bucket in self.buckets:
            bucket.attach_home(make_home)
        self.param_buffers = {}  # each shard has storage of its own now (freed between uses)
        self.param_offload = tier

    def fetch_param_shards(self) -> None:
        """Brings every offloaded shard into device memory (the optimizer step updates them)."""
        for bucket in self.buckets:
            bucket.fetch_shard()

    def evict_param_shards(self) -> None:
        """Writes every offloaded shard home and frees its device copy."""
        for bucket in self.buckets:
            bucket.evict_shard(dirty=True)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (no ``module.`` prefix) with full tensors at every stage."""
        with self.gathered_parameters():
            state = self.module.state_dict(*args, **kwargs)
            if self.config.zero_stage == 3:
                state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        """Loads full tensors into the wrapped module (stage 3: each rank keeps its shard)."""
        if assign:
            raise ValueError("assign=True would replace the buffer views; load with assign=False")
        with self.gathered_parameters():
            result = self.module.load_state_dict(state_dict, strict=strict)
            if self.config.zero_stage == 3:
                for bucket in self.buckets:
                    for param in bucket.params:
                        bucket.load_full(param, param.data)
        return result


def _weak_grad_hook(ddp: "DistributedDataParallel") -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of ``ddp``'s parameters, holding ``ddp`` by weak reference: the hook lives
    in the parameter's C++ grad accumulator, where Python's garbage collector cannot see it, so a strong
    reference would keep the wrapper, its model, its buffers and its process groups alive forever."""
    ref = weakref.ref(ddp)

    def hook(param: torch.Tensor) -> None:
        wrapper = ref()
        if wrapper is not None:
            wrapper._on_grad_accumulated(param)
    return hook
