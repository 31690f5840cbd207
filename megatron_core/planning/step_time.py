"""Seconds of one training step at a layout, by part: what ``tools/plan_parallelism.py --explain`` prints.

Each pipeline stage's forward (F) and backward (B) of one micro-batch are summed from its layers
(``planning.layer_cost``: GEMMs at a shape-dependent efficiency, core attention, element-wise bytes, tp
collectives), its cp and ep traffic, full or selective recompute (one more forward in B), the fixed cost per
layer and the pipeline sends. The schedule's own order (``pipeline_parallel.schedule_plan``: 1F1B, interleaved
or zero bubble) is then simulated with those durations, so the bubble comes from the schedule that runs, with
uneven stages (the last holds the output layer and the loss). After the pipeline drains: the data-parallel
gradient reduction (minus what overlaps backward: the last micro-batch's at ZeRO 0-1, every micro-batch's at
ZeRO 2-3: ``--overlap-grad-reduce``), ZeRO's parameter gathers (at ZeRO 1-2 started after the step and
waited for by each module in the next step's first forward, ``--overlap-param-gather``; overlapped with
compute at ZeRO 3), the
optimizer step (memory-bound) and optimizer offload over PCIe. Parts are those of the busiest stage; they sum
to the step time.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from megatron_core.config import TransformerConfig
from megatron_core.distributed.ddp_config import DistributedDataParallelConfig
from megatron_core.pipeline_parallel.schedule_plan import (
    interleaved_ops,
    one_f_one_b_ops,
    pass_inputs,
    simulate,
    zero_bubble_ops,
)
from megatron_core.planning.fp8 import fp8_gathered_expert_parameters, fp8_gathered_parameters
from megatron_core.planning.hardware import Hardware
from megatron_core.planning.layer_cost import (
    all_to_all_seconds,
    attention_backward_ratio,
    bytes_seconds,
    collective_seconds,
    element_bytes,
    layer_forward_cost,
    output_layer_forward_seconds,
    overlap_tax,
    tp_backward_exposed,
    tp_backward_seconds,
    tp_overlap_exposed,
)
from megatron_core.planning.moe import ep_comm_bytes, etp_comm_bytes, moe_layers_on_stage, stage_layer_count
from megatron_core.training.metrics import recomputed_layers_per_chunk

PARTS = ("gemm", "attention", "elementwise", "recompute", "overhead", "overlap_tax", "tp", "cp", "ep", "pp", "bubble",
         "dp", "zero", "optimizer", "offload")
BUCKET_ELEMENTS = 40_000_000
"""Gradient bucket size the latency term counts (Megatron-LM's default of 40M elements)."""


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the busiest stage by part (``PARTS``), summing to ``total``."""

    parts: dict
    stage: int
    """The pipeline stage the parts describe (the busiest)."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def compute(self) -> float:
        return sum(self.parts[k] for k in ("gemm", "attention", "elementwise", "recompute", "overhead"))

    @property
    def comm(self) -> float:
        return sum(self.parts[k] for k in ("tp", "cp", "ep", "pp", "dp", "zero", "offload"))


def cp_comm_bytes(config: TransformerConfig, workload, layout) -> float:
    """Bytes one rank sends over cp in one micro-batch's forward and backward of one layer.

    p2p: cp - 1 hops of the ``[2, b, hk/t, s/cp, d]`` K/V block forward, again in backward plus cp hops of
    its fp32 dK/dV; a2a: Q, K, V and the output forward and their grads backward, each ``(cp - 1) / cp`` of
    the local tensor; allgather: K/V gathered forward, their grads reduce-scattered backward. Full recompute
    runs the forward's traffic again."""
    c, t = layout.cp, layout.tp
    if c == 1:
        return 0.0
    e = element_bytes(config)
    tokens = workload.seq_length / c * workload.micro_batch_size
    kv = 2 * tokens * config.kv_channels * config.num_query_groups / t  # K and V elements of the local block
    q = tokens * config.kv_channels * config.num_attention_heads / t
    forward_again = 1 if layout.recompute == "full" else 0
    if config.cp_comm_type in ("p2p", "a2a+p2p"):  # a2a+p2p: counted as the ring over all of cp (an upper bound)
        forward = (c - 1) * e * kv
        return (1 + forward_again) * forward + (c - 1) * e * kv + c * 4 * kv
    ring = (c - 1) / c
    if config.cp_comm_type == "a2a":
        forward = ring * e * (2 * q + kv)
        return (1 + forward_again) * forward + ring * e * (2 * q + kv)
    forward = ring * e * kv * c  # all-gather: receive the other ranks' K/V
    return (1 + forward_again) * forward + forward


def cp_comm_seconds(config: TransformerConfig, workload, layout, hardware: Hardware, num_microbatches: int) -> float:
    """Context-parallel seconds of one step, no overlap (cp groups span ``tp x cp`` consecutive ranks)."""
    return _cp_layer_seconds(config, workload, layout, hardware) * (config.num_layers // layout.pp) * num_microbatches


def _cp_layer_seconds(config: TransformerConfig, workload, layout, hardware: Hardware) -> float:
    """One layer's cp traffic per micro-batch, forward and backward (cp groups span ``tp x cp`` ranks)."""
    if layout.cp == 1:
        return 0.0
    return collective_seconds(cp_comm_bytes(config, workload, layout), span=layout.tp * layout.cp,
                              hardware=hardware, count=2 * (layout.cp - 1))


def _ep_layer_seconds(config: TransformerConfig, workload, layout, hardware: Hardware) -> float:
    tokens = (workload.seq_length / layout.cp * workload.micro_batch_size
              / (layout.tp if layout.sequence_parallel else 1))
    e, full = element_bytes(config), layout.recompute == "full"
    ep_bytes = ep_comm_bytes(config, tokens=layout.etp * tokens, element_bytes=e, ep=layout.ep, recompute_full=full)
    etp_bytes = etp_comm_bytes(config, tokens=tokens, element_bytes=e, etp=layout.etp, recompute_full=full)
    span = layout.ep * layout.etp
    ep_seconds = (all_to_all_seconds(ep_bytes, ranks=layout.ep, span=span, hardware=hardware, count=4)
                  if config.moe.moe_token_dispatcher_type == "alltoall"
                  else collective_seconds(ep_bytes, span=span, hardware=hardware, count=4))
    return ep_seconds + collective_seconds(etp_bytes, span=layout.etp, hardware=hardware, count=4,
                                           ring_ranks=layout.etp)


def ep_comm_seconds(config: TransformerConfig, workload, layout, hardware: Hardware, num_microbatches: int) -> float:
    """Expert-parallel seconds of one step: the dispatcher's traffic (``planning.moe.ep_comm_bytes``, ep groups
    spanning ``ep x etp`` consecutive ranks) and the expert-tp gathers (``etp_comm_bytes``) per MoE layer of
    the first stage and micro-batch."""
    layers = moe_layers_on_stage(config, pp_rank=0)
    if not layers:
        return 0.0
    return _ep_layer_seconds(config, workload, layout, hardware) * layers * num_microbatches


def _stage_microbatch(config: TransformerConfig, workload, layout, hardware: Hardware, pp_rank: int,
                      padded_vocab_size: int) -> dict:
    """(forward, backward) seconds of one micro-batch on stage ``pp_rank``, by part."""
    b, s = workload.micro_batch_size, workload.seq_length
    layers, moe_layers = stage_layer_count(config, pp_rank), moe_layers_on_stage(config, pp_rank=pp_rank)
    kw = dict(micro_batch_size=b, seq_length=s, flash=workload.flash_attention, mask_bytes=workload.mask_bytes)
    dense = layer_forward_cost(config, hardware, **kw)
    moe = layer_forward_cost(config, hardware, moe_layer=True, ep=layout.ep, etp=layout.etp, **kw) if moe_layers \
        else dense
    n_dense = layers - moe_layers

    def total(field: str) -> float:
        return n_dense * getattr(dense, field) + moe_layers * getattr(moe, field)

    gemm, attention, elementwise = total("gemm"), total("attention"), total("elementwise")
    tokens = b * s / layout.cp
    layer_tp = total("tp")
    tp = tp_overlap_exposed(config, hardware, tp=layer_tp, gemm=gemm, tokens=tokens)
    tp_backward = tp_backward_exposed(config, hardware, tp=layer_tp, gemm=gemm, column_gemm=total("column_gemm"),
                                      tokens=tokens)
    hidden_forward, hidden_backward = layer_tp - tp, tp_backward_seconds(config, layer_tp) - tp_backward
    if pp_rank == layout.pp - 1:
        out_gemm, out_bytes = output_layer_forward_seconds(config, hardware, tokens=b * s / layout.cp,
                                                           padded_vocab_size=padded_vocab_size)
        gemm, elementwise = gemm + out_gemm, elementwise + out_bytes
    if layout.tp > 1:  # the embedding's, the output layer's and the loss's collectives (outside the layers)
        edge = _edge_tp_seconds(config, hardware, layout, tokens=b * s / layout.cp, first=pp_rank == 0,
                                last=pp_rank == layout.pp - 1)
        tp, tp_backward = tp + edge[0], tp_backward + edge[1]
    chunks = layout.pp * (layout.vpp or 1)
    recomputed = recomputed_layers_per_chunk(config, config.num_layers // chunks) * (layout.vpp or 1)
    layer_forward = (dense.gemm + dense.attention + dense.elementwise) if layers else 0.0
    recompute = (recomputed * layer_forward if layout.recompute == "full"
                 else attention + total("scores") if layout.recompute == "selective" else 0.0)
    tp_again = 0.0
    if layout.recompute == "full":
        tp_again = recomputed * tp_overlap_exposed(config, hardware, tp=dense.tp, gemm=dense.gemm, tokens=tokens)
        hidden_backward += recomputed * dense.tp - tp_again
    overhead = layers * hardware.layer_overhead_us * 1e-6 * (1 + (recomputed / max(layers, 1) / 3))
    cp_layer = _cp_layer_seconds(config, workload, layout, hardware)
    backward_ratio = attention_backward_ratio(workload.flash_attention)
    core = dense.attention * (1 + backward_ratio)
    cp = layers * max(cp_layer - hardware.comm_overlap * min(cp_layer, core), 0.0)
    cp_hidden = layers * cp_layer - cp
    hidden_forward, hidden_backward = hidden_forward + cp_hidden / 3, hidden_backward + cp_hidden * 2 / 3
    ep = moe_layers * _ep_layer_seconds(config, workload, layout, hardware) if moe_layers else 0.0
    pp = 0.0
    if layout.pp > 1:
        activation = element_bytes(config) * b * s / layout.cp * config.hidden_size / (
            layout.tp if layout.sequence_parallel else 1)
        pp = (layout.vpp or 1) * collective_seconds(activation, span=2 * layout.tp * layout.cp * layout.dp,
                                                    hardware=hardware)
    return {"gemm": (gemm, 2 * gemm), "attention": (attention, backward_ratio * attention),
            "elementwise": (elementwise, 2 * elementwise), "recompute": (0.0, recompute),
            "overhead": (overhead / 3, overhead * 2 / 3), "tp": (tp, tp_backward + tp_again),
            "overlap_tax": (overlap_tax(hardware, hidden_forward), overlap_tax(hardware, hidden_backward)),
            "cp": (cp / 3, cp * 2 / 3),
            "ep": (ep / 3, ep * 2 / 3), "pp": (pp, pp)}


def _edge_tp_seconds(config: TransformerConfig, hardware: Hardware, layout, *, tokens: float, first: bool,
                     last: bool) -> tuple[float, float]:
    """(forward, backward) tp seconds of one micro-batch outside the layers: the vocab-parallel embedding's
    all-reduce (reduce-scatter under SP) on the first stage; on the last, the output layer's input all-gathered
    (SP; its grad reduce-scattered in backward) or its grad all-reduced, and the vocab-parallel loss's three
    small all-reduces (max, sum of exponentials, target logit)."""
    t, e, h = layout.tp, element_bytes(config), config.hidden_size
    sp = layout.sequence_parallel
    activation = (t - 1) / t * tokens * h * e * (1 if sp else 2)
    forward = backward = 0.0
    if first:
        forward += collective_seconds(activation, span=t, hardware=hardware, ring_ranks=t)
    if last:
        loss = collective_seconds(3 * 4 * tokens, span=t, hardware=hardware, count=3, ring_ranks=t)
        forward += loss + (collective_seconds(activation, span=t, hardware=hardware, ring_ranks=t) if sp else 0.0)
        backward += collective_seconds(activation, span=t, hardware=hardware, ring_ranks=t)
    return forward, backward


@functools.lru_cache(maxsize=256)
def _orders(pp: int, vpp: int, m: int, zero_bubble: bool) -> tuple:
    """(every rank's pass order of the schedule, each pass's inputs): shared by the layouts of one pp, vpp
    and m."""
    if vpp > 1:
        orders = [interleaved_ops(r, pp, vpp, m) for r in range(pp)]
    elif zero_bubble:
        orders = [zero_bubble_ops(r, pp, m, defer="all") for r in range(pp)]
    else:
        orders = [one_f_one_b_ops(r, pp, m) for r in range(pp)]
    return orders, pass_inputs(orders, vpp)


@functools.lru_cache(maxsize=4096)
def _makespan(pp: int, vpp: int, m: int, zero_bubble: bool, forward: tuple, backward: tuple) -> float:
    """Finish time of the simulated schedule with per-stage chunk durations (``m`` small: see ``pipeline``).
    Zero bubble: a split backward's B (input grads) and W (weight grads) take half a backward each."""
    times = [(f, x / 2, x / 2) if zero_bubble else (f, x, 0.0) for f, x in zip(forward, backward)]
    orders, inputs = _orders(pp, vpp, m, zero_bubble)
    return max(simulate(orders, vpp, rank_times=times, inputs=inputs))


def pipeline_seconds(forward: list, backward: list, *, num_microbatches: int, vpp: int = 1,
                     zero_bubble: bool = False) -> float:
    """Time for the pipeline to run ``num_microbatches`` when stage r's forward / backward of one micro-batch
    take ``forward[r]`` / ``backward[r]`` (split evenly over its ``vpp`` chunks). The schedule is simulated
    for up to 2 pp micro-batches; each further one adds the slowest stage's forward + backward (the steady
    state of 1F1B and interleaved alike)."""
    pp, m = len(forward), num_microbatches
    if pp == 1:
        return m * (forward[0] + backward[0])
    simulated = min(m, 2 * pp)
    if vpp > 1:
        simulated = m if m < 2 * pp else 2 * pp
    chunk_f = tuple(round(f / vpp, 12) for f in forward)
    chunk_b = tuple(round(x / vpp, 12) for x in backward)
    span = _makespan(pp, vpp, simulated, zero_bubble, chunk_f, chunk_b)
    return span + (m - simulated) * max(f + x for f, x in zip(forward, backward))


def _dp_parts(params: float, ranks: int, zero_stage: int, m: int, element: int, span: int, hardware: Hardware,
              units: int, fp8_gathered: float = 0.0, grad_bytes: int = 4) -> tuple[float, float, float]:
    """(gradient-reduction seconds, parameter-gather seconds after the step, overlappable gathers) for
    ``params`` over ``ranks``: one collective per bucket (the wrapper's bucket size; at ZeRO 3 one per unit,
    ``units`` of them) per step, or per micro-batch from ZeRO 2 on. ``fp8_gathered`` of the parameters go as
    1 byte each in the parameter gathers (``--fp8-param-gather``: after the step at ZeRO 1-2, each unit's
    forward and backward gathers at ZeRO 3)."""
    if ranks == 1 or not params:
        return 0.0, 0.0, 0.0
    bucket = DistributedDataParallelConfig(zero_stage=zero_stage).resolved_bucket_size(ranks, total_numel=int(params))
    ring, buckets = (ranks - 1) / ranks, units if zero_stage == 3 else max(1, math.ceil(params / bucket))
    grads = grad_bytes * params  # fp32, or the 16-bit dtype with --grad-reduce-in-bf16
    per_step = zero_stage < 2  # ZeRO 0 all-reduces (twice the bytes), 1 reduce-scatters once, 2-3 per micro-batch
    volume = 2 if zero_stage == 0 else 1 if per_step else m
    reduce = collective_seconds(volume * ring * grads, span=span, hardware=hardware,
                                count=buckets * (1 if per_step else m), ring_ranks=ranks,
                                steps="all_reduce" if zero_stage == 0 else "gather")
    gather_after = gather_during = 0.0
    gather_bytes = element * params - (element - 1) * fp8_gathered
    if zero_stage in (1, 2):
        gather_after = collective_seconds(ring * gather_bytes, span=span, hardware=hardware, count=buckets,
                                           ring_ranks=ranks, steps="gather")
    elif zero_stage == 3:
        gather_during = collective_seconds(2 * m * ring * gather_bytes, span=span, hardware=hardware,
                                           count=2 * m * buckets, ring_ranks=ranks, steps="gather")
    return reduce, gather_after, gather_during


def offload_seconds(optimizer_params: float, hardware: Hardware) -> float:
    """Optimizer offload's PCIe traffic per step: the shard's fp32 gradients to the host, its 16-bit
    parameters back."""
    return 6 * optimizer_params / (hardware.pcie_bandwidth_gbps * 1e9)


def step_time(config: TransformerConfig, workload, layout, hardware: Hardware, *, num_microbatches: int,
              padded_vocab_size: int, stage_params: list, optimizer_params: float, offload: bool = False) -> StepTime:
    """The step at ``layout`` (``config`` carries its sizes): ``stage_params[r]`` = (dense, expert) parameters
    on a rank of stage r; ``optimizer_params`` = the parameters whose update the busiest rank computes
    (its ZeRO shard); ``offload``: the optimizer states live on the host (their traffic over PCIe)."""
    m, pp = num_microbatches, layout.pp
    stages = [_stage_microbatch(config, workload, layout, hardware, r, padded_vocab_size) for r in range(pp)]
    forward = [sum(f for f, _ in stage.values()) for stage in stages]
    backward = [sum(x for _, x in stage.values()) for stage in stages]
    busiest = max(range(pp), key=lambda r: forward[r] + backward[r])
    parts = {name: m * sum(stages[busiest][name]) for name in stages[busiest]}
    zero_bubble = getattr(layout, "zero_bubble", False)
    span = pipeline_seconds(forward, backward, num_microbatches=m, vpp=layout.vpp or 1, zero_bubble=zero_bubble)
    parts["bubble"] = max(span - m * (forward[busiest] + backward[busiest]), 0.0)
    dense, experts = stage_params[busiest]
    e, group_span = element_bytes(config), layout.tp * layout.cp * layout.dp
    layers = stage_layer_count(config, busiest)
    units = 4 * layers + 2  # ZeRO 3 gathers: QKV, proj, fc1, fc2 per layer (norms and biases ride along), plus the
    reduce, after, during = (sum(x) for x in zip(  # embedding and output layer
        _dp_parts(dense, layout.dp * layout.cp, layout.zero_stage, m, e, group_span, hardware, units,
                  fp8_gathered_parameters(config, pp_rank=busiest), workload.grad_bytes),
        _dp_parts(experts, layout.expert_dp, layout.zero_stage, m, e, group_span, hardware,
                  moe_layers_on_stage(config, pp_rank=busiest),
                  fp8_gathered_expert_parameters(config, pp_rank=busiest, ep=layout.ep, etp=layout.etp),
                  workload.grad_bytes)))
    window = backward[busiest] * (m if layout.zero_stage >= 2 else 1)
    parts["dp"] = max(reduce - hardware.comm_overlap * min(reduce, window), 0.0)
    compute = m * (forward[busiest] + backward[busiest])
    during_exposed = max(during - hardware.comm_overlap * min(during, max(compute - window, 0.0)), 0.0)
    after_exposed = max(after - hardware.comm_overlap * min(after, forward[busiest]), 0.0)
    parts["zero"] = after_exposed + during_exposed
    hidden = (reduce - parts["dp"]) + (during - during_exposed) + (after - after_exposed)
    parts["overlap_tax"] += overlap_tax(hardware, hidden)
    update_bytes = 32 if (config.bf16 or config.fp16) else 28  # read p, g, master, m, v; write p, master, m, v
    parts["optimizer"] = bytes_seconds(update_bytes * optimizer_params, hardware)
    parts["offload"] = offload_seconds(optimizer_params, hardware) if offload else 0.0
    return StepTime(parts={name: parts.get(name, 0.0) for name in PARTS}, stage=busiest)


__all__ = ["PARTS", "StepTime", "cp_comm_bytes", "cp_comm_seconds", "ep_comm_seconds", "offload_seconds",
           "pipeline_seconds", "step_time"]
