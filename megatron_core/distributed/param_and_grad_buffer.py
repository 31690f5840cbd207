"""Buckets: slices of the contiguous parameter and gradient buffers, with their data-parallel collectives.

A bucket holds a few parameters laid out one after another in a flat range of ``numel`` elements (padded to
a multiple of dp so that it splits evenly). Dp rank r owns the shard ``[r * numel/dp, (r+1) * numel/dp)``.

Storage, per rank (``numel`` elements of the bucket, ``shard = numel / dp``):

| stage | parameters                          | gradients                                                    |
| ----- | ----------------------------------- | ------------------------------------------------------------ |
| 0     | full ``[numel]`` (views)            | full ``[numel]``; all-reduced                                |
| 1     | full ``[numel]`` (views)            | full ``[numel]``; reduce-scattered, the shard is used        |
| 2     | full ``[numel]`` (views)            | ``[shard]``; a transient ``[numel]`` is reduce-scattered and freed |
| 3     | ``[shard]``; a transient ``[numel]`` all-gathered, freed | as stage 2                           |

Freeing is real: the transient full gradient bucket is dropped as soon as its reduce-scatter completes, and
the stage-3 gathered buffer releases its *storage* (``untyped_storage().resize_(0)``, as FSDP does), so the
views of it that autograd saved for backward (``weight.t()`` of ``F.linear``) hold no memory either; the
next gather resizes the same storage and fills it again, so those saved views see the parameters again.

Parameters tagged ``sequence_parallel`` or ``shared_embedding`` keep full gradients at every stage, because
``finalize_model_grads`` all-reduces their whole grad over tp or the embedding group.

Expert parameters (``is_expert``) live in buckets of their own kind whose group is the expert-data-parallel
group: each such bucket is reduced, and sharded, over the ranks that hold the same experts.

Partial distributed optimizer (Megatron's ``--num-distributed-optimizer-instances N``): ``dp_group`` is then this
rank's instance (``dp * cp / N`` ranks, the group the bucket is padded for and sharded over) and
``replica_group`` the N ranks at the same position of every instance. The reduce-scattered shard
(``[shard]``; a full-grad bucket's whole ``[numel]``) is then all-reduced over ``replica_group``, so every instance
holds the grads summed over all dp x cp ranks; the updated parameters are all-gathered within the instance only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.distributed.p2p_collectives import all_gather_p2p, reduce_scatter_p2p
from megatron_core.fp8.param_gather import drop_gathered
from megatron_core.tensor_parallel.initialization import logical_shape
from megatron_core.tensor_parallel.utils import group_rank, group_size


@dataclasses.dataclass(frozen=True)
class BucketKind:
    """What a bucket stores: parameter dtype, gradient dtype, whether only the grad shard is kept, and whether
    the grads are reduce-scattered (ZeRO 1-3) rather than all-reduced."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    shard_grads: bool
    reduce_scatter: bool = False
    expert: bool = False
    """Expert parameters (MoE): reduced and sharded over the expert-data-parallel group instead of dp."""


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def free_storage(tensor: torch.Tensor) -> None:
    """Releases the memory behind ``tensor`` and every view of it (the tensor keeps its shape)."""
    if tensor.untyped_storage().nbytes() > 0:
        tensor.untyped_storage().resize_(0)


def allocate_storage(tensor: torch.Tensor) -> None:
    """Gives a tensor freed by ``free_storage`` its memory back (contents undefined)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() != nbytes:
        tensor.untyped_storage().resize_(nbytes)


class Bucket:
    """The parameters of one bucket and their storage; launches the bucket's collectives.

    Args:
        index: position in the launch order (the same on every dp rank).
        kind: dtypes and grad sharding.
        params: the bucket's parameters, laid out in this order.
        dp_group: the data-parallel group (None: one rank).
        shard_params: ZeRO-3: keep only this rank's shard of the parameters.
        device: where the storage lives (default: the device of the first parameter).
        replica_group: the partial distributed optimizer's inter-instance group (None: one instance); the
            reduced grads of this rank's shard are all-reduced over it (module docstring).
    """

    def __init__(self, *, index: int, kind: BucketKind, params: list[nn.Parameter], dp_group,
                 shard_params: bool, device: Optional[torch.device] = None,
                 p2p_collectives: bool = False, replica_group=None) -> None:
        self.index, self.kind, self.params, self.dp_group = index, kind, list(params), dp_group
        self.dp_size, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.replica_group, self.replica_size = replica_group, group_size(replica_group)
        self._replica_work, self._op = None, dist.ReduceOp.SUM
        self.shard_params, self.reduce_scatter = shard_params, kind.reduce_scatter or kind.shard_grads
        self.p2p_collectives = p2p_collectives  # reduce-scatters and all-gathers as isend/irecv batches
        self.device = device if device is not None else self.params[0].device
        self.shapes = {p: logical_shape(p) for p in self.params}
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        offset = 0
        for param in self.params:
            self.ranges[param] = (offset, offset + self.shapes[param].numel())
            offset += self.shapes[param].numel()
        self._param_numel = offset
        self.numel = -(-offset // self.dp_size) * self.dp_size
        self.shard_size = self.numel // self.dp_size
        self.shard_lo = self.dp_rank * self.shard_size
        self.param_data: Optional[torch.Tensor] = None   # [numel]: the buffer view (stages 0-2), or the
        #                                                  gathered buffer, storage freed when released (stage 3)
        self.param_shard: Optional[torch.Tensor] = None  # [shard]: a view of param_data, or own storage (stage 3)
        self.grad_data: Optional[torch.Tensor] = None    # [numel]: buffer view, or transient (sharded grads)
        self.grad_shard: Optional[torch.Tensor] = None   # [shard]
        self._pending = set(self.params)
        self._unwritten: set[nn.Parameter] = set()  # params whose grad slot holds no value since the last zero:
        #                                             their first grad is copied in, not added to zeros
        self._shard_fresh = False  # sharded grads: the shard holds no value since the last zero (first copy)
        self.dirty = False      # grads were added since the last launch
        self.launched = False
        self.gathered = not shard_params  # stage 3: the full parameters are in param_data
        self._grad_work = self._recv = self._param_work = self._gather_work = None
        self.shard_home: Optional[Any] = None  # ZeRO-3 parameter offload: where the shard lives between uses
        self._fetched_for_gather = False
        self.fp8_gather = None  # --fp8-param-gather: an Fp8ParamGather, stage 3 an Fp8ShardGather (fp8_param_gather.py)
        self.shard_generation = 0  # bumped whenever the shard may have changed (optimizer step, load_full)

    @property
    def param_bytes(self) -> int:
        """Bytes of the full (gathered) parameters of this bucket."""
        return self.numel * self.kind.param_dtype.itemsize

    # ----------------------------------------------------------------------------------------------------------
    # storage
    def attach_storage(self, param_storage: torch.Tensor, grad_storage: torch.Tensor, *,
                       values: Optional[Callable[[nn.Parameter, int, int], torch.Tensor]] = None) -> None:
        """Moves the parameters into ``param_storage`` (``[numel]``, or ``[shard]`` at stage 3) and points
        ``main_grad`` into ``grad_storage`` (``[numel]``, or ``[shard]`` for sharded grads).

        ``values(param, lo, hi)`` (stage 3) returns the flat elements ``[lo, hi)`` of a parameter's initial
        value, for parameters never materialized (meta device); by default they are read from the parameter.
        At stage 3 only this rank's shard is ever written: no full-size buffer is allocated here.
        """
        shard = slice(self.shard_lo, self.shard_lo + self.shard_size)
        if self.shard_params:
            values = values or (lambda param, lo, hi: param.data.reshape(-1)[lo:hi])
            param_storage.zero_()
            for param, p_lo, p_hi, s_lo, s_hi in self.shard_pieces():
                param_storage[s_lo:s_hi].copy_(values(param, p_lo, p_hi))
            self.param_shard = param_storage  # param_data is allocated by the first gather
            self.gathered = True
            self.release_params()
        else:
            param_storage.copy_(self._flat_params())
            self.param_data, self.param_shard = param_storage, param_storage[shard]
            self._point_params_at(param_storage)
        if self.kind.shard_grads:
            self.grad_shard = grad_storage
            for param in self.params:
                param.main_grad = None
        else:
            self.grad_data, self.grad_shard = grad_storage, grad_storage[shard]
            self._point_main_grads_at(grad_storage)

    def _flat_params(self) -> torch.Tensor:
        flat = torch.zeros(self.numel, dtype=self.kind.param_dtype, device=self.device)
        for param, (lo, hi) in self.ranges.items():
            flat[lo:hi].copy_(param.data.reshape(-1))
        return flat

    def _point_params_at(self, data: torch.Tensor) -> None:
        for param, (lo, hi) in self.ranges.items():
            param.data = data[lo:hi].view(self.shapes[param])

    def _point_main_grads_at(self, data: torch.Tensor) -> None:
        for param, (lo, hi) in self.ranges.items():
            param.main_grad = data[lo:hi].view(self.shapes[param])

    def shard_pieces(self, rank: Optional[int] = None) -> Iterator[tuple[nn.Parameter, int, int, int, int]]:
        """``(param, param_lo, param_hi, shard_lo, shard_hi)`` for each parameter overlapping the shard of dp
        ``rank`` (default: this rank's): flat element ranges inside the parameter and inside the shard."""
        start = self.shard_lo if rank is None else rank * self.shard_size
        for param, (lo, hi) in self.ranges.items():
            a, b = max(lo, start), min(hi, start + self.shard_size)
            if a < b:
                yield param, a - lo, b - lo, a - start, b - start

    # ----------------------------------------------------------------------------------------------------------
    # gradients
    def add_grad(self, param: nn.Parameter) -> bool:
        """Adds ``param.grad`` into the bucket (then frees it); True when every param of the bucket is in.
        The first grad of a param since the last zero is copied in: the buffer is zeroed lazily (a memset
        and a read of the zeros saved per step), see ``fill_unwritten``."""
        if self.grad_data is None:  # sharded grads: the transient full bucket
            self.grad_data = torch.empty(self.numel, dtype=self.kind.grad_dtype, device=self.device)
            self.grad_data[self._param_numel:].zero_()  # the padding
            self._point_main_grads_at(self.grad_data)
            self._unwritten = set(self.params)
        if param in self._unwritten:
            param.main_grad.copy_(param.grad)
            self._unwritten.discard(param)
        else:
            param.main_grad.add_(param.grad)
        param.grad = None
        self.dirty = True
        self._pending.discard(param)
        return not self._pending

    @property
    def ready(self) -> bool:
        return not self._pending

    @property
    def holds_transient_grads(self) -> bool:
        """A full-size gradient bucket exists that only lives until its reduce-scatter completes."""
        return self.kind.shard_grads and self.grad_data is not None

    def reset_pending(self) -> None:
        self._pending = set(self.params)

    def fill_unwritten(self) -> None:
        """Zeros the grad slots no grad was written to since the last zero (before anything reads them)."""
        for param in self._unwritten:
            param.main_grad.zero_()
        self._unwritten = set()

    def fill_unwritten_shard(self) -> None:
        """Sharded grads: zeros the shard if no reduction reached it since the last zero."""
        if self._shard_fresh:
            self.grad_shard.zero_()
            self._shard_fresh = False

    def launch_grad_sync(self, *, scale: float, op) -> None:
        """Starts the asynchronous all-reduce (ZeRO-0) or reduce-scatter (ZeRO 1-3) of the grads over dp."""
        assert not self.launched, f"bucket {self.index} launched twice"
        if self.grad_data is None:
            self.grad_data = torch.zeros(self.numel, dtype=self.kind.grad_dtype, device=self.device)
        self.fill_unwritten()
        if scale != 1.0:
            self.grad_data.mul_(scale)
        self._op = op
        if self.reduce_scatter:
            # this rank's shard of the bucket, reduced in place (a view, read once the work completes): no
            # receive buffer beside the bucket, as Megatron-LM's reduce-scatter into its shard of grad_data
            # (NCCL's in-place form: output == input + rank * count; gloo's gives the same sums)
            self._recv = self.grad_data[self.shard_lo:self.shard_lo + self.shard_size]
            if self.dp_size > 1 and self.p2p_collectives:
                self._grad_work = reduce_scatter_p2p(self.grad_data, self.dp_group)
            elif self.dp_size > 1:
                self._grad_work = dist.reduce_scatter_single(self._recv, self.grad_data, op=op,
                                                             group=self.dp_group, async_op=True)
        elif self.dp_size > 1:
            self._grad_work = dist.all_reduce(self.grad_data, op=op, group=self.dp_group, async_op=True)
        self.launched, self.dirty = True, False

    def start_replica_reduce(self) -> None:
        """Partial distributed optimizer: waits for this bucket's collective over the instance, then starts the
        asynchronous all-reduce of its result (the shard, or a full-grad bucket's whole grads) over the
        inter-instance group. A no-op with one instance, before the launch, or once started."""
        if not self.launched or self.replica_size == 1 or self._replica_work is not None:
            return
        if self._grad_work is not None:
            self._grad_work.wait()
            self._grad_work = None
        reduced = self.grad_data if self._recv is None else self._recv
        self._replica_work = dist.all_reduce(reduced, op=self._op, group=self.replica_group, async_op=True)

    def wait_grad_sync(self) -> None:
        """Waits for the launched collective (and the all-reduce across optimizer instances). Reduce-scattered
        grads land in the shard: added to it (sharded grads, accumulating over micro-batches; the transient full
        bucket is freed) or written into it."""
        if not self.launched:
            return
        if self._grad_work is not None:
            self._grad_work.wait()
            self._grad_work = None
        self.start_replica_reduce()
        if self._replica_work is not None:
            self._replica_work.wait()
            self._replica_work = None
        if self.kind.shard_grads:
            if self._shard_fresh:  # the first reduction since zero_grad: copied, not added to zeros
                self.grad_shard.copy_(self._recv)
                self._shard_fresh = False
            else:
                self.grad_shard.add_(self._recv)
            self.grad_data, self._unwritten = None, set()
            for param in self.params:
                param.main_grad = None
        elif self.reduce_scatter and not _same_memory(self._recv, self.grad_shard):
            self.grad_shard.copy_(self._recv)  # (reduced in place, the shard is there already)
        self._grad_work, self._recv, self.launched = None, None, False
        self.reset_pending()

    def zero_grad(self) -> None:
        assert not self.launched, f"bucket {self.index}: zero_grad while its collective is in flight"
        if self.kind.shard_grads:  # the shard is zeroed lazily too: the first reduction is copied in
            self._shard_fresh = True
            self.grad_data, self._unwritten = None, set()
            for param in self.params:
                param.main_grad = None
        else:  # zeroed lazily: the first grad of each param is copied in (the padding stays zero)
            self._unwritten = set(self.params)
        for param in self.params:
            param.grad = None
        self.dirty = False
        self.reset_pending()

    # ----------------------------------------------------------------------------------------------------------
    # parameters, stages 1-2: the updated shards are all-gathered after the optimizer step
    def start_param_sync(self) -> None:
        """After each optimizer step (every stage: bumps ``shard_generation``). Stages 1-2: all-gathers the updated
        shards into the full parameters (asynchronous); the FP8 weights as FP8 bytes with ``fp8_gather``."""
        self.shard_generation += 1
        if self.shard_params or self.dp_size == 1:
            return
        self.wait_param_sync()
        work = self.fp8_gather.start() if self.fp8_gather is not None else None
        self._param_work = work or self._all_gather(None)  # the shard is a view of its slot: in place

    def wait_param_sync(self) -> None:
        if self._param_work is not None:
            self._param_work.wait()
            self._param_work = None

    @property
    def param_sync_pending(self) -> bool:
        return self._param_work is not None

    # ----------------------------------------------------------------------------------------------------------
    # parameters, stage 3: gathered on demand into param_data, whose storage is freed when released
    @property
    def gather_in_flight(self) -> bool:
        return self._gather_work is not None

    def start_gather(self, fp8: bool = False) -> None:
        """Stage 3: starts the all-gather of the full parameters (a no-op if gathered or in flight); ``fp8``: the
        FP8 weights as FP8 bytes (``--fp8-param-gather``, the units' gathers: ``Fp8ShardGather``)."""
        if self.gathered or self._gather_work is not None:
            return
        if self.param_data is None:
            self.param_data = torch.empty(self.numel, dtype=self.kind.param_dtype, device=self.device)
        else:
            allocate_storage(self.param_data)
        self._fetched_for_gather = self.fetch_shard()
        if self.dp_size == 1:
            self.param_data.copy_(self.param_shard)
            self._gather_work = _Done()
            self._evict_after_gather()
        else:
            work = self.fp8_gather.start_gather(fp8) if self.fp8_gather is not None else None
            self._gather_work = work or self._all_gather(self.param_shard)

    def _all_gather(self, shard: Optional[torch.Tensor]):
        """Starts the gather of every rank's parameter shard into ``param_data``; ``shard`` None: this rank's
        is in its slot already."""
        if self.p2p_collectives:
            return all_gather_p2p(self.param_data, shard, self.dp_group)
        source = self.param_data[self.shard_lo:self.shard_lo + self.shard_size] if shard is None else shard
        return dist.all_gather_single(self.param_data, source, group=self.dp_group, async_op=True)

    def wait_gather(self, fp8: bool = False) -> None:
        """Stage 3: makes every ``param.data`` a view of the gathered full parameters: exact values unless
        ``fp8`` (a unit's gather; FP8-gathered weights hold dequantized values on the other ranks' slots)."""
        if not self.gathered:
            self.start_gather(fp8)
            self._gather_work.wait()
            self._gather_work, self.gathered = None, True
            self._evict_after_gather()
            self._point_params_at(self.param_data)
        if not fp8 and self.fp8_gather is not None:
            self.fp8_gather.restore_exact()

    def release_params(self) -> None:
        """Stage 3: frees the full parameters (their storage; each ``param.data`` becomes an empty tensor)."""
        if not self.shard_params:
            return
        if self._gather_work is not None:  # a prefetch nobody used: finish it to keep the collectives paired
            self._gather_work.wait()
            self._gather_work = None
            self._evict_after_gather()
        if self.param_data is not None:
            free_storage(self.param_data)
        for param in self.params:
            if param.numel():
                param.data = _empty(self.kind.param_dtype, self.device)
        self.gathered = False

    def shape_params(self) -> None:
        """Stage 3, not gathered: gives every parameter its shape without memory (a broadcast scalar), for a
        backward that reads no parameter values but whose grad accumulation checks the parameter's shape."""
        if self.shard_params and not self.gathered:
            scalar = torch.zeros((), dtype=self.kind.param_dtype, device=self.device)
            for param in self.params:
                param.data = scalar.expand(self.shapes[param])

    def load_full(self, param: nn.Parameter, full: torch.Tensor) -> None:
        """Stage 3: writes this rank's shard of ``full`` (the whole parameter) into the shard storage."""
        lo, hi = self.ranges[param]
        flat = full.reshape(-1).to(self.kind.param_dtype)
        fetched = self.fetch_shard()
        for piece_param, p_lo, p_hi, s_lo, s_hi in self.shard_pieces():
            if piece_param is param:
                self.param_shard[s_lo:s_hi].copy_(flat[p_lo:p_hi])
        if fetched:
            self.evict_shard(dirty=True)
        self.shard_generation += 1
        if self.gathered:
            self.param_data[lo:hi].copy_(flat)
            drop_gathered(param)  # a scale of the FP8 gather no longer fits the new values


    # ----------------------------------------------------------------------------------------------------------
    # parameter offload (stage 3): the shard's home is the host or a file; the device copy exists while used
    def attach_home(self, make_home: Callable[["Bucket"], Any]) -> None:
        """Gives the shard storage of its own, hands it to ``make_home(self)`` (an object with ``load_into``
        and ``store_from``, see ``optimizer.offload.param_offload``) and frees the device copy."""
        self.param_shard = self.param_shard.clone()
        self.shard_home = make_home(self)
        free_storage(self.param_shard)

    def fetch_shard(self) -> bool:
        """Brings an offloaded shard into device memory; True if it was not there."""
        if self.shard_home is None or self.param_shard.untyped_storage().nbytes() > 0:
            return False
        allocate_storage(self.param_shard)
        self.shard_home.load_into(self.param_shard)
        return True

    def evict_shard(self, *, dirty: bool) -> None:
        """Frees the device copy of an offloaded shard, first writing it home when ``dirty`` (updated)."""
        if self.shard_home is None or self.param_shard.untyped_storage().nbytes() == 0:
            return
        if dirty:
            self.shard_home.store_from(self.param_shard)
        free_storage(self.param_shard)

    def _evict_after_gather(self) -> None:
        if self._fetched_for_gather:  # fetched just for this gather (unchanged): free it again
            self._fetched_for_gather = False
            self.evict_shard(dirty=False)


class _Done:
    """A finished piece of work (a dp of one needs no collective)."""

    def wait(self) -> bool:
        return True


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors start at the same place of the same storage (without ``data_ptr``, which fake
    tensors of a dry run do not have)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()
