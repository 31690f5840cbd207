"""Ring attention (p2p context parallelism): key/value blocks travel around the cp ring while each rank
computes attention of its queries over the block it holds, merging partial results with the online-softmax
log-sum-exp rule (fp32 statistics). Backward sends the K/V blocks around again, together with their
accumulating dK/dV, which end on the rank that owns them.

With the load-balanced split (rank r holds chunks r and 2N-1-r of 2N, local order [r, 2N-1-r]) the block
of step i, whose keys come from rank ``src = (r - i) mod N``, is exactly one of (c = chunk length):

    i == 0        own keys, causal over the 2c local tokens       (2c x 2c, lower triangle)
    src < r       all 2c queries over the first c keys (chunk src) (2c x c, no mask)
    src > r       the last c queries (chunk 2N-1-r) over all 2c keys (c x 2c, no mask)

so every rank does the same work per step, and fully masked blocks are never computed.

A sliding window (``band``) masks each block by the global positions of its rows and columns; the tiles of a
block compute only the columns their rows can see (none for a block wholly outside the window, whose K/V
still travel the ring). Attention sinks join the merged softmax once, after the last step (``sinks``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from megatron_core.context_parallel.band import Band, normalize_window
from megatron_core.context_parallel.blocks import accumulation_dtype, block_backward, block_forward, merge_
from megatron_core.context_parallel.sinks import add_sink_, sink_grad
from megatron_core.context_parallel.split import local_positions


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """What every step of one ring-attention call needs besides the tensors."""

    cp_group: Optional[dist.ProcessGroup]
    cp_ranks: tuple[int, ...]
    cp_rank: int
    scale: float
    dropout_p: float
    seed: int  # dropout masks of step i are drawn from seed + step (0 when there is no dropout)
    window: Optional[tuple[int, int]] = None  # (left, right) over global positions, -1 unbounded; None: none

    @property
    def cp_size(self) -> int:
        return len(self.cp_ranks)

    @property
    def next_rank(self) -> int:
        return self.cp_ranks[(self.cp_rank + 1) % self.cp_size]

    @property
    def prev_rank(self) -> int:
        return self.cp_ranks[(self.cp_rank - 1) % self.cp_size]


def _post(ops: list[tuple[str, torch.Tensor, int]], group) -> list:
    """Posts ``(kind, tensor, peer)`` isend/irecv ops in this order; returns the requests."""
    if not ops:
        return []
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group) for kind, tensor, peer in ops]
    return dist.batch_isend_irecv(p2p)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _block_plan(spec: RingSpec, step: int, local: int) -> tuple[slice, slice, bool]:
    """``(query rows, key rows, causal)`` of step ``step`` in local order (see the module docstring)."""
    src = (spec.cp_rank - step) % spec.cp_size
    half = local // 2
    if step == 0:
        return slice(0, local), slice(0, local), True
    if src < spec.cp_rank:
        return slice(0, local), slice(0, half), False
    return slice(half, local), slice(0, local), False


def _block_mask(mask: Optional[torch.Tensor], spec: RingSpec, step: int, rows: slice, cols: slice,
                seq_length: int) -> Optional[torch.Tensor]:
    """The user's global ``[b|1, 1, s, s]`` mask cut to this block's query and key positions."""
    if mask is None:
        return None
    src = (spec.cp_rank - step) % spec.cp_size
    q_pos = local_positions(seq_length, cp_size=spec.cp_size, cp_rank=spec.cp_rank, device=mask.device)[rows]
    k_pos = local_positions(seq_length, cp_size=spec.cp_size, cp_rank=src, device=mask.device)[cols]
    return mask.index_select(2, q_pos).index_select(3, k_pos)


def _block_band(spec: RingSpec, step: int, rows: slice, cols: slice, seq_length: int,
                device: torch.device) -> Optional[Band]:
    """The sliding window of this block: its query rows' and key columns' global positions."""
    if spec.window is None:
        return None
    src = (spec.cp_rank - step) % spec.cp_size
    q_pos = local_positions(seq_length, cp_size=spec.cp_size, cp_rank=spec.cp_rank)[rows]
    k_pos = local_positions(seq_length, cp_size=spec.cp_size, cp_rank=src)[cols]
    return Band.of(q_pos, k_pos, spec.window, device)


def _dropout_seed(spec: RingSpec, step: int) -> Optional[int]:
    return spec.seed + step if spec.dropout_p > 0.0 else None


class _RingAttention(torch.autograd.Function):
    """q ``[b, hq, s/cp, d]``, k and v ``[b, hk, s/cp, d]`` -> out ``[b, hq, s/cp, d]`` (see ring_attention).

    Buffers: the K/V block travels in one ``[2, b, hk, s/cp, d]`` message per step, double-buffered (send
    the held block, receive the next into the spare, swap), so nothing is allocated per step; backward's
    dK/dV accumulators use two fp32 buffers in turn the same way."""

    @staticmethod
    def forward(ctx, q, k, v, mask, sink, spec: RingSpec):
        local = q.shape[2]
        kv = torch.stack([k, v])  # [2, b, hk, s/cp, d]: only the kv heads travel
        spare = torch.empty_like(kv) if spec.cp_size > 1 else None
        out = lse = None
        for step in range(spec.cp_size):
            last = step == spec.cp_size - 1
            requests = [] if last else _post([("send", kv, spec.next_rank), ("recv", spare, spec.prev_rank)],
                                             spec.cp_group)
            rows, cols, causal = _block_plan(spec, step, local)
            block_out, block_lse = block_forward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale=spec.scale, causal=causal,
                mask=_block_mask(mask, spec, step, rows, cols, local * spec.cp_size), dropout_p=spec.dropout_p,
                dropout_seed=_dropout_seed(spec, step),
                band=_block_band(spec, step, rows, cols, local * spec.cp_size, q.device))
            if out is None:  # step 0, the diagonal block, covers every query row: its result is the start
                out, lse = block_out, block_lse
            else:
                merge_(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            _wait(requests)
            if not last:
                kv, spare = spare, kv
        if sink is not None:
            add_sink_(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, sink, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, sink, out, lse = ctx.saved_tensors
        spec: RingSpec = ctx.spec
        acc = accumulation_dtype(q.dtype)
        dout = dout.to(acc)
        delta = (dout * out.to(acc)).sum(dim=-1)  # [b, hq, s/cp]
        dsink = sink_grad(sink, lse, delta) if sink is not None and ctx.needs_input_grad[4] else None
        kv = torch.stack([k, v])
        if spec.cp_size == 1:  # one rank: its own grads, no ring
            dq, dk, dv = _backward_block(q, kv, dout, out, delta, lse, mask, spec, 0)[1:]
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dsink, None
        spare = torch.empty_like(kv)
        dkv_buffers = [torch.empty(kv.shape, dtype=acc, device=q.device) for _ in range(2)]
        dq, sending = None, []
        for step in range(spec.cp_size):
            last = step == spec.cp_size - 1
            dkv = dkv_buffers[step % 2]  # not in flight: its send (step - 2) was waited for at step - 1
            # per pair of neighbours the order is kv_0, dkv_0, kv_1, dkv_1, ...: post dkv_(i-1) before kv_i
            ops = [("recv", dkv, spec.prev_rank)] if step > 0 else []
            ops += [] if last else [("send", kv, spec.next_rank), ("recv", spare, spec.prev_rank)]
            requests = _post(ops, spec.cp_group)
            cols, block_dq, block_dk, block_dv = _backward_block(q, kv, dout, out, delta, lse, mask, spec, step)
            dq = _add_rows(dq, block_dq, _block_plan(spec, step, q.shape[2])[0])
            _wait(requests)
            if step == 0:
                dkv[0].copy_(block_dk)
                dkv[1].copy_(block_dv)
            else:  # onto the accumulated grads of this kv block from the ranks it visited before
                dkv[0][:, :, cols] += block_dk
                dkv[1][:, :, cols] += block_dv
            _wait(sending)
            sending = _post([("send", dkv, spec.next_rank)], spec.cp_group)  # the last hop reaches the owner
            if not last:
                kv, spare = spare, kv
        own = dkv_buffers[spec.cp_size % 2]  # the buffer not sent last
        _wait(_post([("recv", own, spec.prev_rank)], spec.cp_group))
        _wait(sending)
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, dsink, None


def _add_rows(total: Optional[torch.Tensor], block: torch.Tensor, rows: slice) -> torch.Tensor:
    """``total[:, :, rows] += block``; the first block (step 0: every row) becomes the total."""
    if total is None:
        return block
    total[:, :, rows] += block
    return total


def _backward_block(q, kv, dout, out, delta, lse, mask, spec: RingSpec,
                    step: int) -> tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key rows, dq, dk, dv)`` of step ``step``'s block (its query rows' dq, its key rows' dk / dv,
    accumulation dtype)."""
    local = q.shape[2]
    rows, cols, causal = _block_plan(spec, step, local)
    block_dq, block_dk, block_dv = block_backward(
        q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], dout[:, :, rows], delta=delta[:, :, rows],
        lse=lse[:, :, rows], scale=spec.scale, causal=causal,
        mask=_block_mask(mask, spec, step, rows, cols, local * spec.cp_size), dropout_p=spec.dropout_p,
        dropout_seed=_dropout_seed(spec, step), out=out[:, :, rows],
        band=_block_band(spec, step, rows, cols, local * spec.cp_size, q.device))
    return cols, block_dq, block_dk, block_dv


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], *, cp_group, cp_ranks: tuple[int, ...], cp_rank: int,
                   scale: float, dropout_p: float = 0.0, rng_tracker=None, window: Optional[tuple[int, int]] = None,
                   sink: Optional[torch.Tensor] = None, dropout_rank: Optional[int] = None) -> torch.Tensor:
    """Causal ring attention of this rank's two chunks (load-balanced split).

    Args:
        query: ``[s/cp, b, hq, d]`` in local order; key, value: ``[s/cp, b, hk, d]`` (GQA: hk divides hq).
        attention_mask: None (causal) or boolean ``[b|1, 1, s, s]`` over global positions, True = masked out.
        cp_group, cp_ranks, cp_rank: the context-parallel group, its global ranks and this rank's index.
        scale: multiplies the scores. dropout_p: attention dropout (0 in eval); the masks are drawn from
            per-step generators seeded from the RNG tracker's model-parallel state (different per tp and
            cp rank) and drawn again identically in backward. rng_tracker: the layout's ``RNGStatesTracker``
            (needed when dropout_p > 0).
        window: ``(left, right)`` sliding window over global positions (-1 unbounded), or None.
        sink: ``[hq]`` sink logits joining every query row's softmax once, or None (its grad covers this
            rank's rows: summed over cp with the other replicated parameters' grads).
        dropout_rank: the index that makes this rank's dropout masks distinct (default ``cp_rank``; the
            hierarchical scheme passes the rank in the whole cp group, whose inner ranks share a ring rank).

    Returns:
        ``[s/cp, b, hq * d]`` in local order.

    Communication: forward, cp - 1 steps of isend/irecv of the ``[2, b, hk, s/cp, d]`` K/V block to the next
    / from the previous cp rank, each overlapped with the block computation; backward, the same K/V ring
    plus cp hops of the fp32 dK/dV accumulators (the last hop delivers them to their owner).
    """
    seed = 0
    if dropout_p > 0.0:
        with rng_tracker.fork():
            base = int(torch.randint(0, 2**40, (1,)).item())
        seed = base + ((cp_rank if dropout_rank is None else dropout_rank) << 41)  # distinct per cp rank and step
    spec = RingSpec(cp_group=cp_group, cp_ranks=tuple(cp_ranks), cp_rank=cp_rank, scale=scale,
                    dropout_p=dropout_p, seed=seed, window=normalize_window(window))
    # [b, heads, s/cp, d] views: the kernels take strided inputs, and K/V are copied once, into the ring buffer
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    out = _RingAttention.apply(q, k, v, attention_mask, sink, spec)
    s_local, b, hq, _ = query.shape
    return out.permute(2, 0, 1, 3).reshape(s_local, b, hq * out.shape[-1])


__all__ = ["RingSpec", "ring_attention"]
