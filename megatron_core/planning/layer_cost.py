"""Seconds of one transformer layer's forward on one rank, split into parts a user can check against a
profiler: the linear GEMMs, core attention, element-wise (memory-bound) ops and collectives.

Per layer and micro-batch on a rank of tp ``t``, cp ``c`` (``T = b s / c`` tokens, ``T / t`` under sequence
parallelism for the norms and residuals), with ``q = a d`` query and ``k = g d`` key/value channels:

    QKV   2 T h (q + 2k) / t FLOPs at the efficiency of (T, h, (q + 2k) / t)
    proj  2 T q h / t                          (T, q / t, h)
    fc1   2 T h f_in / t                       (T, h, f_in / t)     f_in = 2 f gated (SwiGLU), else f
    fc2   2 T f h / t                          (T, f / t, h)
    core  4 b (a / t) (s / c) s d              (s / c, s, d)        the FLOPs formula's full s^2 (as MFU's);
                                                                    half of it with flash attention (causal);
                                                                    a layer's sliding window of w keys: s
                                                                    becomes w - w (w - 1) / 2s   (., w, d)

An MoE layer replaces fc1/fc2 by its experts (each rank's experts see ``etp T topk`` assignments, per expert
``ep etp T topk / E``: few tokens, low efficiency) and the shared expert; multi-latent attention's linears
take the FLOPs of ``training.metrics.attention_flops_ratio``. Element-wise bytes per forward: two norms and
two bias-dropout-adds (``10 h`` per token and element, plus dropout masks), rope on q and k, the activation
(``f_in + f``), the MoE permutation; without flash attention the softmax's ``s^2`` scores (write, read,
write, read). Backward: twice the forward's GEMMs and bytes; core attention's is 2.5 times its forward with
flash attention, which recomputes the scores (``attention_backward_ratio``).

Flash attention with the causal mask computes only the score tiles on or below the diagonal, ``s (s + 1) / 2``
of the ``s^2`` query-key pairs, and skips the rest (FlashAttention-2, Dao 2023, which counts causal FLOPs at
half; torch's CPU kernel too: causal takes 0.63x the time of unmasked forward, 0.67x forward + backward, at
s 2048 here; with cp's load-balanced split each rank's share is also half), so its time is that of half the
formula's FLOPs. Its backward runs five GEMMs to the forward's two (``Q K^T`` again, ``dV``, ``dP``, ``dQ``,
``dK``): 2.5 times the forward's FLOPs (the FlashAttention-2 paper's count). Without
flash attention the unfused path computes every score and masks them after (``baddbmm`` then the masked
softmax), and backward reuses the saved probabilities: the full ``s^2``, backward twice the forward.

Tensor-parallel traffic: the two all-reduces (or all-gather + reduce-scatter pairs under SP) of ``[T, h]``
forward, two backward (under SP three: ``tp_backward_exposed``); under ``tp_comm_overlap`` each in k chunks
(a latency each, or the profile's ``chunk_latency_us`` for each further one), run beside the GEMMs
(``tp_overlap_exposed``). Under SP with a per-tensor FP8 recipe the FP8 layers' QKV and fc1 inputs are gathered
as 1-byte FP8 (``fp8.linear``, as Transformer Engine does): two of the forward's four collectives at 1 byte per
element; backward's collectives by their own dtypes (``tp_backward_shares``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

from megatron_core.config import TransformerConfig
from megatron_core.planning.fp8 import gathers_fp8_inputs, saves_fp8_inputs
from megatron_core.planning.hardware import Hardware, gemm_efficiency
from megatron_core.tensor_parallel.comm_overlap import DEFAULT_NUM_CHUNKS, usable_chunks
from megatron_core.training.metrics import attention_flops_ratio


def _sequence_parallel(config: TransformerConfig) -> bool:
    """Whether the layers run sequence-parallel: ``--sequence-parallel`` at tp > 1."""
    return bool(config.sequence_parallel) and (config.tensor_model_parallel_size or 1) > 1


def tp_overlap_chunks(config: TransformerConfig, tokens: float) -> int:
    """Chunks each sequence-parallel collective is cut into under ``tp_comm_overlap`` (``comm_overlap.
    usable_chunks`` of the rank's ``tokens / t`` rows), 1 without it."""
    if not (config.tp_comm_overlap and _sequence_parallel(config)):
        return 1
    return usable_chunks(int(tokens // config.tensor_model_parallel_size), DEFAULT_NUM_CHUNKS)


def tp_overlap_exposed(config: TransformerConfig, hardware: Hardware, *, tp: float, gemm: float,
                       tokens: float) -> float:
    """What stays of ``tp`` seconds of sequence-parallel collectives beside ``gemm`` seconds of the layers' GEMMs
    under ``tp_comm_overlap`` (``tensor_parallel.comm_overlap``): each collective is cut into k chunks and the
    GEMM of the rows already present runs meanwhile; the last chunk's GEMM waits for its collective, so at most
    ``(k - 1) / k`` of the GEMM time hides communication, times the profile's ``comm_overlap`` (the share of
    traffic that runs beside compute: 1 on a GPU, 0 on a CPU, whose gloo threads share the cores)."""
    if not (config.tp_comm_overlap and _sequence_parallel(config)):
        return tp
    return max(tp - hardware.comm_overlap * (1 - 1 / tp_overlap_chunks(config, tokens)) * gemm, 0.0)


def _fp8_gather_bytes(config: TransformerConfig) -> float:
    """Bytes per element of an FP8 layer's sequence-parallel gather, averaged over the layers (1 in the FP8
    layers, ``e`` in those ``--first-last-layers-bf16`` keeps in high precision)."""
    e = element_bytes(config)
    return e - _fp8_layer_share(config, None) * (e - 1)


def tp_backward_shares(config: TransformerConfig) -> tuple[float, float]:
    """``(row, column)``: the bytes of a layer's backward tp collectives under SP over its forward's, by
    dtype. Forward: QKV's and fc1's input all-gathers (1 byte per element in the FP8 layers under a per-tensor
    recipe, ``e`` otherwise) and proj's and fc2's reduce-scatters (``e``). Backward: the row layers' output-grad
    all-gathers, in ``e`` on the plain path (its sequence-parallel region gathers dy before the FP8 GEMM
    quantizes it) and in 1-byte FP8 under ``tp_comm_overlap`` (``fp8.comm_overlap``); the column layers' saved
    inputs gathered again (FP8 bytes where the FP8 linear saves its input in FP8) and their input grads
    reduce-scattered (``e``). bf16: ``(0.5, 1)``; plain FP8 SP ``(2/3, 1)``; FP8 overlap ``(1/3, 1)``."""
    e, fp8_bytes = element_bytes(config), _fp8_gather_bytes(config)
    gathered = fp8_bytes if gathers_fp8_inputs(config) else e
    saved = fp8_bytes if saves_fp8_inputs(config) else e
    output_grad = fp8_bytes if saves_fp8_inputs(config) and config.tp_comm_overlap else e
    forward = 2 * gathered + 2 * e
    return 2 * output_grad / forward, (2 * saved + 2 * e) / forward


def tp_backward_seconds(config: TransformerConfig, tp: float) -> float:
    """The backward's tp collectives of layers whose forward ones take ``tp`` seconds, none hidden: as many
    all-reduces without SP, ``tp_backward_shares`` of forward's bytes with it."""
    return sum(tp_backward_shares(config)) * tp if _sequence_parallel(config) else tp


def overlap_tax(hardware: Hardware, hidden: float) -> float:
    """What ``hidden`` seconds of communication beside compute cost that compute: its collectives hold
    ``collective_sms`` of the device's ``sm_count`` SMs while they run (0 without an SM count: a CPU)."""
    return hidden * hardware.collective_sms / hardware.sm_count if hardware.sm_count else 0.0


def tp_backward_exposed(config: TransformerConfig, hardware: Hardware, *, tp: float, gemm: float,
                        column_gemm: float, tokens: float) -> float:
    """What the backward's tp collectives leave exposed, for layers whose forward collectives take ``tp`` and
    forward GEMMs ``gemm`` (of which ``column_gemm`` the column-parallel layers'). Without SP: the column layers'
    input-grad all-reduces, as many as forward's. With SP (``tp_backward_shares`` of forward's bytes; 1.5 times
    them in bf16): the row layers' all-gathers of the output grad, which their GEMMs wait for, and the column
    layers' all-gather of the saved input and reduce-scatter of the input grad, which run asynchronously beside
    the input- and weight-gradient GEMMs (``tensor_parallel.sequence_parallel_linear``; times the profile's
    ``comm_overlap``); under ``tp_comm_overlap`` all of them in chunks beside the backward's GEMMs
    (``tp_overlap_exposed``)."""
    if not _sequence_parallel(config):
        return tp
    row, column = tp_backward_shares(config)
    if config.tp_comm_overlap:
        return tp_overlap_exposed(config, hardware, tp=(row + column) * tp, gemm=2 * gemm, tokens=tokens)
    return row * tp + max(column * tp - hardware.comm_overlap * 2 * column_gemm, 0.0)


def attention_backward_ratio(flash: bool) -> float:
    """Core attention's backward over its forward: 2.5 with flash attention (the scores recomputed), else 2."""
    return 2.5 if flash else 2.0


@dataclasses.dataclass(frozen=True)
class ForwardCost:
    """Seconds of one layer's forward per micro-batch on one rank, by part."""

    gemm: float
    attention: float
    elementwise: float
    tp: float
    scores: float = 0.0
    """Of ``elementwise``: the unfused softmax's ``s^2`` scores (selective recompute runs them again)."""
    column_gemm: float = 0.0
    """Of ``gemm``: the column-parallel layers' (QKV, and fc1 in a dense layer)."""


def collective_seconds(volume_bytes: float, *, span: int, hardware: Hardware, count: int = 1,
                       ring_ranks: int = 0, steps: str = "") -> float:
    """``count`` collectives moving ``volume_bytes`` per rank in total over a group spanning ``span``
    consecutive ranks: latency plus bytes over the link's bus bandwidth.

    ``ring_ranks``: the group's size, for NCCL's ring collectives (all-reduce, reduce-scatter, all-gather). A
    group with k ranks on each node it straddles runs k rings at once, each crossing between nodes on another
    rank's NIC (NCCL's channels on a rail-per-GPU fabric), so its bus bandwidth is k times one device's
    inter-node bandwidth, up to NVLink's: nccl-tests measure ~45 GB/s at 4 and ~90 at 8 GPUs per node on the
    same NICs (NVIDIA/nccl#1168), ~320 GB/s on 8 x 400 Gb/s H100 nodes (nccl#1221), "up to the NVLink
    bandwidth" with a NIC per GPU (nccl#412). Point-to-point traffic (pp sends, cp's ring, all-to-all) leaves
    it 0: each rank's bytes cross on its own NIC. A group whose span is not whole nodes (tp 6) has a node with
    fewer ranks (as few as one): it keeps one device's bandwidth.

    ``steps`` (``"all_reduce"`` or ``"gather"``: all-gather / reduce-scatter), with ``ring_ranks``: each of the
    ``count`` collectives between nodes also pays its steps' latency (``ring_steps_seconds``)."""
    if volume_bytes <= 0:
        return 0.0
    intra = span <= hardware.devices_per_node and hardware.devices_per_node % span == 0  # else it straddles nodes
    gbps = hardware.intra_node_bandwidth_gbps if intra else hardware.inter_node_bandwidth_gbps
    latency = hardware.intra_node_latency_us if intra else hardware.inter_node_latency_us
    if not intra and ring_ranks and span % hardware.devices_per_node == 0:  # a ring over whole nodes
        nodes = span // hardware.devices_per_node
        rails = max(1, ring_ranks // nodes)  # the group's ranks on each node
        gbps = min(hardware.intra_node_bandwidth_gbps, rails * hardware.inter_node_bandwidth_gbps)
        if steps:
            latency += 1e6 * ring_steps_seconds(hardware, ring_ranks, nodes, all_reduce=steps == "all_reduce")
    return count * latency * 1e-6 + volume_bytes / (gbps * 1e9)


def all_to_all_seconds(volume_bytes: float, *, ranks: int, span: int, hardware: Hardware, count: int = 1) -> float:
    """``count`` all-to-alls in which each of ``ranks`` ranks (spread evenly over ``span`` consecutive ranks)
    sends ``volume_bytes`` in total, an equal share to every other rank. Inside a node it is one collective
    over NVLink; across nodes each rank's shares for its own node's ranks go over NVLink while those for other
    nodes go over its NIC, at once, so the slower of the two sets the time (NCCL's all-to-all is point-to-point
    sends to each peer, each over the link that reaches it)."""
    if volume_bytes <= 0 or ranks <= 1:
        return 0.0
    nodes = -(-span // hardware.devices_per_node)
    if nodes == 1:
        return collective_seconds(volume_bytes, span=span, hardware=hardware, count=count)
    local = ranks // nodes - 1  # peers on this rank's node
    remote = ranks - 1 - local
    seconds = max(volume_bytes * local / (ranks - 1) / (hardware.intra_node_bandwidth_gbps * 1e9),
                  volume_bytes * remote / (ranks - 1) / (hardware.inter_node_bandwidth_gbps * 1e9))
    return count * hardware.inter_node_latency_us * 1e-6 + seconds


def ring_steps_seconds(hardware: Hardware, ranks: int, nodes: int, *, all_reduce: bool) -> float:
    """The step latency of one collective of ``ranks`` over ``nodes`` nodes, as NCCL's tuning model counts it
    (``tuning.cc``): a ring all-gather or reduce-scatter takes ``ranks - 1`` steps, ``nodes - 1`` of them over
    the network; an all-reduce the tree's ``2 (ranks per node - 1)`` NVLink and ``2 log2(nodes)`` network steps
    (across two or more nodes never more than the ring's twice ``ranks - 1``, so NCCL's latency is the tree's)."""
    a, b = hardware.ring_step_latency_us, hardware.net_step_latency_us
    if all_reduce:
        return 1e-6 * 2 * ((ranks // nodes - 1) * a + math.ceil(math.log2(nodes)) * b)
    return 1e-6 * ((ranks - nodes) * a + (nodes - 1) * b)


def _gemm_seconds(flops: float, hardware: Hardware, *dims: float) -> float:
    return flops / (hardware.peak_tflops * 1e12 * gemm_efficiency(hardware, *dims))


def bytes_seconds(nbytes: float, hardware: Hardware) -> float:
    """Seconds to stream ``nbytes`` through device memory (0 when the profile has no memory bandwidth)."""
    return nbytes / (hardware.memory_bandwidth_gbps * 1e9) if hardware.memory_bandwidth_gbps else 0.0


def element_bytes(config: TransformerConfig) -> int:
    return 2 if (config.bf16 or config.fp16) else 4


class _Gemm(NamedTuple):
    """The GEMMs of one linear on a rank: ``flops`` in all, each of ``dims`` (m, k, n), ``copies`` of them
    (the rank's local experts: ``E / ep``; else 1)."""

    flops: float
    dims: tuple
    copies: float = 1.0

    def quantized_elements(self) -> float:
        """Elements an FP8 GEMM quantizes: every copy's input (m x k) and weight (k x n)."""
        m, k, n = self.dims
        return self.copies * (m * k + k * n)


def _attention_linears(config: TransformerConfig, tokens: float, t: int) -> list[_Gemm]:
    h = config.hidden_size
    if config.multi_latent_attention:  # linear FLOPs of the formula (core attention left out), over tp
        ratio = attention_flops_ratio(config, 0)
        rank = config.kv_lora_rank
        return [_Gemm(2.0 * tokens * 2 * h * h * ratio / t, (tokens, h, rank))]
    q = config.kv_channels * config.num_attention_heads
    k = config.kv_channels * config.num_query_groups
    return [_Gemm(2.0 * tokens * h * (q + 2 * k) / t, (tokens, h, (q + 2 * k) / t)),
            _Gemm(2.0 * tokens * q * h / t, (tokens, q / t, h))]


def _mlp_linears(config: TransformerConfig, tokens: float, t: int, *, moe_layer: bool, ep: int,
                 etp: int) -> list[_Gemm]:
    h, gated = config.hidden_size, 2 if config.gated_activation else 1
    if not moe_layer:
        f = config.ffn_hidden_size
        return [_Gemm(2.0 * tokens * h * gated * f / t, (tokens, h, gated * f / t)),
                _Gemm(2.0 * tokens * f * h / t, (tokens, f / t, h))]
    moe = config.moe
    f = moe.moe_ffn_hidden_size or config.ffn_hidden_size
    routed = (tokens / t if config.sequence_parallel else tokens) * moe.moe_router_topk
    per_expert = ep * etp * routed / moe.num_moe_experts
    local_experts = moe.num_moe_experts / ep
    gemms = [_Gemm(2.0 * routed * h * gated * f, (per_expert, h, gated * f / etp), local_experts),
             _Gemm(2.0 * routed * f * h, (per_expert, f / etp, h), local_experts),
             _Gemm(2.0 * routed / moe.moe_router_topk * h * moe.num_moe_experts, (tokens, h, moe.num_moe_experts))]
    shared = moe.moe_shared_expert_intermediate_size or 0
    if shared:
        gemms += [_Gemm(2.0 * tokens * h * gated * shared / t, (tokens, h, gated * shared / t)),
                  _Gemm(2.0 * tokens * shared * h / t, (tokens, shared / t, h))]
    return gemms


def _attended_keys(config: TransformerConfig, seq_length: int, flash: bool) -> list[tuple[float, float, float]]:
    """(keys each query's scores are computed against on average, the key span the kernel's tiles cover, the
    share of the layers). Causal under flash attention: ``s / 2`` (the tiles above the diagonal are skipped);
    the unfused path: all ``s``. A sliding window of ``w`` keys (``config.window_for``; Megatron's
    ``--window-size w-1,0``), run on the block kernels that skip the tiles outside its band
    (``transformer.attention_variants``): ``w - w (w - 1) / 2s``, the first ``w`` queries seeing fewer (as
    Megatron-Bridge's FLOPs count for gpt-oss)."""
    full = (seq_length / 2 if flash else seq_length, seq_length)
    if config.window_size is None:
        return [(*full, 1.0)]
    shares: dict[tuple[float, float], float] = {}
    for number in range(1, config.num_layers + 1):
        left = (config.window_for(number) or (-1,))[0]
        width = left + 1
        keys = (width - width * (width - 1) / (2 * seq_length), width) if 0 < width < seq_length else full
        shares[keys] = shares.get(keys, 0.0) + 1 / config.num_layers
    return [(*keys, share) for keys, share in shares.items()]


def _elementwise_bytes(config: TransformerConfig, tokens: float, t: int, *, flash: bool, moe_layer: bool,
                       micro_batch_size: int, seq_length: int, cp: int, mask_bytes: int) -> float:
    e, h = element_bytes(config), config.hidden_size
    sp_tokens = tokens / t if config.sequence_parallel else tokens
    q = config.kv_channels * config.num_attention_heads
    k = config.kv_channels * config.num_query_groups
    gated = 2 if config.gated_activation else 1
    f = (config.moe.moe_ffn_hidden_size or config.ffn_hidden_size) if moe_layer else config.ffn_hidden_size
    per_token = 10 * h * e + (2 * h * mask_bytes if config.hidden_dropout > 0 else 0)
    nbytes = sp_tokens * per_token
    if config.position_embedding_type == "rope":
        nbytes += tokens * 2 * (q + k) / t * e
    if moe_layer:
        routed = sp_tokens * config.moe.moe_router_topk
        nbytes += routed * (gated * f + f) * e + 4 * routed * h * e  # activation + permute / unpermute
    else:
        nbytes += tokens * (gated * f + f) / t * e
    return nbytes + _scores_bytes(config, t, flash=flash, micro_batch_size=micro_batch_size, seq_length=seq_length,
                                  cp=cp, mask_bytes=mask_bytes)


def _scores_bytes(config: TransformerConfig, t: int, *, flash: bool, micro_batch_size: int, seq_length: int,
                  cp: int, mask_bytes: int) -> float:
    """Without flash attention: the scores written, read by softmax, the probabilities written (and dropped
    out), read by the value GEMM."""
    if flash:
        return 0.0
    scores = micro_batch_size * config.num_attention_heads / t * seq_length / cp * seq_length
    e = element_bytes(config)
    return scores * (4 * e + (2 * mask_bytes + e if config.attention_dropout > 0 else 0))


def _fp8_layer_share(config: TransformerConfig, hardware: Optional[Hardware]) -> float:
    """The fraction of layers whose linears run in FP8 (0 without ``config.fp8`` or, given ``hardware``, an FP8
    peak in its profile; ``--first-last-layers-bf16`` keeps some in high precision)."""
    fp8 = getattr(config, "fp8", None)
    if fp8 is None or (hardware is not None and not hardware.fp8_peak_tflops):
        return 0.0
    layers = config.num_layers
    return sum(fp8.applies_to_layer(n, layers) for n in range(1, layers + 1)) / layers


def layer_forward_cost(config: TransformerConfig, hardware: Hardware, *, micro_batch_size: int, seq_length: int,
                       moe_layer: bool = False, ep: int = 1, etp: int = 1, flash: bool = True,
                       mask_bytes: int = 1) -> ForwardCost:
    """One layer's forward on one rank of ``config``'s tp x cp (the config carries the layout's sizes)."""
    t, c = config.tensor_model_parallel_size or 1, config.context_parallel_size or 1
    tokens = micro_batch_size * seq_length / c
    gemms = _attention_linears(config, tokens, t) + _mlp_linears(config, tokens, t, moe_layer=moe_layer, ep=ep,
                                                                 etp=etp)
    gemm = sum(_gemm_seconds(g.flops, hardware, *g.dims) for g in gemms)
    attention_linears = len(_attention_linears(config, tokens, t))
    column_flops = gemms[0].flops + (0.0 if moe_layer else gemms[attention_linears].flops)
    column_share = column_flops / sum(g.flops for g in gemms)
    fp8_share = _fp8_layer_share(config, hardware)
    if fp8_share:  # FP8 GEMMs at the FP8 peak, plus quantizing each GEMM's input and weight (read e, write 1 B)
        fp8 = dataclasses.replace(hardware, peak_tflops=hardware.fp8_peak_tflops)
        quantize = (element_bytes(config) + 1) * sum(g.quantized_elements() for g in gemms)
        fp8_gemm = sum(_gemm_seconds(g.flops, fp8, *g.dims) for g in gemms) + bytes_seconds(quantize, hardware)
        gemm = fp8_share * fp8_gemm + (1 - fp8_share) * gemm
    if config.multi_latent_attention:
        d = config.qk_head_dim + config.qk_pos_emb_head_dim
        flops_per_key = 2.0 * config.num_attention_heads / t * tokens * (d + config.v_head_dim)
    else:
        d = config.kv_channels
        flops_per_key = 4.0 * config.num_attention_heads / t * tokens * d
    attention = sum(share * _gemm_seconds(flops_per_key * keys, hardware, tokens / micro_batch_size, span, d)
                    for keys, span, share in _attended_keys(config, seq_length, flash))
    elementwise = bytes_seconds(_elementwise_bytes(config, tokens, t, flash=flash, moe_layer=moe_layer,
                                                    micro_batch_size=micro_batch_size, seq_length=seq_length,
                                                    cp=c, mask_bytes=mask_bytes), hardware)
    scores = bytes_seconds(_scores_bytes(config, t, flash=flash, micro_batch_size=micro_batch_size,
                                          seq_length=seq_length, cp=c, mask_bytes=mask_bytes), hardware)
    tp = 0.0
    if t > 1:
        e = element_bytes(config)
        volume = 4 * (t - 1) / t * tokens * config.hidden_size * e
        if config.sequence_parallel and gathers_fp8_inputs(config):  # QKV's and fc1's all-gathers: 1 byte
            volume *= (_fp8_gather_bytes(config) + e) / (2 * e)
        chunks = tp_overlap_chunks(config, tokens) if config.sequence_parallel else 1
        count = 4 * chunks if config.sequence_parallel else 2
        further = 0.0
        if hardware.chunk_latency_us is not None:  # a collective's chunks share its latency, each adds this
            count, further = count // chunks, 4 * (chunks - 1) * hardware.chunk_latency_us * 1e-6
        tp = collective_seconds(volume, span=t, hardware=hardware, count=count, ring_ranks=t) + further
    return ForwardCost(gemm=gemm, attention=attention, elementwise=elementwise, tp=tp, scores=scores,
                       column_gemm=column_share * gemm)


def elementwise_layer_bytes(config: TransformerConfig, *, micro_batch_size: int, seq_length: int, flash: bool = True,
                            mask_bytes: int = 1) -> float:
    """The element-wise bytes of one dense layer's forward on one rank (what ``layer_forward_cost`` divides by
    the memory bandwidth)."""
    t, c = config.tensor_model_parallel_size or 1, config.context_parallel_size or 1
    return _elementwise_bytes(config, micro_batch_size * seq_length / c, t, flash=flash, moe_layer=False,
                              micro_batch_size=micro_batch_size, seq_length=seq_length, cp=c, mask_bytes=mask_bytes)


def output_layer_forward_seconds(config: TransformerConfig, hardware: Hardware, *, tokens: float,
                                 padded_vocab_size: int) -> tuple[float, float]:
    """(GEMM, element-wise) seconds of the last stage's output layer and fp32 cross-entropy forward."""
    t = config.tensor_model_parallel_size
    vocab = padded_vocab_size / t
    gemm = _gemm_seconds(2.0 * tokens * config.hidden_size * vocab, hardware, tokens, config.hidden_size, vocab)
    return gemm, bytes_seconds(tokens * vocab * (element_bytes(config) + 3 * 4), hardware)


__all__ = ["ForwardCost", "all_to_all_seconds", "attention_backward_ratio", "overlap_tax", "tp_backward_exposed",
           "tp_backward_seconds", "tp_backward_shares",
           "tp_overlap_chunks", "tp_overlap_exposed", "collective_seconds", "element_bytes", "elementwise_layer_bytes",
           "layer_forward_cost", "output_layer_forward_seconds", "bytes_seconds"]
