"""All-gather context parallelism (the simple baseline): every cp rank gathers the keys and values of the
whole sequence and attends with its own two query chunks, each over the keys it can see (chunk g of c
tokens over keys ``[0, (g + 1) c)``; with a sliding window of ``left`` keys only ``[g c - left, (g + 1) c)``).
K/V memory is that of the full sequence; the scores are computed in bounded tiles and recomputed in backward
(``blocks``), so no ``[s/cp, s]`` probabilities are stored. Attention sinks join each query row's softmax
once (``sinks``).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_core.context_parallel.band import Band, normalize_window
from megatron_core.context_parallel.sinks import block_attention
from megatron_core.context_parallel.split import chunk_ids, to_natural_order
from megatron_core.tensor_parallel import gather_from_sequence_parallel_region


def allgather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], *, cp_group, cp_size: int, cp_rank: int,
                        scale: float, dropout_p: float = 0.0, rng_tracker=None,
                        window: Optional[tuple[int, int]] = None, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the all-gathered keys and values.

    Args:
        query: ``[s/cp, b, hq, d]``, this rank's two chunks (load-balanced split) in local order.
        key, value: ``[s/cp, b, hk, d]`` (GQA: hk divides hq).
        attention_mask: None (causal) or boolean ``[b|1, 1, s, s]`` over global positions, True = masked out
            (combined with the causal mask).
        cp_group: the context-parallel group; cp_size, cp_rank: its size and this rank's index.
        scale: multiplies the scores. dropout_p: attention dropout (0 in eval), masks drawn per tile from
            a seed taken from the RNG tracker's model-parallel state (mixed with the cp rank). rng_tracker:
            the layout's ``RNGStatesTracker`` (needed when dropout_p > 0).
        window: ``(left, right)`` sliding window over global positions (query p sees keys ``p - left ..
            p + right``, -1 unbounded), or None.
        sink: ``[hq]`` sink logits (attention sinks, in every query row's softmax once), or None. Its grad
            covers this rank's rows only: summed over cp with the other replicated parameters' grads.

    Returns:
        ``[s/cp, b, hq * d]`` in local order.

    Communication: forward all-gathers K and V over cp (one collective, ``[s, 2, b, hk, d]``); backward
    reduce-scatters their gradients (each rank's partial sums) back to the owning ranks.
    """
    s_local, b, hq, d = query.shape
    chunk = s_local // 2
    seed = None
    if dropout_p > 0.0:
        with rng_tracker.fork():
            seed = int(torch.randint(0, 2**40, (1,)).item()) + (cp_rank << 41)
    kv = gather_from_sequence_parallel_region(torch.stack([key, value], dim=1), cp_group)  # [s, 2, b, hk, d]
    kv = to_natural_order(kv, dim=0, cp_size=cp_size).permute(1, 2, 3, 0, 4)  # [2, b, hk, s, d]
    q = query.permute(1, 2, 0, 3)  # [b, hq, s/cp, d]
    window = normalize_window(window)
    outputs = []
    for place, index in enumerate(chunk_ids(cp_size, cp_rank)):
        start, end = index * chunk, (index + 1) * chunk  # this query chunk's global positions; keys [0, end)
        first = max(0, start - window[0]) if window is not None and window[0] >= 0 else 0  # the window's start
        mask = None if attention_mask is None else attention_mask[:, :, start:end, first:end]
        band = None if window is None else Band.of(torch.arange(start, end), torch.arange(first, end), window,
                                                   q.device)
        outputs.append(block_attention(q[:, :, place * chunk:(place + 1) * chunk], kv[0][:, :, first:end],
                                       kv[1][:, :, first:end], mask, sink, scale=scale, causal=True,
                                       causal_offset=start - first, band=band, dropout_p=dropout_p,
                                       dropout_seed=None if seed is None else seed + place))
    context = torch.cat(outputs, dim=2)  # [b, hq, s/cp, dv]
    return context.permute(2, 0, 1, 3).reshape(s_local, b, hq * context.shape[-1])


__all__ = ["allgather_attention"]
