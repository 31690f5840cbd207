"""Attention over one block of keys with its log-sum-exp, the online-softmax merge of partial results, and
the block's backward from the final statistics (flash-attention style: probabilities are recomputed in
backward, never stored). Used by ring attention; no communication here.

Shapes, per rank: query ``[b, hq, sq, d]``, key and value ``[b, hk, sk, d]`` with ``hq = hk * heads_per_group``
(GQA: each key/value head serves ``heads_per_group`` consecutive query heads). The math and statistics are
fp32 (fp64 for fp64 inputs: ``accumulation_dtype``). Query rows are processed in tiles of at most
``tile_elements`` scores, so the transient score / probability / dropout-mask tensors stay bounded whatever
the sequence length.

Fused path: when a block has no user mask and no dropout, its forward and backward run fused kernels that
return / take the log-sum-exp (``fused``: torch's CPU flash attention; on CUDA, flash or memory-efficient
SDPA, untested here), as torch's own ring attention does; a causal block with ``causal_offset > 0`` is cut
into the keys every query sees (no mask) and the diagonal (causal, square), merged with the log-sum-exp
rule. One piece (the common case: every ring block) is returned as the kernel gives it, without copies.
Everything else (masks, dropout, sliding windows, devices or dtypes without a kernel, ``FUSED = False``)
runs the tiled torch math below. A sliding window (``band.Band``) restricts each tile to the key columns its
rows can see.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_core.context_parallel import fused
from megatron_core.context_parallel.band import Band, band_tiles
from megatron_core.utils import accelerator

TILE_ELEMENTS = 1 << 20
"""Scores per tile (``b * hq * rows * sk``): about two such fp32 buffers (8 MiB) live at once in backward."""


FUSED = True
"""Use the fused kernels where a block allows them (``False``: always the tiled math)."""


def fused_ok(q: torch.Tensor, *, mask: Optional[torch.Tensor], dropout_p: float, dropout_seed: Optional[int]) -> bool:
    """Whether a block of ``q`` may run a fused kernel: one exists for its device and dtype, no user mask, no
    dropout."""
    return (FUSED and mask is None and (dropout_p == 0.0 or dropout_seed is None)
            and fused.kernel_for(q) is not None)


def _fused_pieces(sq: int, sk: int, causal: bool, causal_offset: int) -> Optional[list[tuple[int, int, bool]]]:
    """``(key start, key end, causal)`` pieces of a block: all keys (not causal), or the keys before
    ``causal_offset`` (every query sees them) and the square diagonal ``[offset, offset + sq)``; None when
    the diagonal does not fit (``offset + sq > sk``: the tiled math runs)."""
    if not causal:
        return [(0, sk, False)]
    if causal_offset + sq > sk:
        return None
    return [piece for piece in [(0, causal_offset, False), (causal_offset, causal_offset + sq, True)]
            if piece[1] > piece[0]]


def _fused_forward(kernel: str, q, k, v, pieces, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q.dtype)
    out = lse = None
    for start, end, causal in pieces:
        piece_out, piece_lse = fused.piece_forward(kernel, q, k[:, :, start:end], v[:, :, start:end], scale=scale,
                                                   causal=causal)
        piece_out, piece_lse = piece_out.to(acc), piece_lse.to(acc)
        if out is None:
            out, lse = piece_out, piece_lse
        else:
            merge_(out, lse, piece_out, piece_lse)
    return out, lse


def _fused_backward(kernel: str, q, k, v, dout, out, lse, pieces, *,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q.dtype)
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    lse = lse.to(fused.lse_dtype(q.dtype)).contiguous()
    if len(pieces) == 1 and pieces[0][:2] == (0, k.shape[2]):
        grads = fused.piece_backward(kernel, dout, q, k, v, out, lse, scale=scale, causal=pieces[0][2])
        return tuple(grad.to(acc) for grad in grads)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
    for start, end, causal in pieces:
        piece_dq, piece_dk, piece_dv = fused.piece_backward(kernel, dout, q, k[:, :, start:end], v[:, :, start:end],
                                                            out, lse, scale=scale, causal=causal)
        dq += piece_dq
        dk[:, :, start:end] += piece_dk
        dv[:, :, start:end] += piece_dv
    return dq, dk, dv


def _fused_plan(q, k, *, causal: bool, causal_offset: int, mask, dropout_p: float, dropout_seed):
    """``(kernel, pieces)`` of a block that runs fused, else None."""
    if not fused_ok(q, mask=mask, dropout_p=dropout_p, dropout_seed=dropout_seed):
        return None
    pieces = _fused_pieces(q.shape[2], k.shape[2], causal, causal_offset)
    return None if pieces is None else (fused.kernel_for(q), pieces)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 32-bit inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def expand_kv(x: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """``[b, hk, s, d] -> [b, hk * heads_per_group, s, d]`` (each kv head repeated for its query heads)."""
    return x if heads_per_group == 1 else x.repeat_interleave(heads_per_group, dim=1)


def fold_kv(grad: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """The gradient of ``expand_kv``: ``[b, hq, s, d] -> [b, hq / heads_per_group, s, d]`` summed per group."""
    if heads_per_group == 1:
        return grad
    b, hq, s, d = grad.shape
    return grad.view(b, hq // heads_per_group, heads_per_group, s, d).sum(dim=2)


def tile_keep_mask(shape: tuple[int, ...], *, p: float, seed: int, first_row: int,
                   device: torch.device) -> torch.Tensor:
    """Dropout keep mask (True with probability ``1 - p``) of the tile starting at query row ``first_row``,
    drawn from its own generator, so backward draws exactly the forward's mask again."""
    generator = accelerator.seeded_generator(device, seed * 1_000_003 + first_row)  # (a dry run: None)
    return torch.rand(shape, generator=generator, device=device) >= p


def _row_tiles(q: torch.Tensor, sk: int, tile_elements: int) -> list[tuple[int, int]]:
    b, hq, sq, _ = q.shape
    rows = max(1, tile_elements // max(1, b * hq * sk))
    return [(start, min(sq, start + rows)) for start in range(0, sq, rows)]


def _tiles(q: torch.Tensor, sk: int, tile_elements: int, *, band: Optional[Band], causal: bool,
           causal_offset: int) -> list[tuple[int, int, int, int]]:
    """``(row start, row end, key lo, key hi)``: every key per tile without a band, else ``band_tiles``."""
    if band is None:
        return [(start, end, 0, sk) for start, end in _row_tiles(q, sk, tile_elements)]
    return band_tiles(band, sq=q.shape[2], row_cost=q.shape[0] * q.shape[1], tile_elements=tile_elements,
                      causal=causal, causal_offset=causal_offset)


def _tile_mask(mask: Optional[torch.Tensor], band: Optional[Band], rows: tuple[int, int],
               cols: tuple[int, int]) -> Optional[torch.Tensor]:
    """The user mask cut to the tile (its broadcast dims of size 1 kept), or'ed with the band's."""
    if mask is not None:
        row_cut = slice(*rows) if mask.shape[-2] != 1 else slice(None)
        mask = mask[..., row_cut, slice(*cols) if mask.shape[-1] != 1 else slice(None)]
    if band is None:
        return mask
    outside = band.mask(*rows, *cols)
    return outside if mask is None else mask | outside


def _tile_probs(q: torch.Tensor, k: torch.Tensor, *, scale: float, causal: bool, first_row: int,
                mask: Optional[torch.Tensor], lse: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, lse)`` of query rows ``[first_row, first_row + tile)``: scores ``scale * q k^T`` with masked
    positions at -inf (causal: key ``j`` masked for tile row ``i`` when ``j > first_row + i``), normalized by
    ``lse`` when given (backward: the final statistics), else by their own log-sum-exp. In place on one
    ``[b, hq, tile, sk]`` buffer (plus the boolean mask), so a tile costs about one score tensor."""
    probs = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [b, hq, tile, sk]
    if causal:
        upper = torch.ones(probs.shape[-2:], dtype=torch.bool, device=probs.device).triu_(first_row + 1)
        mask = upper if mask is None else mask | upper
    if mask is not None:
        probs.masked_fill_(mask, float("-inf"))
    if lse is None:
        row_max = probs.amax(dim=-1)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        total = probs.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)
        lse = total.log().add_(row_max)  # -inf for fully masked rows
        return probs.div_(torch.where(total == 0, torch.ones_like(total), total).unsqueeze(-1)), lse
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # fully masked rows: probs 0, not nan
    return probs.sub_(finite.unsqueeze(-1)).exp_(), lse


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                  causal_offset: int = 0, mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                  dropout_seed: Optional[int] = None, tile_elements: int = TILE_ELEMENTS,
                  band: Optional[Band] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over this block's keys only.

    Args:
        q, k, v: ``[b, hq, sq, d]``, ``[b, hk, sk, d]``, ``[b, hk, sk, d]``.
        scale: multiplies the scores (``1 / sqrt(d)``).
        causal: mask keys after each query; query row ``i`` sits at key position ``i + causal_offset``
            (0: the diagonal block, same positions).
        mask: boolean, broadcastable to ``[b, hq, sq, sk]``, True = masked out; or None.
        dropout_p, dropout_seed: attention dropout (kept entries scaled by 1/(1-p)) with masks drawn per tile
            from ``dropout_seed``; no dropout when the seed is None or p is 0.
        tile_elements: bound on the scores computed at once.
        band: a sliding window over the rows' and columns' global positions (``band.Band``), or None.

    Returns:
        ``(out, lse)``: ``[b, hq, sq, d]`` normalized over this block, and ``[b, hq, sq]`` its log-sum-exp
        (-inf, with out 0, for rows this block fully masks), both in the accumulation dtype.
    """
    acc, heads_per_group = accumulation_dtype(q.dtype), q.shape[1] // k.shape[1]
    plan = None if band is not None else _fused_plan(q, k, causal=causal, causal_offset=causal_offset, mask=mask,
                                                     dropout_p=dropout_p, dropout_seed=dropout_seed)
    if plan is not None:
        return _fused_forward(plan[0], q, expand_kv(k, heads_per_group), expand_kv(v, heads_per_group), plan[1],
                              scale=scale)
    k, v = expand_kv(k, heads_per_group).to(acc), expand_kv(v, heads_per_group).to(acc)
    outs, lses = [], []
    for start, end, lo, hi in _tiles(q, k.shape[2], tile_elements, band=band, causal=causal,
                                     causal_offset=causal_offset):
        if hi <= lo:  # the window hides every key of this block from these rows
            outs.append(v.new_zeros(*v.shape[:2], end - start, v.shape[3]))
            lses.append(v.new_full((*q.shape[:2], end - start), float("-inf")))
            continue
        probs, lse = _tile_probs(q[:, :, start:end].to(acc), k[:, :, lo:hi], scale=scale, causal=causal,
                                 first_row=start + causal_offset - lo,
                                 mask=_tile_mask(mask, band, (start, end), (lo, hi)), lse=None)
        if dropout_p > 0.0 and dropout_seed is not None:
            keep = tile_keep_mask(probs.shape, p=dropout_p, seed=dropout_seed, first_row=start, device=q.device)
            probs.mul_(keep).div_(1.0 - dropout_p)
        outs.append(torch.matmul(probs, v[:, :, lo:hi]))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge, in place: ``(out, lse) <- (out, lse) (+) (block_out, block_lse)``.

    ``lse' = log(e^lse + e^block_lse)`` and ``out' = out e^(lse - lse') + block_out e^(block_lse - lse')``,
    in the accumulation dtype; rows masked in both stay 0 with lse -inf. ``out`` ``[..., sq, d]``, ``lse``
    ``[..., sq]``.
    """
    merged = torch.logaddexp(lse, block_lse)
    safe = merged.nan_to_num(neginf=0.0)  # rows masked in both: weights e^-inf = 0, not nan
    out.mul_(lse.sub_(safe).exp_().unsqueeze(-1)).addcmul_(block_out, block_lse.sub(safe).exp_().unsqueeze(-1))
    lse.copy_(merged)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, delta: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool, causal_offset: int = 0,
                   mask: Optional[torch.Tensor] = None,
                   dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                   tile_elements: int = TILE_ELEMENTS, out: Optional[torch.Tensor] = None,
                   band: Optional[Band] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of this block's share of the attention output, from the final (merged) statistics.

    Args:
        q, k, v, scale, causal, causal_offset, mask, dropout_p, dropout_seed, tile_elements, band: as in
            ``block_forward`` (the same tiles, so the same dropout masks).
        dout: ``[b, hq, sq, d]`` gradient of the final attention output (for this block's query rows).
        delta: ``[b, hq, sq]``, ``rowsum(dout * out)`` of the final output.
        lse: ``[b, hq, sq]`` log-sum-exp over every key (after the merge).
        out: ``[b, hq, sq, d]`` the final (merged) attention output of these rows; the fused kernel needs it
            (without it the tiled math runs).

    Returns:
        ``(dq [b, hq, sq, d], dk [b, hk, sk, d], dv [b, hk, sk, d])`` in the accumulation dtype.
    """
    acc, heads_per_group = accumulation_dtype(q.dtype), q.shape[1] // k.shape[1]
    plan = None if out is None or band is not None else _fused_plan(
        q, k, causal=causal, causal_offset=causal_offset, mask=mask, dropout_p=dropout_p, dropout_seed=dropout_seed)
    if plan is not None:
        dq, dk, dv = _fused_backward(plan[0], q, expand_kv(k, heads_per_group), expand_kv(v, heads_per_group), dout,
                                     out, lse, plan[1], scale=scale)
        return dq, fold_kv(dk, heads_per_group), fold_kv(dv, heads_per_group)
    k, v = expand_kv(k, heads_per_group).to(acc), expand_kv(v, heads_per_group).to(acc)
    dq_tiles, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for start, end, lo, hi in _tiles(q, k.shape[2], tile_elements, band=band, causal=causal,
                                     causal_offset=causal_offset):
        if hi <= lo:  # no key of this block reaches these rows
            dq_tiles.append(q.new_zeros(*q.shape[:2], end - start, q.shape[3], dtype=acc))
            continue
        q_tile, dout_tile = q[:, :, start:end].to(acc), dout[:, :, start:end].to(acc)
        k_tile, v_tile = k[:, :, lo:hi], v[:, :, lo:hi]
        probs, _ = _tile_probs(q_tile, k_tile, scale=scale, causal=causal, first_row=start + causal_offset - lo,
                               mask=_tile_mask(mask, band, (start, end), (lo, hi)), lse=lse[:, :, start:end])
        dprobs = torch.matmul(dout_tile, v_tile.transpose(-1, -2))
        if dropout_p > 0.0 and dropout_seed is not None:
            keep = tile_keep_mask(probs.shape, p=dropout_p, seed=dropout_seed, first_row=start, device=q.device)
            dv[:, :, lo:hi] += torch.matmul((probs * keep).transpose(-1, -2), dout_tile).div_(1.0 - dropout_p)
            dprobs.mul_(keep).div_(1.0 - dropout_p)
        else:
            dv[:, :, lo:hi] += torch.matmul(probs.transpose(-1, -2), dout_tile)
        dscores = dprobs.sub_(delta[:, :, start:end].unsqueeze(-1)).mul_(probs).mul_(scale)  # in dprobs' buffer
        del probs
        dq_tiles.append(torch.matmul(dscores, k_tile))
        dk[:, :, lo:hi] += torch.matmul(dscores.transpose(-1, -2), q_tile)
    return torch.cat(dq_tiles, dim=2), fold_kv(dk, heads_per_group), fold_kv(dv, heads_per_group)


__all__ = ["FUSED", "TILE_ELEMENTS", "accumulation_dtype", "fused_ok", "block_backward", "block_forward", "expand_kv",
           "fold_kv", "merge_", "tile_keep_mask"]
