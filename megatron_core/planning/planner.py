"""Per-rank memory and step time of every valid parallel layout of a GPT, ranked (the model behind
``tools/plan_parallelism.py``).

Memory per rank = model states (parameters, gradients, fp32 master weights, Adam states, each sharded as the
ZeRO stage says) + activations (``activations.stage_activation_bytes``: Korthikanti et al. per layer with SP
and recompute, times the micro-batches a 1F1B stage holds) + what coexists with them at the peak moment
(``peak_phases``: the loss's logits gradient, or the output layer's, a layer's or the embedding's backward
with ``zero_memory``'s gathered parameters, buckets and grads). Step time = compute (hardware FLOPs, recompute
included, over ``peak x efficiency``) and tensor-parallel collectives, stretched by the pipeline bubble
``(p - 1) / (v m)``, plus pipeline sends and data-parallel collectives (ring volumes over the link bandwidth;
nothing assumed overlapped). Context parallelism (``Layout.cp``, the comm type from the base config's
``cp_comm_type``) splits every sequence over cp ranks: activations per rank count ``s / cp`` tokens, ZeRO
shards over dp x cp (the gradient reduction's ``dp_cp_group``), and its K/V ring, all-to-alls or all-gathers
add their volume to the step time. Ranks are ordered tp-cp-dp-pp (tp fastest), so a group stays inside a node when
its span of consecutive ranks does.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Optional

from megatron_core.config import TransformerConfig
from megatron_core.pipeline_parallel.layout import split_chunk_counts
from megatron_core.planning.activations import ActivationShape, in_flight_microbatches, stage_activation_bytes
from megatron_core.planning.choose import choose_plan
from megatron_core.planning.fp8 import fp8_layers_on_stage
from megatron_core.planning.hardware import Hardware
from megatron_core.planning.inputs import RECOMPUTE_CHOICES, Layout, SearchSpace, Workload, grad_bytes_of
from megatron_core.planning.moe import (
    assignments,
    expert_ffn,
    moe_layers_on_stage,
    stage_layer_count,
)
from megatron_core.planning.parameters import stage_expert_parameters, stage_parameters
from megatron_core.planning.peak_phases import StageMoments, mlp_backward, peak_extra_bytes
from megatron_core.planning.step_time import (
    StepTime,
    cp_comm_bytes,
    cp_comm_seconds,
    ep_comm_seconds,
    offload_seconds,
    step_time,
)
from megatron_core.planning.zero_bubble import weight_stash_bytes, zero_bubble_extra_bytes
from megatron_core.planning.zero_memory import zero_transient_bytes, zero_transient_parts
from megatron_core.tensor_parallel.utils import vocab_size_with_padding
from megatron_core.training.metrics import hardware_flops_per_iteration


@dataclasses.dataclass(frozen=True)
class Plan:
    """One layout's prediction: bytes on the fullest rank and seconds per step."""

    layout: Layout
    model_state_bytes: float
    activation_bytes: float
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    bubble: float
    fits: bool
    transient_bytes: float = 0.0
    """What coexists with the held activations at the peak moment (``rank_peak_extra_bytes``): ZeRO's gathered
    parameters and gradient buckets, a parameter's grad, or the loss's second logits-sized tensor."""
    offloadable_bytes: float = 0.0
    """The fp32 masters and optimizer states of the fullest rank: what ``--optimizer-nvme-offload-dir`` (or
    ``--optimizer-cpu-offload`` on a GPU) moves off the device."""
    fits_with_offload: bool = False
    """Whether the layout fits once those are offloaded (the chunk ring of NVMe offload lives on the host)."""
    time: Optional[StepTime] = None
    """The step time by part (``planning.step_time``), of the busiest stage."""
    flops_per_device: float = 0.0
    """Hardware FLOPs of one step per device (model FLOPs + recompute), for TFLOP/s and MFU."""
    offload_seconds: float = 0.0
    """What optimizer offload would add per step: the shard's gradients to the host and parameters back."""

    @property
    def tflops_per_device(self) -> float:
        """Predicted achieved TFLOP/s per device (hardware FLOPs, as Megatron-LM's papers report)."""
        return self.flops_per_device / self.step_seconds / 1e12 if self.step_seconds else 0.0

    @property
    def memory_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes + self.transient_bytes


def layout_config(base: TransformerConfig, layout: Layout) -> TransformerConfig:
    """``base`` with the layout's parallel sizes, sequence parallelism, recompute and pipeline split."""
    changes = dict(recompute_granularity=layout.recompute, recompute_method=None, recompute_num_layers=None)
    if layout.recompute == "full":
        changes.update(recompute_method="uniform", recompute_num_layers=1)
    elif layout.recompute is None and base.recompute_granularity == "full":
        changes.update(recompute_granularity="full", recompute_method=base.recompute_method,
                       recompute_num_layers=base.recompute_num_layers)
    if layout.embedding_loss_split:
        split = split_chunk_counts(base.num_layers, layout.pp, layout.vpp or 1, embedding=True, loss=True)
        changes.update(pipeline_model_parallel_layout=split)
    return dataclasses.replace(base, tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                               virtual_pipeline_model_parallel_size=layout.vpp,
                               context_parallel_size=layout.cp, sequence_parallel=layout.sequence_parallel,
                               tp_comm_overlap=layout.tp_comm_overlap, **changes)


def _sharded_state_bytes(config: TransformerConfig, workload: Workload, *, params: float, full_grad: float,
                         shards: int, zero_stage: int) -> float:
    param_bytes = 2 if (config.bf16 or config.fp16) else 4
    master_and_states = (4 if param_bytes == 2 else 0) + workload.optimizer_state_bytes
    sharded_params = params / shards if zero_stage >= 3 else params
    if zero_stage >= 2:
        grads = workload.grad_bytes * (full_grad + (params - full_grad) / shards)
    else:
        grads = workload.grad_bytes * params * (2 if workload.torch_ddp_buckets else 1)
    states = master_and_states * (params / shards if zero_stage >= 1 else params)
    return param_bytes * sharded_params + grads + states


def model_state_bytes(config: TransformerConfig, workload: Workload, *, pp_rank: int, dp: int, zero_stage: int,
                      ep: int = 1, etp: int = 1, instances: int = 1) -> float:
    """Parameters + gradients (``workload.grad_bytes``: fp32 unless reduced in bf16) + fp32 masters (16-bit models) +
    optimizer states on one rank, sharded by the ZeRO stage: the dense ones over ``dp`` (dp x cp), the
    routed experts over the expert-dp group (``tp x dp / (ep x etp)`` ranks); with ``instances`` distributed
    optimizer instances (``--num-distributed-optimizer-instances``), over 1/instances of those ranks."""
    params, full_grad = stage_parameters(config, workload, pp_rank=pp_rank)
    dense = _sharded_state_bytes(config, workload, params=params, full_grad=full_grad, shards=dp // instances,
                                 zero_stage=zero_stage)
    experts = stage_expert_parameters(config, pp_rank=pp_rank, ep=ep, etp=etp)
    expert_dp = config.tensor_model_parallel_size * dp // (ep * etp)
    return dense + _sharded_state_bytes(config, workload, params=experts, full_grad=0.0,
                                        shards=max(expert_dp // instances, 1), zero_stage=zero_stage)


def optimizer_state_bytes(config: TransformerConfig, workload: Workload, *, pp_rank: int, dp: int,
                          zero_stage: int, ep: int = 1, etp: int = 1) -> float:
    """The fp32 masters (16-bit models) and optimizer states inside ``model_state_bytes``: the part that
    optimizer offload moves to the host or NVMe."""
    params, _ = stage_parameters(config, workload, pp_rank=pp_rank)
    experts = stage_expert_parameters(config, pp_rank=pp_rank, ep=ep, etp=etp)
    expert_dp = config.tensor_model_parallel_size * dp // (ep * etp)
    master_and_states = (4 if (config.bf16 or config.fp16) else 0) + workload.optimizer_state_bytes
    if zero_stage >= 1:
        return master_and_states * (params / dp + experts / expert_dp)
    return master_and_states * (params + experts)


def _shape(config: TransformerConfig, workload: Workload, ep: int = 1, etp: int = 1) -> ActivationShape:
    return ActivationShape(seq_length=workload.seq_length, micro_batch_size=workload.micro_batch_size,
                           tp=config.tensor_model_parallel_size, sequence_parallel=config.sequence_parallel,
                           element_bytes=2 if (config.bf16 or config.fp16) else 4, mask_bytes=workload.mask_bytes,
                           cp=config.context_parallel_size, cp_comm_type=config.cp_comm_type, ep=ep, etp=etp)


def _stage(config: TransformerConfig, workload: Workload, pp_rank: int, ep: int, etp: int) -> tuple:
    """(activation shape, ``stage_activation_bytes``' stage keywords) of pipeline stage ``pp_rank``."""
    padded = vocab_size_with_padding(workload.vocab_size,
                                     make_vocab_size_divisible_by=workload.make_vocab_size_divisible_by,
                                     tensor_model_parallel_size=config.tensor_model_parallel_size)
    pp = config.pipeline_model_parallel_size
    stage = dict(layers=stage_layer_count(config, pp_rank), first=pp_rank == 0, last=pp_rank == pp - 1,
                 padded_vocab_size=padded, moe_layers=moe_layers_on_stage(config, pp_rank=pp_rank),
                 fp8_layers=fp8_layers_on_stage(config, pp_rank=pp_rank))
    return _shape(config, workload, ep, etp), stage


def rank_activation_bytes(config: TransformerConfig, workload: Workload, *, pp_rank: int, num_microbatches: int,
                          ep: int = 1, etp: int = 1, zero_bubble_defer: Optional[str] = None) -> float:
    """Peak activation bytes on a rank of pipeline stage ``pp_rank`` (1F1B or interleaved; with
    ``zero_bubble_defer`` "all" or "cooldown", the zero-bubble schedule, whose split backwards keep their
    weight GEMMs' operands: ``planning.zero_bubble``), MoE layers at expert-parallel size ``ep``."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    in_flight = in_flight_microbatches(pp_rank, pp, num_microbatches, vpp)
    shape, stage = _stage(config, workload, pp_rank, ep, etp)
    peak = stage_activation_bytes(config, shape, in_flight=in_flight, **stage)
    if zero_bubble_defer is None:
        return peak
    microbatch = (stage_activation_bytes(config, shape, in_flight=1, **stage)
                  - stage_activation_bytes(config, shape, in_flight=0, **stage))
    stash = weight_stash_bytes(config, shape, layers=stage["layers"], last=stage["last"],
                               padded_vocab_size=stage["padded_vocab_size"], moe_layers=stage["moe_layers"])
    return peak + zero_bubble_extra_bytes(pp_rank=pp_rank, pp_size=pp, num_microbatches=num_microbatches,
                                          defer=zero_bubble_defer, microbatch_bytes=microbatch, stash_bytes=stash)


def rank_peak_extra_bytes(config: TransformerConfig, workload: Workload, *, pp_rank: int, zero_stage: int,
                          ep: int = 1, etp: int = 1) -> float:
    """Bytes beyond the held activations at the peak moment of a rank of stage ``pp_rank``
    (``planning.peak_phases``): the loss's second logits-sized tensor, the output layer's or the embedding's
    gradient, bucket and gathered weight, or a transformer layer's ZeRO transients, whichever moment is largest
    (each with what really coexists with it, not every transient at its own peak)."""
    shape, stage = _stage(config, workload, pp_rank, ep, etp)
    microbatch = (stage_activation_bytes(config, shape, in_flight=1, **stage)
                  - stage_activation_bytes(config, shape, in_flight=0, **stage))
    params, full_grad = stage_parameters(config, workload, pp_rank=pp_rank)
    experts = stage_expert_parameters(config, pp_rank=pp_rank, ep=ep, etp=etp)
    param_grad, zero = zero_transient_parts(config, vocab_size=workload.vocab_size,
                                            make_vocab_size_divisible_by=workload.make_vocab_size_divisible_by,
                                            pp_rank=pp_rank, zero_stage=zero_stage,
                                            stage_params=params - full_grad + experts, ep=ep, etp=etp,
                                            layers_only=True, grad_bytes=workload.grad_bytes)
    tokens = shape.local_seq_length * shape.micro_batch_size
    moe_tokens = etp * assignments(config, tokens / (shape.tp if shape.sequence_parallel else 1)) \
        if stage["moe_layers"] else 0.0
    mlp = mlp_backward(config, tokens=tokens, tp=shape.tp, etp=etp, moe_tokens=moe_tokens,
                       dense=stage["layers"] > stage["moe_layers"], moe=stage["moe_layers"] > 0) \
        if stage["layers"] else None
    moments = StageMoments(zero_stage=zero_stage, first=stage["first"], last=stage["last"], tokens=tokens,
                           vocab_shard=stage["padded_vocab_size"] / config.tensor_model_parallel_size,
                           layer_transient=param_grad + zero,
                           microbatch_bytes=microbatch / (config.virtual_pipeline_model_parallel_size or 1),
                           mlp=mlp, param_grad=param_grad, grad_bytes=workload.grad_bytes)
    return peak_extra_bytes(config, moments)


def rank_transient_bytes(config: TransformerConfig, workload: Workload, *, pp_rank: int, zero_stage: int,
                         ep: int = 1, etp: int = 1) -> float:
    """Peak bytes of ZeRO's gathered parameters and gradient buckets on a rank of stage ``pp_rank`` (ZeRO
    shards over dp x cp, experts over expert-dp; the count does not depend on the shard count), each at its
    own peak: an upper bound of the transients alone (the plan counts ``rank_peak_extra_bytes``)."""
    params, full_grad = stage_parameters(config, workload, pp_rank=pp_rank)
    experts = stage_expert_parameters(config, pp_rank=pp_rank, ep=ep, etp=etp)
    return zero_transient_bytes(config, vocab_size=workload.vocab_size,
                                make_vocab_size_divisible_by=workload.make_vocab_size_divisible_by,
                                pp_rank=pp_rank, zero_stage=zero_stage, stage_params=params - full_grad + experts,
                                ep=ep, etp=etp, grad_bytes=workload.grad_bytes)


def plan_layout(base: TransformerConfig, workload: Workload, hardware: Hardware, layout: Layout) -> Plan:
    """Memory of the fullest rank and the step time of ``layout``."""
    config = layout_config(base, layout)
    m = workload.global_batch_size // (workload.micro_batch_size * layout.dp)
    experts = dict(ep=layout.ep, etp=layout.etp)
    states = [model_state_bytes(config, workload, pp_rank=r, dp=layout.dp_cp, zero_stage=layout.zero_stage, **experts)
              for r in range(layout.pp)]
    defer = "all" if layout.zero_bubble else None
    acts = [rank_activation_bytes(config, workload, pp_rank=r, num_microbatches=m, zero_bubble_defer=defer, **experts)
            for r in range(layout.pp)]
    transients = [rank_peak_extra_bytes(config, workload, pp_rank=r, zero_stage=layout.zero_stage, **experts)
                  for r in range(layout.pp)]
    fullest = max(range(layout.pp), key=lambda r: states[r] + acts[r] + transients[r])
    padded = vocab_size_with_padding(workload.vocab_size,
                                     make_vocab_size_divisible_by=workload.make_vocab_size_divisible_by,
                                     tensor_model_parallel_size=layout.tp)
    flops = hardware_flops_per_iteration(config, batch_size=workload.global_batch_size,
                                         seq_length=workload.seq_length, padded_vocab_size=padded)
    stage_params = [(stage_parameters(config, workload, pp_rank=r)[0],
                     stage_expert_parameters(config, pp_rank=r, ep=layout.ep, etp=layout.etp))
                    for r in range(layout.pp)]
    timing = step_time(config, workload, layout, hardware, num_microbatches=m, padded_vocab_size=padded,
                       stage_params=stage_params, optimizer_params=_optimizer_params(stage_params, layout))
    step = timing.total
    offload = offload_seconds(_optimizer_params(stage_params, layout), hardware)
    busy = step - timing.parts["bubble"]
    bubble = timing.parts["bubble"] / busy if busy else 0.0
    memory = states[fullest] + acts[fullest] + transients[fullest]
    offloadable = optimizer_state_bytes(config, workload, pp_rank=fullest, dp=layout.dp_cp,
                                        zero_stage=layout.zero_stage, **experts)
    budget = hardware.memory_per_device_gb * 2**30
    return Plan(layout=layout, model_state_bytes=states[fullest], activation_bytes=acts[fullest], step_seconds=step,
                compute_seconds=timing.compute, comm_seconds=timing.comm, bubble=bubble, fits=memory <= budget,
                transient_bytes=transients[fullest], offloadable_bytes=offloadable,
                fits_with_offload=memory - offloadable <= budget, time=timing,
                flops_per_device=flops / hardware.num_devices, offload_seconds=offload)


def _optimizer_params(stage_params: list, layout: Layout) -> float:
    """Parameters whose update the busiest-by-parameters rank computes: its ZeRO shard (or all, at ZeRO 0)."""
    dense, experts = max(stage_params, key=lambda pair: pair[0] + pair[1])
    if layout.zero_stage == 0:
        return dense + experts
    return dense / layout.dp_cp + experts / max(layout.expert_dp, 1)


def valid_layouts(base: TransformerConfig, workload: Workload, num_devices: int,
                  space: Optional[SearchSpace] = None) -> Iterator[Layout]:
    """Every (tp, pp, dp, vpp, ZeRO stage, SP, recompute, cp, ep) the model and batch allow on ``num_devices``:
    cp where the sequence divides by 2 cp (the load-balanced split), and for ``cp_comm_type`` a2a where the
    heads and query groups per tp rank divide by cp; for an MoE model every ep dividing the experts, with
    every etp dividing the expert hidden size with ep x etp dividing tp x cp x dp (the expert grid is independent
    of tp, as Megatron-LM's), with sequence parallelism whenever tp > 1 (the MoE layer needs it)."""
    space = space or SearchSpace()
    for tp, pp, cp in itertools.product(_divisors(num_devices), repeat=3):
        if num_devices % (tp * pp * cp) or (space.max_cp is not None and cp > space.max_cp):
            continue
        dp = num_devices // (tp * pp * cp)
        split = _pipeline_split(base, pp, space.embedding_loss_split)
        if (base.num_attention_heads % tp or base.num_query_groups % tp or split is None
                or workload.global_batch_size % (workload.micro_batch_size * dp)):
            continue
        if cp > 1 and (workload.seq_length % (2 * cp) or (base.cp_comm_type == "a2a" and (
                base.num_attention_heads // tp % cp or base.num_query_groups // tp % cp))):
            continue
        m = workload.global_batch_size // (workload.micro_batch_size * dp)
        schedules = [(None, False)]
        if pp > 1 and space.interleaving and (base.num_layers + 2 * split) % (2 * pp) == 0 and m % pp == 0:
            schedules.append((2, False))
        if pp > 1 and space.zero_bubble:
            schedules.append((None, True))
        experts = [(1, 1)] if base.moe is None else [
            (ep, etp) for ep in _divisors(tp * cp * dp) for etp in _divisors(tp * cp * dp)
            if base.moe.num_moe_experts % ep == 0 and (tp * cp * dp) % (ep * etp) == 0
            and expert_ffn(base) % etp == 0]
        sps = [False, True] if tp > 1 and base.moe is None else [True] if tp > 1 else [False]
        if not space.sequence_parallel and base.moe is None:
            sps = [False]
        overlaps = (False, True) if space.tp_comm_overlap else (False,)
        for (vpp, zb), stage, sp, recompute, (ep, etp), overlap in itertools.product(
                schedules, space.zero_stages, sps, space.recompute, experts, overlaps):
            if (sp and (workload.seq_length // cp) % tp) or (overlap and not sp):
                continue
            if stage and dp * cp == 1 and (base.moe is None or tp * cp * dp // (ep * etp) == 1):
                continue  # nothing to shard: every state is on one rank of its group
            yield Layout(tp, pp, dp, vpp, stage, sp, recompute, cp, ep, etp, zero_bubble=zb, embedding_loss_split=split,
                         tp_comm_overlap=overlap)


def rank_plans(base: TransformerConfig, workload: Workload, hardware: Hardware, *,
               space: Optional[SearchSpace] = None, tolerance: float = 0.03) -> list[Plan]:
    """All valid layouts (in ``space``), the ones that fit first, each group by predicted step time (then
    memory), except that the first is the simplest fitting layout within ``tolerance`` of the fastest
    (``planning.choose``; ``tolerance=0`` ranks by time alone)."""
    if workload.global_batch_size % workload.micro_batch_size:
        raise ValueError(f"global batch {workload.global_batch_size} is not divisible by micro batch "
                         f"{workload.micro_batch_size}")
    plans = [plan_layout(base, workload, hardware, layout)
             for layout in valid_layouts(base, workload, hardware.num_devices, space)]
    if not plans:
        raise ValueError(f"no layout of {hardware.num_devices} devices divides heads {base.num_attention_heads}, "
                         f"layers {base.num_layers} and global batch {workload.global_batch_size} / micro batch "
                         f"{workload.micro_batch_size}")
    ranked = sorted(plans, key=lambda plan: (not plan.fits, plan.step_seconds, plan.memory_bytes))
    chosen = choose_plan(ranked, tolerance) if tolerance > 0 else None
    return ranked if chosen is None else [chosen] + [plan for plan in ranked if plan is not chosen]


def _pipeline_split(base: TransformerConfig, pp: int, allowed: bool) -> Optional[bool]:
    """How ``pp`` stages split the layers: evenly (False), with the embedding and loss counted as layers (True)
    where only that divides, or None where neither does."""
    if base.num_layers % pp == 0:
        return False
    return True if allowed and pp > 1 and (base.num_layers + 2) % pp == 0 else None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


__all__ = ["Hardware", "RECOMPUTE_CHOICES", "Workload", "Layout", "grad_bytes_of", "Plan", "SearchSpace",
           "cp_comm_bytes", "cp_comm_seconds",
           "ep_comm_seconds", "layout_config", "stage_expert_parameters",
           "model_state_bytes", "optimizer_state_bytes", "rank_activation_bytes", "rank_transient_bytes",
           "rank_peak_extra_bytes",
           "stage_parameters", "plan_layout", "valid_layouts", "rank_plans"]
