"""Activation memory (bytes saved for backward) of a GPT, after Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv 2205.05198).

Table 2 of the paper, per layer, 16-bit activations and 1-byte dropout masks (``korthikanti_bytes``):

    no parallelism             sbh (34 + 5as/h)
    tensor parallel (t)        sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel sbh/t (34 + 5as/h)
    tp + selective recompute   sbh (10 + 24/t)
    tp + sp + selective        sbh/t * 34

``layer_activation_bytes`` is the same count term by term, generalized to any activation dtype, dropout on
or off, GQA, any ffn size and SwiGLU, plus the layernorms' fp32 statistics (which the paper omits);
``stage_activation_bytes`` adds the embedding, the output layer and the loss, full recompute, and the
micro-batches a pipeline stage holds in flight.

Context parallelism (``ActivationShape.cp``) splits the sequence: every per-token term counts the rank's
``s / cp`` tokens. Ring (p2p) and allgather attention recompute the probabilities in backward, so instead of
the ``a s^2`` softmax terms they save the attention output (``e s/cp b q_dim``), its fp32 log-sum-exp and, for
allgather, the gathered K/V of the whole sequence; a2a (Ulysses) runs the ordinary attention over the whole
sequence with ``a / cp`` heads (the softmax terms over cp).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_core.config import TransformerConfig
from megatron_core.planning.fp8 import fp8_layer_saving
from megatron_core.planning.moe import moe_mlp_activation_bytes


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, selective: bool,
                      mask_bytes: int = 1) -> float:
    """Table 2 of arXiv 2205.05198 (16-bit activations, ``mask_bytes`` per dropout-mask element).

    The paper's 1-byte masks are what CUDA's fused dropout saves; on the CPU ``F.dropout`` saves its mask in
    the activation dtype (2 bytes), which adds the two hidden-dropout masks and the attention-dropout mask
    again. With ``mask_bytes=2`` the layernorms' fp32 statistics (16 bytes per token) are counted too.
    """
    attention = 0.0 if selective else 5 * a * s / (h * t)
    if sp:
        paper = s * b * h / t * (34 + attention * t)
    else:
        paper = s * b * h * (10 + 24 / t + attention)
    extra_masks = 2 * s * b * h / (t if sp else 1) + (0 if selective else a * s * s * b / t)
    if mask_bytes == 1:
        return paper
    norm_stats = 2 * 2 * 4 * s * b / (t if sp else 1)  # fp32 mean and rstd of both norms, which the paper omits
    return paper + (mask_bytes - 1) * extra_masks + norm_stats


@dataclasses.dataclass(frozen=True)
class ActivationShape:
    """What the activation count depends on besides the config: one micro-batch on one rank."""

    seq_length: int
    micro_batch_size: int
    tp: int = 1
    sequence_parallel: bool = False
    element_bytes: int = 2
    """Bytes per activation element: 2 for bf16/fp16, 4 for fp32."""
    mask_bytes: int = 1
    """Bytes per dropout-mask element: 1 with CUDA's fused dropout, the activation's on the CPU."""
    cp: int = 1
    """Context-parallel size: each rank holds ``seq_length / cp`` tokens."""
    cp_comm_type: str = "p2p"
    ep: int = 1
    """Expert-parallel size (MoE layers: ``E / ep`` experts per rank)."""
    etp: int = 1
    """Expert tensor-parallel size (1 or tp)."""

    @property
    def local_seq_length(self) -> float:
        return self.seq_length / self.cp

    @property
    def on_cuda(self) -> bool:
        """Whether this is a CUDA run (its dropout masks are 1 byte): attention then runs fused SDPA."""
        return self.mask_bytes == 1


def runs_sdpa(config: TransformerConfig, shape: ActivationShape) -> bool:
    """Whether core attention runs fused SDPA (``DotProductAttention.implementation``: causal, no explicit
    mask, on CUDA or without attention dropout; no sliding window or sinks), which saves no ``[s, s]`` tensor."""
    plain = config.softmax_type == "vanilla" and config.window_size is None
    return plain and (shape.on_cuda or config.attention_dropout == 0)


def layer_activation_bytes(config: TransformerConfig, shape: ActivationShape, *, selective: bool = False,
                           moe_layer: bool = False) -> float:
    """Bytes one transformer layer saves for backward on one tp rank (no full recompute).

    Term by term as in section 4.1 of the paper: the two norms' inputs, the QKV and fc1 inputs (replicated,
    or split over the sequence with SP), Q, K, V, the softmax output, its dropout mask and output, the
    attention projection's input, the fc1 output and activation output, two hidden-dropout masks; plus the
    norms' fp32 mean and rstd. Selective recompute drops the core-attention terms. An MoE layer
    (``moe_layer``) saves ``planning.moe.moe_mlp_activation_bytes`` instead of the dense MLP's terms (the
    router reads the same norm output the dense fc1 would).
    """
    s, b, h, t, e = shape.local_seq_length, shape.micro_batch_size, config.hidden_size, shape.tp, shape.element_bytes
    a = config.num_attention_heads
    dropout_h, dropout_a = config.hidden_dropout > 0, config.attention_dropout > 0
    replicated_div = t if shape.sequence_parallel else 1
    q_dim = config.kv_channels * a
    kv_dim = config.kv_channels * config.num_query_groups
    ffn = config.ffn_hidden_size
    replicated = (2 * e * s * b * h                                  # inputs of the two norms
                  + 2 * e * s * b * h                                # inputs of QKV and fc1 (norm outputs)
                  + (2 * shape.mask_bytes * s * b * h if dropout_h else 0)  # the two hidden-dropout masks
                  + 2 * 2 * 4 * s * b)                               # fp32 mean and rstd of both norms
    full_sequence = 0.0
    if config.multi_latent_attention:
        latent, full_sequence, partitioned = _mla_attention_terms(config, shape)
        replicated += latent
        q_dim = config.num_attention_heads * max(config.qk_head_dim + config.qk_pos_emb_head_dim,
                                                 config.v_head_dim if shape.cp > 1 else 0)
        kv_dim = q_dim  # (context-parallel attention pads q, k and v to one head dim)
    else:
        partitioned = e * s * b * (q_dim + 2 * kv_dim)               # Q, K, V
        partitioned += e * s * b * q_dim                             # input of the attention projection
    moe_bytes = 0.0
    if moe_layer:
        moe_bytes = moe_mlp_activation_bytes(config, tokens=s * b / replicated_div, element_bytes=e, ep=shape.ep,
                                             tp=t, sequence_tokens=s * b, etp=shape.etp)
    elif config.activation in ("swiglu", "quick_geglu"):
        partitioned += e * s * b * ffn * 4                          # [gate; up], act(gate), fc2 input
    else:
        partitioned += e * s * b * ffn * 2                          # fc1 output (gelu input), fc2 input
    if not selective and shape.cp > 1 and shape.cp_comm_type in ("p2p", "allgather", "a2a+p2p"):
        partitioned += e * s * b * q_dim + 4 * a * s * b             # the attention output and its fp32 lse
        if shape.cp_comm_type == "a2a+p2p":
            partitioned += e * s * b * (q_dim + 2 * kv_dim)          # Q, K, V after the inner all-to-all
        if shape.cp_comm_type == "allgather":
            partitioned += 2 * e * shape.seq_length * b * kv_dim     # K, V of the whole sequence
    elif not selective and (config.window_size is not None or config.softmax_type != "vanilla"):
        partitioned += e * s * b * q_dim + 4 * a * s * b             # block attention (window / sinks): out, lse
    elif not selective and runs_sdpa(config, shape):  # flash / efficient (a2a: all tokens, a / cp heads)
        partitioned += e * s * b * 2 * (q_dim - kv_dim)              # k, v repeated to every head
        partitioned += 4 * a * s * b                                 # the output's fp32 log-sum-exp
        # (the output itself is the projection's input, counted above: SDPA lays it out [b, s, heads, d], so
        # ``rearrange(.., "b h s d -> s b (h d)")`` is a view of it, on CUDA as on the CPU)
    elif not selective:
        full = shape.seq_length                                      # a2a: all tokens, a / cp heads
        core = e * a * s * full * b                                  # softmax output
        if dropout_a:
            core += (shape.mask_bytes + e) * a * s * full * b        # dropout mask and output
        partitioned += core
    return replicated / replicated_div + partitioned / t + moe_bytes + full_sequence


def _mla_attention_terms(config: TransformerConfig, shape: ActivationShape) -> tuple[float, float, float]:
    """Multi-latent attention's saved bytes besides the two norms' and the softmax's: ``(replicated, on every
    rank whole, partitioned)``. Replicated (over t with sequence parallelism, which runs the down projections
    on the local chunk and saves the up projections' inputs there): the query latent before and after its norm
    with its fp32 stats (with ``q_lora_rank``), the key/value latent alike. Whole on every rank: rope's fp32 cos
    and sin of the query's and the shared key's rotary channels (one head, every token). Partitioned over
    heads: Q and K (``d_qk + d_pe`` per head), the up projection's output that V views (``d_qk + d_v``), and
    linear_proj's input (``d_v``)."""
    s, b, e = shape.local_seq_length, shape.micro_batch_size, shape.element_bytes
    heads, rank, kv_rank = config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank
    norm_stats = 2 * 4 * s * b if config.qk_layernorm else 0
    replicated = 2 * e * s * b * kv_rank + norm_stats
    if rank is not None:
        replicated += 2 * e * s * b * rank + norm_stats
    rope = 4 * 4 * s * b * config.qk_pos_emb_head_dim
    q_dim = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    partitioned = e * s * b * (2 * q_dim + heads * (config.qk_head_dim + 2 * config.v_head_dim))
    return replicated, rope, partitioned


def mtp_activation_bytes(config: TransformerConfig, shape: ActivationShape, padded_vocab_size: int) -> float:
    """The last stage's multi-token prediction depths: per depth the shifted tokens' embedding and the hidden
    states (the two norms' inputs with fp32 stats), eh_proj's input ``[emb; h]``, one layer (an MoE layer when
    the model has experts), and the final norm, output layer and loss as the main head's."""
    depths = config.mtp_num_layers or 0
    if not depths:
        return 0.0
    s, b, h, e = shape.local_seq_length, shape.micro_batch_size, config.hidden_size, shape.element_bytes
    div = shape.tp if shape.sequence_parallel else 1
    heads = (2 * (e * s * b * h + 8 * s * b) + 2 * e * s * b * h) / div + 8 * s * b  # + the shifted ids
    layer = layer_activation_bytes(config, shape, selective=config.recompute_granularity == "selective",
                                   moe_layer=config.moe is not None)
    return depths * (heads + layer + output_activation_bytes(config, shape, padded_vocab_size))


def _recompute_layer_counts(config: TransformerConfig, layers: int) -> tuple[int, int, int]:
    """(layers held in full, checkpointed segments, layers of the largest segment recomputed at once)."""
    if config.recompute_granularity != "full":
        return layers, 0, 0
    k = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return 0, -(-layers // k), min(k, layers)
    checkpointed = min(k, layers)
    return layers - checkpointed, checkpointed, 1 if checkpointed else 0


def embedding_activation_bytes(config: TransformerConfig, shape: ActivationShape) -> float:
    """The first stage's embedding: token and position ids (int64) and the embedding-dropout mask."""
    s, b, h, t = shape.local_seq_length, shape.micro_batch_size, config.hidden_size, shape.tp
    mask = shape.mask_bytes * s * b * h / (t if shape.sequence_parallel else 1) if config.hidden_dropout > 0 else 0
    return 2 * 8 * s * b + mask


def output_activation_bytes(config: TransformerConfig, shape: ActivationShape, padded_vocab_size: int) -> float:
    """The last stage's final norm (input and fp32 stats), output-layer input, logits shard and loss stats."""
    s, b, h, t, e = shape.local_seq_length, shape.micro_batch_size, config.hidden_size, shape.tp, shape.element_bytes
    div = t if shape.sequence_parallel else 1
    norm = (e * s * b * h + 8 * s * b) / div
    logits = e * s * b * padded_vocab_size / t + (8 + 8) * s * b  # logits shard, int64 target, fp32 max and sum
    return norm + e * s * b * h / div + logits


def stage_activation_bytes(config: TransformerConfig, shape: ActivationShape, *, layers: int, first: bool,
                           last: bool, in_flight: int, padded_vocab_size: int, moe_layers: int = 0,
                           fp8_layers: tuple[int, int] = (0, 0)) -> float:
    """Peak bytes saved for backward by one pipeline stage holding ``in_flight`` micro-batches, of whose
    ``layers`` ``moe_layers`` are MoE layers (counted as their average where only some are held) and
    ``fp8_layers`` ``(dense, moe)`` run their linears in FP8 (``planning.fp8``: 1-byte saved inputs).

    Full recompute keeps each checkpointed segment's input (``e sbh``, over t with SP) per micro-batch, and
    one segment's full activations while it is recomputed in backward.
    """
    selective = config.recompute_granularity == "selective"
    dense_layer = layer_activation_bytes(config, shape, selective=selective)
    moe_layer = layer_activation_bytes(config, shape, selective=selective, moe_layer=True) if moe_layers else 0.0
    fp8_less = fp8_layers[0] * fp8_layer_saving(config, shape) if fp8_layers[0] else 0.0
    fp8_less += fp8_layers[1] * fp8_layer_saving(config, shape, moe_layer=True) if fp8_layers[1] else 0.0
    full_layer = (moe_layers * moe_layer + (layers - moe_layers) * dense_layer - fp8_less) / layers if layers else 0.0
    held, segments, recomputed = _recompute_layer_counts(config, layers)
    segment_input = shape.element_bytes * shape.local_seq_length * shape.micro_batch_size * config.hidden_size
    segment_input /= shape.tp if shape.sequence_parallel else 1
    per_microbatch = held * full_layer + segments * segment_input
    if first:
        per_microbatch += embedding_activation_bytes(config, shape)
    if last:
        per_microbatch += output_activation_bytes(config, shape, padded_vocab_size)
        per_microbatch += mtp_activation_bytes(config, shape, padded_vocab_size)
    return in_flight * per_microbatch + recomputed * max(dense_layer, moe_layer)


def in_flight_microbatches(pp_rank: int, pp_size: int, num_microbatches: int,
                           vpp_size: Optional[int] = None) -> float:
    """Micro-batches (in units of a whole stage's layers) whose activations a 1F1B rank holds at its peak:
    ``min(p - r, m)``; interleaved: ``(2 (p - r - 1) + (v - 1) p + 1) / v`` stage-equivalents."""
    if pp_size == 1:
        return 1
    if not vpp_size:
        return min(pp_size - pp_rank, num_microbatches)
    chunks = min(2 * (pp_size - pp_rank - 1) + (vpp_size - 1) * pp_size + 1, num_microbatches * vpp_size)
    return chunks / vpp_size


__all__ = ["ActivationShape", "korthikanti_bytes", "layer_activation_bytes", "stage_activation_bytes",
           "mtp_activation_bytes",
           "embedding_activation_bytes", "output_activation_bytes", "in_flight_microbatches"]
