"""gpt-oss's attention variants for ``DotProductAttention``: sliding-window attention (``config.window_for``,
Megatron's ``--window-size`` / ``--window-attn-skip-freq``) and attention sinks (``softmax_type``
"learnable": one trained logit per head, transformers' ``GptOssAttention.sinks``; "off-by-one": a fixed 0).

A sink joins every row's softmax and its probability is dropped: ``softmax([scores, sink])[:-1]``, fp32.
Both run on the block kernels of ``megatron_core.context_parallel`` (flash-style: the scores in bounded fp32
tiles, recomputed in backward; a window computes only the keys each tile can see; a sink-only layer runs the
fused kernel of its device and merges the sink by its log-sum-exp).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.context_parallel.band import Band
from megatron_core.context_parallel.sinks import block_attention
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron_core.tensor_parallel.initialization import InitRecipe, init_method_constant


def softmax_offset_parameter(config: TransformerConfig, parallel_state: ParallelState) -> nn.Parameter:
    """The learnable sinks of this tp rank's heads, ``[heads/tp]``, zero-initialized (an init recipe, so a
    meta-device / ZeRO-3 build can compute any shard) and split over tp along dim 0 like the heads."""
    tp_size, heads = parallel_state.tp_size, config.num_attention_heads
    param = nn.Parameter(torch.zeros(heads // tp_size, dtype=config.params_dtype, device=parallel_state.device))
    param.init_recipe = InitRecipe(0, init_method_constant(0.0), (heads,), 0, 1, parallel_state.tp_rank, tp_size)
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    return param


def sink_logits(softmax_type: str, softmax_offset: Optional[torch.Tensor], heads: int,
                head_slice: Optional[slice], device: torch.device) -> Optional[torch.Tensor]:
    """The sink logit of each of this rank's ``heads`` heads (``[heads]``, or the ``head_slice`` of them), or
    None for the vanilla softmax."""
    if softmax_type == "vanilla":
        return None
    if softmax_type == "learnable":
        return softmax_offset if head_slice is None else softmax_offset[head_slice]
    count = heads if head_slice is None else len(range(heads)[head_slice])
    return torch.zeros(count, dtype=torch.float32, device=device)  # off-by-one: a fixed zero logit


def _dropout_seed(dropout_p: float, rng_tracker) -> Optional[int]:
    """A seed for the blocks' per-tile dropout masks, drawn from the tracker's model-parallel state (so it
    differs over tp and replays under activation recompute); None without dropout."""
    if dropout_p == 0.0:
        return None
    with rng_tracker.fork():
        return int(torch.randint(0, 2**40, (1,)).item())


def variant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], *, window: Optional[tuple[int, int]],
                      sink: Optional[torch.Tensor], scale: float, dropout_p: float, rng_tracker) -> torch.Tensor:
    """Attention with a sliding window and/or sinks over the keys this rank holds.

    Args:
        query: ``[sq, b, hq, d]``; key ``[sk, b, hk, d]``, value ``[sk, b, hk, dv]`` (GQA: hk divides hq).
        attention_mask: None: causal, query row i at position ``sk - sq + i`` (a cache's new tokens after its
            cached ones). Else boolean, broadcastable to ``[b, hq, sq, sk]`` (True = masked), the whole rule
            (like the plain path's); the window is added when ``sq == sk`` (positions ``0 .. s-1``), and for
            ``sq != sk`` the mask must already hold it (``InferenceCache.attention_mask(window=...)``).
        window: ``(left, right)``, query p sees keys ``p - left .. p + right`` (-1: unbounded), or None.
        sink: ``[hq]`` logits joining every row's softmax (their probability dropped), or None.
        scale: multiplies the scores; dropout_p: on the probabilities (after the mask and the sink).
        rng_tracker: the layout's tracker (its model-parallel state seeds the dropout masks).

    Returns:
        ``[sq, b, hq * dv]``. No communication.
    """
    sq, b, hq, _ = query.shape
    sk = key.shape[0]
    causal = attention_mask is None
    band = None
    if window is not None and (causal or sq == sk):
        band = Band.of(torch.arange(sk - sq, sk), torch.arange(sk), window, query.device)
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
    out = block_attention(q, k, v, attention_mask, sink, scale=scale, causal=causal, causal_offset=sk - sq,
                          band=band, dropout_p=dropout_p, dropout_seed=_dropout_seed(dropout_p, rng_tracker))
    return out.permute(2, 0, 1, 3).reshape(sq, b, hq * out.shape[-1])


def cache_attention_mask(inference_cache, s_new: int, device: torch.device, *, window: Optional[tuple[int, int]],
                         layer_number: int) -> Optional[torch.Tensor]:
    """``inference_cache.attention_mask`` for the layer's window: the window is passed only when the layer has
    one, and a cache whose ``attention_mask`` takes none is refused rather than silently ignoring it."""
    if window is None:
        return inference_cache.attention_mask(s_new, device)
    if "window" not in inspect.signature(inference_cache.attention_mask).parameters:
        raise ValueError(f"layer {layer_number} attends through the sliding window {tuple(window)}, but "
                         f"{type(inference_cache).__name__}.attention_mask takes no window: decode with "
                         "megatron_core.transformer.InferenceCache, or give the cache an attention_mask(s_new, "
                         "device, window=...) that masks keys before position - left")
    return inference_cache.attention_mask(s_new, device, window=window)


__all__ = ["cache_attention_mask", "sink_logits", "softmax_offset_parameter", "variant_attention"]
