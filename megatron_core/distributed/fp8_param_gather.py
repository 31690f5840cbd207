"""``--fp8-param-gather``: a bucket's parameters are all-gathered with the FP8 weights as 1-byte E4M3 values
instead of their 2-byte (bf16) or 4-byte (fp32) values: at ZeRO stages 1-2 the updated shards after the
optimizer step (``Fp8ParamGather``), at stage 3 each unit's shards before its forward and backward
(``Fp8ShardGather``).

The bucket layout (which parameter lies where, each rank's shard) is the one without the flag, so the
optimizer's pieces, the grad norm and the checkpoints are unchanged. A gather (every dp rank, same order):

1. chooses the bucket's FP8 weights whose scale is known now (stages 1-2: ``Fp8GatherSpec.usable_now``,
   tensorwise always, delayed once calibrated and after ``update_fp8_scales``; stage 3: ``calibrated``, see
   ``Fp8ShardGather``); none: the bucket is gathered as before;
2. takes the amax of this rank's piece of each (0 for none; blockwise: one per 128x128 block of the weight,
   0 for the blocks the piece misses, ``Fp8GatherSpec.piece_amax``: a flat shard cuts through blocks),
   all-reduces the flat fp32 vector with MAX over the bucket's dp group and then over each weight's tp
   ``amax_group``: every rank holds the amax of the whole weight (of each block), the value the layer would
   compute (tensorwise / blockwise scales; delayed: the amax it records). Routed experts' weights live in
   the expert buckets: their dp group is expert-dp, their ``amax_group`` the etp group when split;
3. quantizes its pieces with the weight's scale (``cast(x * scale)``, elementwise, blockwise with each
   element's block scale: the bytes the layer would produce from the whole weight) and packs its message: the
   other parameters' raw bytes, then the FP8 bytes;
4. sends it to every other rank: a batch of ``isend``/``irecv`` with ``p2p_collectives`` (each rank's
   message of its own size), else ``all_gather_single`` of messages padded to the largest.

The work's finish writes the received values: raw ones as they are, FP8 ones dequantized (``q * scale_inv``,
cast to the parameter dtype) into the parameter's slots of the other ranks' shards, and leaves the weight's
scale and global amax on it (``fp8.param_gather.keep_gathered``). This rank's shard keeps its exact values
(the optimizer's). The FP8 linear quantizes the weight with that scale: bit for bit the gathered bytes
(``fp8.param_gather``: a dequantized value quantizes back to itself), which are what it would have quantized
without the flag. No FP8 copy is kept: no memory beyond the run without the flag. Readers of the parameter
values outside the FP8 GEMMs get exact values through ``restore_exact`` (a plain all-gather of the bucket),
which ``DistributedDataParallel``'s ``gathered_parameters`` / ``gathered_buckets`` / ``state_dict`` run
first (stage 3: every gather but a unit's is plain, ``Bucket.wait_gather``): checkpoints are exact.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.distributed.p2p_collectives import PARAM_GATHER_TAG, P2PWork
from megatron_core.fp8.param_gather import Fp8GatherSpec, drop_gathered, gather_spec, keep_gathered
from megatron_core.fp8.quantize import cast_to_fp8

Piece = tuple[nn.Parameter, int, int]  # (param, bucket_lo, bucket_hi)
ALIGN = 16  # bytes: padded message size of the all_gather_single path


class Fp8ParamGather:
    """The FP8 gather of one stage 1-2 bucket (module docstring); ``specs``: its tagged weights."""

    def __init__(self, bucket, specs: dict[nn.Parameter, Fp8GatherSpec]) -> None:
        self.bucket, self.specs = bucket, specs
        self.holds_dequantized = False  # other ranks' slots of some weights hold dequantized FP8 values
        self.dtype = bucket.kind.param_dtype
        self.pieces = [self._rank_pieces(rank) for rank in range(bucket.dp_size)]

    def _rank_pieces(self, rank: int) -> list[Piece]:
        """The parameter pieces of ``rank``'s shard (bucket padding excluded), in bucket order."""
        start = rank * self.bucket.shard_size
        return [(p, start + lo, start + hi) for p, _, _, lo, hi in self.bucket.shard_pieces(rank)]

    def _message_size(self, rank: int, chosen: dict) -> int:
        """Bytes of ``rank``'s message: 1 per FP8 element, the parameter dtype's size per other element."""
        return sum((hi - lo) * (1 if p in chosen else self.dtype.itemsize) for p, lo, hi in self.pieces[rank])

    def _own(self, lo: int, hi: int) -> torch.Tensor:
        """This rank's exact values of the bucket's elements ``[lo, hi)`` (inside its shard)."""
        return self.bucket.param_data[lo:hi]

    def _drop(self) -> None:
        """Forgets the weights' gathered scales (their values are about to change)."""
        for param in self.specs:
            drop_gathered(param)

    def _choose(self) -> dict[nn.Parameter, slice]:
        """Forgets the weights' gathered scales; the weights to gather in FP8 now and their amaxes' place in the
        flat amax vector (``_layout``)."""
        self._drop()
        return self._layout([p for p, spec in self.specs.items() if self._usable(spec)])

    def _layout(self, params) -> dict[nn.Parameter, slice]:
        """Each weight's slice of the flat fp32 amax vector, in bucket order: one amax per tensor, one per
        128x128 block for blockwise (``Fp8GatherSpec.amax_numel``)."""
        layout, at = {}, 0
        for param in params:
            n = self.specs[param].amax_numel()
            layout[param], at = slice(at, at + n), at + n
        return layout

    def _start(self, param: nn.Parameter, lo: int) -> int:
        """The flat element of ``param`` at bucket element ``lo``."""
        return lo - self.bucket.ranges[param][0]

    def _usable(self, spec: Fp8GatherSpec) -> bool:
        """Whether the weight's scale for its next use is known now."""
        return spec.usable_now()

    def start(self) -> Optional[P2PWork]:
        """Steps 1-4 of the module docstring; None when no weight of the bucket can go in FP8. Collectives:
        all-reduce (MAX) of the amaxes over dp and the tp amax groups; the message exchange over dp
        (asynchronous: ``wait()`` the returned work)."""
        chosen = self._choose()
        if not chosen:
            return None
        amax = self._global_amax(chosen)
        return self._launch(chosen, {p: amax[where] for p, where in chosen.items()})

    def _launch(self, chosen: dict, amax: dict[nn.Parameter, torch.Tensor]) -> P2PWork:
        """Steps 3-4 for the ``chosen`` weights of global amaxes ``amax`` (each ``[amax_numel]``): packs and starts
        the exchange; the returned work's finish unpacks and leaves each weight's scale on it."""
        scales = {p: self.specs[p].scale(amax[p]).float() for p in chosen}
        me = self.bucket.dp_rank
        message = self._pack(chosen, scales)
        sizes = [self._message_size(rank, chosen) for rank in range(self.bucket.dp_size)]
        works, received = self._exchange(message, sizes)

        def finish() -> None:
            for rank, data in received.items():
                if rank != me:
                    self._unpack(rank, data, chosen, scales)
            for param in chosen:
                spec = self.specs[param]
                keep_gathered(param, scales[param], amax[param].reshape(spec.blocks), spec)
            self.holds_dequantized = True
        return P2PWork(works, finish)

    def _global_amax(self, chosen: dict) -> torch.Tensor:
        """The flat fp32 amax vector of ``chosen`` (``_layout``): each weight's amax (blockwise: each block's) over
        the whole (tp-local) weight. Collectives: all-reduce MAX over dp, then over each tp ``amax_group``."""
        size = max((where.stop for where in chosen.values()), default=0)
        amax = torch.zeros(size, dtype=torch.float32, device=self.bucket.device)
        for param, lo, hi in self.pieces[self.bucket.dp_rank]:
            if param in chosen:
                amax[chosen[param]] = self.specs[param].piece_amax(self._own(lo, hi), self._start(param, lo))
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.bucket.dp_group)
        groups = {}
        for param, where in chosen.items():
            group = self.specs[param].amax_group
            if group is not None:
                groups.setdefault(id(group), (group, []))[1].extend(range(where.start, where.stop))
        for group, indices in groups.values():  # (insertion order: the bucket's, the same on every rank)
            index = torch.tensor(indices, device=amax.device)
            part = amax[index]
            dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
            amax[index] = part
        return amax

    def _pack(self, chosen: dict, scales: dict) -> torch.Tensor:
        """This rank's message (uint8): raw bytes of its other pieces, then its FP8 pieces."""
        raw, fp8 = [], []
        for param, lo, hi in self.pieces[self.bucket.dp_rank]:
            values = self._own(lo, hi)
            if param in chosen:
                scale = self.specs[param].piece_scale(scales[param], self._start(param, lo), hi - lo)
                q = cast_to_fp8(values.float() * scale, self.specs[param].fmt)
                fp8.append(q.view(torch.uint8))
            else:
                raw.append(values.view(torch.uint8))
        empty = torch.empty(0, dtype=torch.uint8, device=self.bucket.device)
        return torch.cat(raw + fp8) if raw or fp8 else empty
    def _exchange(self, message: torch.Tensor, sizes: list[int]) -> tuple[list, dict[int, torch.Tensor]]:
        """Starts sending ``message`` to every other dp rank and receiving theirs (``sizes[r]`` bytes each)."""
        bucket = self.bucket
        ranks, me, n = dist.get_process_group_ranks(bucket.dp_group), bucket.dp_rank, bucket.dp_size
        if bucket.p2p_collectives:
            works, received = [], {}
            for step in range(1, n):  # the pairing order of all_gather_p2p
                to, frm = (me + step) % n, (me - step) % n
                works.append(dist.isend(message, ranks[to], group=bucket.dp_group, tag=PARAM_GATHER_TAG))
                received[frm] = torch.empty(sizes[frm], dtype=torch.uint8, device=bucket.device)
                works.append(dist.irecv(received[frm], ranks[frm], group=bucket.dp_group, tag=PARAM_GATHER_TAG))
            return works, received
        slot = -(-max(sizes) // ALIGN) * ALIGN
        padded = torch.zeros(slot, dtype=torch.uint8, device=bucket.device)
        padded[:message.numel()].copy_(message)
        out = torch.empty(n * slot, dtype=torch.uint8, device=bucket.device)
        work = dist.all_gather_single(out, padded, group=bucket.dp_group, async_op=True)
        return [work], {rank: out[rank * slot:rank * slot + sizes[rank]] for rank in range(n)}

    def _unpack(self, rank: int, data: torch.Tensor, chosen: dict, scales: dict) -> None:
        """Writes ``rank``'s message into the bucket (the FP8 values dequantized)."""
        param_data, size = self.bucket.param_data, self.dtype.itemsize
        raw_bytes = sum((hi - lo) * size for p, lo, hi in self.pieces[rank] if p not in chosen)
        raw_at, fp8_at = 0, raw_bytes
        for param, lo, hi in self.pieces[rank]:
            n = hi - lo
            if param in chosen:
                q = data[fp8_at:fp8_at + n].view(self.specs[param].fmt.dtype)
                scale = self.specs[param].piece_scale(scales[param], self._start(param, lo), n)
                param_data[lo:hi].copy_(q.float() * torch.reciprocal(scale))
                fp8_at += n
            else:
                param_data[lo:hi].copy_(data[raw_at:raw_at + n * size].view(self.dtype))
                raw_at += n * size

    def restore_exact(self) -> None:
        """Replaces the dequantized values by the exact ones: the plain all-gather of the bucket (blocking).
        The gathered scales stay valid (the exact values quantize to the same bytes with them)."""
        if self.holds_dequantized:
            self.bucket.wait_param_sync()
            self.bucket._all_gather(None).wait()
            self.holds_dequantized = False


class Fp8ShardGather(Fp8ParamGather):
    """The FP8 gather of one ZeRO-3 bucket, run by the units' gathers (``Bucket.start_gather(fp8=True)``, from
    ``zero3.ParameterGatherer``) before each forward and backward; every other gather of the bucket (export,
    checkpoints, ``GatheredParameters``) is plain and exact.

    Which weights: the calibrated ones (``Fp8GatherSpec.calibrated``). Delayed scaling's scale changes only in
    ``update_fp8_scales``, once per step after the last backward, when no unit is gathered: every gather of a
    step (each micro-batch's forward, its backward, a recompute) uses the scale the layer uses in that step,
    so a micro-batch's forward and backward see the same one, as without the flag.

    Amaxes: the shard changes only in the optimizer step (``Bucket.start_param_sync`` follows it) or
    ``Bucket.load_full``; both bump ``bucket.shard_generation`` on every rank. The global amax of every tagged
    weight is all-reduced at the bucket's first FP8 gather after such a change and reused by the later ones:
    one small all-reduce per bucket and step, not one per gather. An in-place write of the shard outside those
    two is detected (its version counter, shards not offloaded) and refused."""

    def __init__(self, bucket, specs: dict[nn.Parameter, Fp8GatherSpec]) -> None:
        super().__init__(bucket, specs)
        self.numbered = self._layout(specs)  # every tagged weight's amax slice, bucket order
        self.end = max(hi for _, hi in bucket.ranges.values())  # the bucket's padding starts here
        self._amax: Optional[torch.Tensor] = None  # flat fp32 global amaxes (numbered) of the shard generation
        self._amax_key: Optional[tuple[int, Optional[int]]] = None  # (shard generation, shard version or None)

    def _own(self, lo: int, hi: int) -> torch.Tensor:
        shard_lo = self.bucket.shard_lo
        return self.bucket.param_shard[lo - shard_lo:hi - shard_lo]

    def _usable(self, spec: Fp8GatherSpec) -> bool:
        return spec.calibrated()

    def start_gather(self, fp8: bool) -> Optional[P2PWork]:
        """Starts the gather of the bucket's shards into ``bucket.param_data`` (allocated, this rank's shard
        resident) with the chosen weights in FP8; None (the caller gathers plainly) when ``fp8`` is False or no
        weight can go in FP8. Collectives: the amax all-reduces (first FP8 gather of a shard generation), the
        message exchange over dp (asynchronous)."""
        self.holds_dequantized = False
        if not fp8:
            self._drop()
            return None
        chosen = self._choose()
        if not chosen:
            return None
        amax = self._shard_amax()
        bucket = self.bucket
        bucket.param_data[bucket.shard_lo:bucket.shard_lo + bucket.shard_size].copy_(bucket.param_shard)
        bucket.param_data[self.end:].zero_()  # the padding, as the plain gather leaves it
        return self._launch(chosen, {p: amax[self.numbered[p]] for p in chosen})

    def _shard_amax(self) -> torch.Tensor:
        """The flat fp32 global amaxes of every tagged weight (``numbered``), cached per shard generation."""
        bucket = self.bucket
        version = bucket.param_shard._version if bucket.shard_home is None else None
        if self._amax is not None and self._amax_key[0] == bucket.shard_generation:
            if version is not None and self._amax_key[1] != version:
                raise RuntimeError(
                    f"fp8_param_gather: the ZeRO-3 parameter shard of bucket {bucket.index} was written in place "
                    "outside the optimizer step and Bucket.load_full, so its cached FP8 weight amaxes are stale; "
                    "write parameters through load_state_dict / GatheredParameters(modifier_rank=...) or call "
                    "ddp.start_param_sync() on every rank after writing the shards")
            return self._amax
        self._amax = self._global_amax(self.numbered)
        self._amax_key = (bucket.shard_generation, version)
        return self._amax

    def restore_exact(self) -> None:
        """Gathered with dequantized values: replaces them by the exact ones (a plain all-gather of the shards,
        blocking). A no-op when released or gathered plainly."""
        bucket = self.bucket
        if self.holds_dequantized and bucket.gathered:
            fetched = bucket.fetch_shard()
            bucket._all_gather(bucket.param_shard).wait()
            if fetched:
                bucket.evict_shard(dirty=False)
        self.holds_dequantized = False


def attach_fp8_param_gather(buckets) -> int:
    """Gives every bucket over more than one rank that holds tagged weights its FP8 gather
    (``bucket.fp8_gather``: ``Fp8ShardGather`` at ZeRO-3, else ``Fp8ParamGather``); returns how many got one."""
    attached = 0
    for bucket in buckets:
        specs = {p: gather_spec(p) for p in bucket.params if gather_spec(p) is not None}
        if specs and bucket.dp_size > 1:
            bucket.fp8_gather = (Fp8ShardGather if bucket.shard_params else Fp8ParamGather)(bucket, specs)
            attached += 1
    return attached


__all__ = ["Fp8ParamGather", "Fp8ShardGather", "attach_fp8_param_gather"]
