"""Attention over one block of keys with its log-sum-exp, the online-softmax merge of partial results, and
the block's backward from the final statistics (flash-attention style: probabilities are recomputed, never
stored). Used by ring attention; no communication here.

Shapes, per rank: query ``[b, hq, sq, d]``, key and value ``[b, hk, sk, d]`` with ``hq = hk * heads_per_group``
(GQA: each key/value head serves ``heads_per_group`` consecutive query heads). The math and statistics are
fp32 (fp64 for fp64 inputs: ``accumulation_dtype``).
"""
from __future__ import annotations

from typing import Optional

import torch


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


def dropout_keep_mask(shape: tuple[int, ...], *, p: float, seed: int, device: torch.device) -> torch.Tensor:
    """Boolean keep mask (``True`` with probability ``1 - p``) drawn from its own generator seeded with ``seed``,
    so the backward pass draws exactly the forward's mask again."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.rand(shape, generator=generator, device=device) >= p


def _scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, causal: bool,
            mask: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 ``scale * q k^T`` ``[b, hq, sq, sk]`` with masked positions at -inf (causal: ``k > q``, sq == sk)."""
    acc = accumulation_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        upper = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        mask = upper if mask is None else mask | upper
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with fully masked rows (-inf) set to 0, so ``exp(scores - lse)`` is 0 there instead of nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                  mask: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                  dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over this block's keys only.

    Args:
        q, k, v: ``[b, hq, sq, d]``, ``[b, hk, sk, d]``, ``[b, hk, sk, d]``.
        scale: multiplies the scores (``1 / sqrt(d)``).
        causal: mask keys after each query (the diagonal block: ``sq == sk``, same positions).
        mask: boolean, broadcastable to ``[b, hq, sq, sk]``, True = masked out; or None.
        keep: dropout keep mask ``[b, hq, sq, sk]`` (None: no dropout); kept entries are scaled by 1/(1-p).

    Returns:
        ``(out, lse)``: fp32 ``[b, hq, sq, d]`` normalized over this block, and fp32 ``[b, hq, sq]`` its
        log-sum-exp (-inf, with out 0, for rows this block fully masks).
    """
    heads_per_group = q.shape[1] // k.shape[1]
    scores = _scores(q, expand_kv(k, heads_per_group), scale=scale, causal=causal, mask=mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    if keep is not None:
        probs = probs * keep / (1.0 - dropout_p)
    return torch.matmul(probs, expand_kv(v, heads_per_group).to(probs.dtype)), lse


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge, in place: ``(out, lse) <- (out, lse) (+) (block_out, block_lse)``.

    ``lse' = log(e^lse + e^block_lse)`` and ``out' = out e^(lse - lse') + block_out e^(block_lse - lse')``,
    all fp32; rows masked in both stay 0 with lse -inf. ``out`` ``[..., sq, d]``, ``lse`` ``[..., sq]``.
    """
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(merged)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, delta: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool, mask: Optional[torch.Tensor] = None,
                   keep: Optional[torch.Tensor] = None,
                   dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of this block's share of the attention output, from the final (merged) statistics.

    Args:
        q, k, v, scale, causal, mask, keep, dropout_p: as in ``block_forward``.
        dout: fp32 ``[b, hq, sq, d]`` gradient of the final attention output (for this block's query rows).
        delta: fp32 ``[b, hq, sq]``, ``rowsum(dout * out)`` of the final output.
        lse: fp32 ``[b, hq, sq]`` log-sum-exp over every key (after the merge).

    Returns:
        fp32 ``(dq [b, hq, sq, d], dk [b, hk, sk, d], dv [b, hk, sk, d])``.
    """
    heads_per_group = q.shape[1] // k.shape[1]
    acc = accumulation_dtype(q.dtype)
    k_full, v_full = expand_kv(k, heads_per_group).to(acc), expand_kv(v, heads_per_group).to(acc)
    scores = _scores(q, k_full, scale=scale, causal=causal, mask=mask)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))  # the final softmax, restricted to this block
    dropped = probs if keep is None else probs * keep / (1.0 - dropout_p)
    dv = torch.matmul(dropped.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v_full.transpose(-1, -2))
    if keep is not None:
        dprobs = dprobs * keep / (1.0 - dropout_p)
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(dscores, k_full)
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc))
    return dq, fold_kv(dk, heads_per_group), fold_kv(dv, heads_per_group)


__all__ = ["accumulation_dtype", "block_backward", "block_forward", "dropout_keep_mask", "expand_kv", "fold_kv", "merge_"]
