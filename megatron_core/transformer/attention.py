"""Self-attention with a fused QKV projection laid out by key/value groups (MHA and GQA), rotary embeddings,
the fused causal softmax, and tensor parallelism over whole heads.

QKV layout: the output rows of ``linear_qkv`` are ``num_query_groups`` blocks, each
``[q of its heads_per_group heads, k, v] x kv_channels``. Tensor parallelism cuts this dim into contiguous
chunks of whole groups (``num_query_groups % tp == 0``), so each rank holds the q, k and v of its groups.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import kernels
from megatron_core.config import TransformerConfig
from megatron_core.context_parallel import context_parallel_attention
from megatron_core.context_parallel.band import normalize_window
from megatron_core.fp8.config import layer_fp8
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron_core.transformer.attention_variants import (
    cache_attention_mask,
    sink_logits,
    softmax_offset_parameter,
    variant_attention,
)
from megatron_core.transformer.inference_cache import InferenceCache, check_cache_inputs
from megatron_core.transformer.norms import Norm
from megatron_core.transformer.rope import apply_rotary_pos_emb


def dropout_in_partitioned_region(x: torch.Tensor, p: float, training: bool, *, rng_tracker) -> torch.Tensor:
    """Dropout whose mask differs across tp ranks (the layout tracker's model-parallel RNG state)."""
    if not training or p == 0.0:
        return x
    with rng_tracker.fork():
        return F.dropout(x, p)


class DotProductAttention(nn.Module):
    """``softmax(q k^T / sqrt(d)) v`` for this rank's heads (the "core attention" of selective recompute).

    forward: query ``[sq, b, heads/tp, d]``, key and value ``[sk, b, groups/tp, d]``, attention_mask None
    (causal) or boolean broadcastable to ``[b, heads/tp, sq, sk]`` (True = masked) -> ``[sq, b, heads/tp * d]``.
    No communication.

    With context parallelism (``parallel_state.cp_size > 1``) the inputs hold this cp rank's tokens (the
    load-balanced split, ``[s/cp, b, ...]``) and ``megatron_core.context_parallel`` attends over the whole
    sequence with ``config.cp_comm_type``; attention_mask is then None or the whole sequence's boolean
    ``[b|1, 1, s, s]`` over global positions. The communication is that of the chosen scheme.

    gpt-oss's variants (``attention_variants``): the layer's sliding window ``config.window_for(layer_number)``
    (``window``, ``(left, right)`` or None) and attention sinks (``softmax_type`` "learnable": the parameter
    ``softmax_offset`` ``[heads/tp]``, tp-split along dim 0, zero-initialized; "off-by-one": a fixed 0 logit).
    Every cp scheme supports both.
    """

    def __init__(self, config: TransformerConfig, *, layer_number: int, parallel_state: ParallelState) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.scale = config.attention_softmax_scale  # 1 / sqrt(head dim) unless the config says otherwise
        self.attention_dropout = config.attention_dropout
        self.parallel_state, self.cp_comm_type = parallel_state, config.cp_comm_type
        self.window = normalize_window(config.window_for(layer_number))
        self.softmax_type = config.softmax_type
        self.heads_per_rank = config.num_attention_heads // parallel_state.tp_size
        self.softmax_offset = (softmax_offset_parameter(config, parallel_state) if self.softmax_type == "learnable"
                               else None)

    def sink(self, device: torch.device, head_slice: Optional[slice] = None) -> Optional[torch.Tensor]:
        """The sink logits ``[heads/tp]`` of this rank's heads (or of their ``head_slice``), None when vanilla;
        off-by-one's fixed zeros are made on ``device`` (the inputs')."""
        return sink_logits(self.softmax_type, self.softmax_offset, self.heads_per_rank, head_slice, device)

    @staticmethod
    def implementation(attention_mask: Optional[torch.Tensor], sq: int, sk: int, *, device: torch.device,
                       dropout_p: float) -> str:
        """Which path ``local_attention`` takes.

        ``"sdpa"``: PyTorch's fused ``scaled_dot_product_attention(is_causal=True)`` (flash or memory-efficient
        attention on CUDA, dropout included; torch's flash CPU kernel on CPU) for causal attention without an
        explicit mask. On CPU only without attention dropout: there SDPA's dropout runs its unfused math
        path in fp32, which saves more for backward than the softmax path.
        ``"softmax"``: scores, the fused masked softmax of ``kernels`` (Triton where it runs), dropout, then
        ``probs @ v``: an explicit mask, a causal block with sq != sk, or CPU attention dropout.
        A layer with a sliding window or sinks runs neither: it records ``"blocks"`` (``attention_variants``).
        The choice is recorded as the ``attention`` entry of ``kernel_backend.report()`` (pretrain_gpt's
        "kernels used:" line).
        """
        causal = attention_mask is None and sq == sk
        return "sdpa" if causal and (device.type == "cuda" or dropout_p == 0.0) else "softmax"

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dropout_p: float) -> torch.Tensor:
        """Causal SDPA: q, k, v ``[b, heads, s, d]`` -> ``[b, heads, s, d]``. SDPA's dropout draws from the
        device's default generator: it runs inside the tracker's fork (the model-parallel state), so masks
        differ across tp ranks, repeat from the same seed and replay under activation recompute."""
        rng = self.parallel_state.rng_tracker.fork() if dropout_p > 0 else contextlib.nullcontext()
        with rng:
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True,
                                                  scale=self.scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        state = self.parallel_state
        if state.cp_size > 1:
            local_attention = self.local_attention
            if self.cp_comm_type == "a2a" and self.softmax_type != "vanilla":  # cp rank r attends with heads chunk r
                per_rank = query.shape[2] // state.cp_size
                local_attention = functools.partial(
                    self.local_attention, head_slice=slice(state.cp_rank * per_rank, (state.cp_rank + 1) * per_rank))
            return context_parallel_attention(
                query, key, value, attention_mask, parallel_state=state, cp_comm_type=self.cp_comm_type,
                scale=self.scale, dropout_p=self.attention_dropout if self.training else 0.0,
                local_attention=local_attention, window=self.window, sink=self.sink(query.device))
        return self.local_attention(query, key, value, attention_mask)

    def local_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor] = None, *,
                        head_slice: Optional[slice] = None) -> torch.Tensor:
        """Attention over the keys this rank holds (the whole sequence without context parallelism);
        ``head_slice``: which of this rank's heads the query holds (Ulysses cp), for their sinks."""
        if self.window is not None or self.softmax_type != "vanilla":
            self.parallel_state.kernel_backend.record("attention", "blocks")
            return variant_attention(query, key, value, attention_mask, window=self.window,
                                     sink=self.sink(query.device, head_slice), scale=self.scale,
                                     dropout_p=self.attention_dropout if self.training else 0.0,
                                     rng_tracker=self.parallel_state.rng_tracker)
        sq, b, heads, d = query.shape
        sk, groups = key.shape[0], key.shape[2]
        if heads != groups:  # GQA: each group's k/v serves its heads_per_group consecutive query heads
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        dropout_p = self.attention_dropout if self.training else 0.0
        implementation = self.implementation(attention_mask, sq, sk, device=query.device, dropout_p=dropout_p)
        self.parallel_state.kernel_backend.record("attention", implementation)
        if implementation == "sdpa":
            q, k, v = (rearrange(t, "s b h d -> b h s d") for t in (query, key, value))
            context = self.sdpa(q, k, v, dropout_p=dropout_p)
            return rearrange(context, "b h s d -> s b (h d)")
        q, k, v = (rearrange(t, "s b h d -> (b h) s d") for t in (query, key, value))
        scores = torch.bmm(q, k.transpose(1, 2))  # [b*heads, sq, sk]
        if attention_mask is None:
            probs = kernels.scaled_upper_triang_masked_softmax(scores, self.scale,
                                                               backend=self.parallel_state.kernel_backend)
        else:
            probs = kernels.scaled_masked_softmax(scores.view(b, heads, sq, sk), attention_mask, self.scale,
                                                  backend=self.parallel_state.kernel_backend)
            probs = probs.view(b * heads, sq, sk)
        probs = dropout_in_partitioned_region(probs, self.attention_dropout, self.training,
                                             rng_tracker=self.parallel_state.rng_tracker)
        context = torch.bmm(probs, v)  # [b*heads, sq, d]
        return rearrange(context, "(b h) s d -> s b (h d)", b=b)


class SelfAttention(nn.Module):
    """Pre-normed hidden states -> attention output, tensor-parallel over heads.

    forward: hidden ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism), attention_mask (see
    DotProductAttention), rotary angles ``[s, b, 1, d]`` or None -> ``(output, bias)`` with output
    ``[s, b, h]`` (``[s/tp, b, h]``) all-reduced (reduce-scattered) over tp, and the projection bias (or
    None) left for the caller's bias-dropout-add. With an ``inference_cache`` the new tokens' keys and
    values are appended to the cache and the queries attend to every cached position (no sequence
    parallelism, no explicit attention_mask). ``linear_qkv`` and ``linear_proj`` run in FP8 when
    ``layer_fp8(config, layer_number)`` gives a config (the core attention stays in high precision).
    """

    def __init__(self, config: TransformerConfig, *, layer_number: int, parallel_state: ParallelState,
                 core_attention: type[nn.Module] = DotProductAttention) -> None:
        super().__init__()
        tp_group, device = parallel_state.tp_group, parallel_state.device
        self.config, self.layer_number = config, layer_number
        self.rng_tracker = parallel_state.rng_tracker  # replayed by selective recompute of the core attention
        self.cp_size = parallel_state.cp_size
        self.rope_mscale = config.rope_attention_factor  # YaRN's cos/sin factor (1 without YaRN), once
        self.groups_per_rank = config.num_query_groups // parallel_state.tp_size
        self.heads_per_group = config.num_heads_per_group
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * config.kv_channels
        common = dict(tp_group=tp_group, sequence_parallel=config.sequence_parallel,
                      tp_comm_overlap=config.tp_comm_overlap, params_dtype=config.params_dtype, device=device,
                      weight_grad_store=parallel_state.weight_grad_store, fp8=layer_fp8(config, layer_number))
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size, bias=config.add_qkv_bias,
                                               init_method=init_method_normal(config.init_method_std), **common)
        self.core_attention = core_attention(config, layer_number=layer_number, parallel_state=parallel_state)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:  # over each head's kv_channels; every tp rank sees its own heads only, so the
            # weight grads are partial sums over heads: tagged for the tp all-reduce of finalize_model_grads
            self.q_layernorm = Norm(config, config.kv_channels, device=device,
                                    kernel_backend=parallel_state.kernel_backend)
            self.k_layernorm = Norm(config, config.kv_channels, device=device,
                                    kernel_backend=parallel_state.kernel_backend)
            for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                param.sequence_parallel = parallel_state.tp_size > 1
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * config.kv_channels, config.hidden_size, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers), **common)

    def split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, groups/tp * (heads_per_group + 2) * d]`` -> q ``[s, b, heads/tp, d]``,
        k, v ``[s, b, groups/tp, d]``."""
        mixed = rearrange(mixed, "s b (g p d) -> s b g p d", g=self.groups_per_rank, d=self.config.kv_channels)
        # one split, whose backward is one cat (three slices would each zero-fill a full-size grad and add)
        query, key, value = torch.split(mixed, [self.heads_per_group, 1, 1], dim=3)
        return rearrange(query, "s b g p d -> s b (g p) d"), key.squeeze(3), value.squeeze(3)

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_cache: Optional[InferenceCache] = None):
        mixed, _ = self.linear_qkv(hidden)  # [s, b, (heads + 2 groups)/tp * d]
        query, key, value = self.split_qkv(mixed)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_pos_emb is not None:
            rope = dict(interleaved=self.config.rotary_interleaved, mscale=self.rope_mscale)
            query = apply_rotary_pos_emb(query, rotary_pos_emb, **rope)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, **rope)
        if inference_cache is not None:
            check_cache_inputs(attention_mask, sequence_parallel=self.config.sequence_parallel, cp_size=self.cp_size)
            attention_mask = cache_attention_mask(inference_cache, query.shape[0], query.device,
                                                  window=normalize_window(self.config.window_for(self.layer_number)),
                                                  layer_number=self.layer_number)
            key, value = inference_cache.update(self.layer_number, key, value)  # [offset + s, b, groups/tp, d]
        if query._base is None and key._base is None:  # rope / qk-norm copied q and k out of mixed: saved alone,
            value = value.contiguous()  # v (a view) would keep the whole QKV output alive for backward
        if self.config.recomputes("core_attn"):
            context = checkpoint(self.core_attention, query, key, value, attention_mask,
                                 rng_tracker=self.rng_tracker)
        else:
            context = self.core_attention(query, key, value, attention_mask)  # [s, b, heads/tp * d]
        return self.linear_proj(context)


__all__ = ["DotProductAttention", "SelfAttention", "dropout_in_partitioned_region"]
