"""Attention sinks (gpt-oss's ``sinks``, Megatron's ``--softmax-type learnable`` / ``off-by-one``) on top of the
block kernels, and ``BlockAttention``: one block's attention with an optional sliding window and sink as an
autograd function (all-gather cp's query chunks and the core attention's window / sink path use it).

A sink is one extra logit per head that joins every row's softmax and whose probability is dropped (its
value is zero): ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink))``. In log-sum-exp terms it is one more block
with ``out = 0`` and ``lse = sink``, merged like any other: ``lse' = logaddexp(lse, sink)``, ``out' = out *
exp(lse - lse')``. The blocks' backward, given the final ``out'`` and ``lse'``, then recomputes the final
probabilities and returns the right dq, dk, dv, and the sink's gradient is ``-sum over rows of
exp(sink - lse') * rowsum(dout * out')``. No communication here.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_core.context_parallel.blocks import block_backward, block_forward
from megatron_core.utils.compile_guard import eager_when_compiled


def add_sink_(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """In place: ``out`` ``[b, hq, sq, d]`` and ``lse`` ``[b, hq, sq]`` (normalized over the keys, accumulation
    dtype) become those of the softmax with the sink logits ``sink`` ``[hq]`` in every row's denominator."""
    merged = torch.logaddexp(lse, sink.to(lse.dtype).view(1, -1, 1))
    out.mul_((lse - merged).exp_().unsqueeze(-1))
    lse.copy_(merged)


def sink_grad(sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The gradient ``[hq]`` (in ``sink``'s dtype) of the sink logits from the final ``lse`` and ``delta =
    rowsum(dout * out)`` ``[b, hq, sq]``: ``-sum_rows p_sink * delta`` (the sink's value is zero)."""
    p_sink = (sink.to(lse.dtype).view(1, -1, 1) - lse).exp_()
    return -(p_sink * delta).sum(dim=(0, 2)).to(sink.dtype)


class BlockAttention(torch.autograd.Function):
    """q ``[b, hq, sq, d]`` over k ``[b, hk, sk, d]``, v ``[b, hk, sk, dv]`` -> out ``[b, hq, sq, dv]``
    (q's dtype), with ``mask`` (boolean, True = masked, or None), ``sink`` (``[hq]`` logits or None) and
    ``options``: the keyword arguments of ``blocks.block_forward`` (scale, causal, causal_offset, band,
    dropout_p, dropout_seed). Probabilities are recomputed in backward, never stored."""

    @staticmethod
    def forward(ctx, q, k, v, mask: Optional[torch.Tensor], sink: Optional[torch.Tensor], options: dict):
        out, lse = block_forward(q, k, v, mask=mask, **options)
        if sink is not None:
            add_sink_(out, lse, sink)
        out = out.to(q.dtype)
        ctx.options = options
        ctx.save_for_backward(q, k, v, mask, sink, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, sink, out, lse = ctx.saved_tensors
        dout = dout.to(lse.dtype)
        delta = (dout * out.to(lse.dtype)).sum(dim=-1)
        dq, dk, dv = block_backward(q, k, v, dout, delta=delta, lse=lse, mask=mask, out=out, **ctx.options)
        dsink = sink_grad(sink, lse, delta) if sink is not None and ctx.needs_input_grad[4] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dsink, None


@eager_when_compiled  # host-side tile planning and per-tile RNG: eager inside a compiled layer (a graph break)
def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                    sink: Optional[torch.Tensor] = None, **options) -> torch.Tensor:
    """``BlockAttention.apply`` with keyword options (see there)."""
    return BlockAttention.apply(q, k, v, mask, sink, options)


__all__ = ["BlockAttention", "add_sink_", "block_attention", "sink_grad"]
