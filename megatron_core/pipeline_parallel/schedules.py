"""Megatron's forward-backward schedules: no pipelining, 1F1B, interleaved 1F1B, and zero bubble (ZB-H1).

Each schedule is an order of passes from ``schedule_plan`` run by one ``executor.Executor`` (see there for
what a pass does, how transfers are posted and how a failing rank fails its peers).

Optional keywords beyond Megatron's: ``timeline`` (a ``Timeline`` to record into) and ``grad_scale_func``
(applied to the loss before backward: the fp16 loss scaler).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from megatron_core.parallel_state import ParallelState
from megatron_core.pipeline_parallel.executor import (  # noqa: F401 (PipelineError: re-exported)
    Executor,
    ForwardStepFunc,
    PipelineError,
    ScheduleCall,
    unwrap,
)
from megatron_core.pipeline_parallel.schedule_plan import (
    ZERO_BUBBLE_DEFER,
    check_microbatch_group,
    interleaved_ops,
    no_pipelining_ops,
    one_f_one_b_ops,
    resolve_zero_bubble_defer,
    zero_bubble_ops,
)
from megatron_core.pipeline_parallel.timeline import Timeline


def get_forward_backward_func(pp_size: int, vpp_size: Optional[int] = None, *, zero_bubble: bool = False,
                              zero_bubble_defer: Optional[str] = None) -> Callable[..., list]:
    """The schedule for a layout: no pipelining (pp 1), 1F1B, interleaved 1F1B (vpp > 1), or with
    ``zero_bubble`` the zero-bubble schedule (pp > 1, no interleaving; ``--enable-zero-bubble``), which
    splits the backwards ``zero_bubble_defer`` names ("all": ZB-H1, "cooldown", None: by device)."""
    if pp_size < 1 or (vpp_size is not None and vpp_size < 1):
        raise ValueError(f"pp_size must be >= 1 and vpp_size None or >= 1, got pp_size={pp_size}, vpp_size={vpp_size}")
    if zero_bubble:
        if pp_size == 1 or (vpp_size or 1) > 1:
            raise ValueError(f"the zero-bubble schedule needs pipeline_model_parallel_size > 1 and no virtual "
                             f"pipeline stages, got pp_size={pp_size}, vpp_size={vpp_size}: drop --enable-zero-bubble "
                             "or --num-layers-per-virtual-pipeline-stage")
        if zero_bubble_defer is None:
            return forward_backward_pipelining_zero_bubble
        if zero_bubble_defer not in ZERO_BUBBLE_DEFER:
            raise ValueError(f"zero_bubble_defer must be one of {ZERO_BUBBLE_DEFER} or None, got {zero_bubble_defer!r}")
        return functools.partial(forward_backward_pipelining_zero_bubble, defer=zero_bubble_defer)
    if pp_size == 1:
        if vpp_size not in (None, 1):
            raise ValueError(f"vpp_size {vpp_size} needs pp_size > 1 (got pp_size 1)")
        return forward_backward_no_pipelining
    if vpp_size is not None and vpp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


def forward_backward_no_pipelining(*, forward_step_func: ForwardStepFunc, data_iterator, model,
                                   num_microbatches: int, seq_length: int, micro_batch_size: int,
                                   forward_only: bool = False, parallel_state: ParallelState,
                                   timeline: Optional[Timeline] = None,
                                   grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> list:
    """All micro-batches through one stage, gradients accumulated. Returns the loss_func results."""
    chunks = _as_chunks(model, 1)
    _check_common(num_microbatches, parallel_state, chunks, seq_length)
    ops = no_pipelining_ops(num_microbatches, forward_only=forward_only)
    return Executor(ScheduleCall(forward_step_func=forward_step_func, iterators=[data_iterator], chunks=chunks,
                                  num_microbatches=num_microbatches, forward_only=forward_only, state=parallel_state,
                                  shape=None, timeline=timeline, grad_scale_func=grad_scale_func)).run(ops)


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: ForwardStepFunc, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, forward_only: bool = False, parallel_state: ParallelState,
        timeline: Optional[Timeline] = None,
        grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> list:
    """1F1B over ``parallel_state.pp_size`` stages. Returns the loss_func results on the last stage."""
    chunks = _as_chunks(model, 1)
    _check_common(num_microbatches, parallel_state, chunks, seq_length)
    ops = one_f_one_b_ops(parallel_state.pp_rank, parallel_state.pp_size, num_microbatches, forward_only=forward_only)
    shape = pipeline_tensor_shape(chunks[0], seq_length, micro_batch_size)
    return Executor(ScheduleCall(forward_step_func=forward_step_func, iterators=[data_iterator], chunks=chunks,
                                  num_microbatches=num_microbatches, forward_only=forward_only, state=parallel_state,
                                  shape=shape, timeline=timeline, grad_scale_func=grad_scale_func)).run(ops)


def forward_backward_pipelining_zero_bubble(
        *, forward_step_func: ForwardStepFunc, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, forward_only: bool = False, parallel_state: ParallelState,
        timeline: Optional[Timeline] = None,
        grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, defer: Optional[str] = None) -> list:
    """Zero bubble over ``parallel_state.pp_size`` stages (``schedule_plan.zero_bubble_ops``): 1F1B's memory,
    with ``defer="all"`` (ZB-H1) a third of its bubble. ``defer=None`` picks "all" on accelerators and
    "cooldown" on CPU (where a split backward costs 15-20% more than a whole one, docs/performance.md). The
    other arguments and the result are those of the 1F1B schedule; the gradients are the same."""
    chunks = _as_chunks(model, 1)
    _check_common(num_microbatches, parallel_state, chunks, seq_length)
    _check_zero_bubble(chunks[0])
    defer = resolve_zero_bubble_defer(defer, parallel_state.device.type)
    ops = zero_bubble_ops(parallel_state.pp_rank, parallel_state.pp_size, num_microbatches, forward_only=forward_only,
                          defer=defer)
    shape = pipeline_tensor_shape(chunks[0], seq_length, micro_batch_size)
    call = ScheduleCall(forward_step_func=forward_step_func, iterators=[data_iterator], chunks=chunks,
                        num_microbatches=num_microbatches, forward_only=forward_only, state=parallel_state,
                        shape=shape, timeline=timeline, grad_scale_func=grad_scale_func, zero_bubble=True)
    with parallel_state.weight_grad_store.schedule():
        return Executor(call).run(ops)


def _check_zero_bubble(chunk: nn.Module) -> None:
    if getattr(chunk, "gatherer", None) is not None:  # a ZeRO-3 DistributedDataParallel
        raise ValueError("the zero-bubble schedule cannot run with ZeRO-3 (its parameter gathering follows the "
                         "backward, and the weight gradients come later): use --zero-stage 0-2 or drop "
                         "--enable-zero-bubble")


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: ForwardStepFunc, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, forward_only: bool = False, parallel_state: ParallelState,
        timeline: Optional[Timeline] = None,
        grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> list:
    """Interleaved 1F1B: ``model`` is the list of this rank's vpp chunks, ``data_iterator`` one per chunk; the
    micro-batches run in groups of ``config.microbatch_group_size_per_vp_stage`` (default pp) per chunk."""
    state = parallel_state
    vpp = state.vpp_size or 1
    chunks = _as_chunks(model, vpp)
    group_size = getattr(getattr(unwrap(chunks[0]), "config", None), "microbatch_group_size_per_vp_stage", None)
    check_microbatch_group(num_microbatches, state.pp_size, group_size)
    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else None
    if iterators is None or len(iterators) != vpp:
        raise ValueError(f"the interleaved schedule needs one data iterator per model chunk ({vpp}), "
                         f"got {type(data_iterator).__name__}")
    _check_common(num_microbatches, state, chunks, seq_length)
    ops = interleaved_ops(state.pp_rank, state.pp_size, vpp, num_microbatches, forward_only=forward_only,
                          group_size=group_size)
    shape = pipeline_tensor_shape(chunks[0], seq_length, micro_batch_size)
    return Executor(ScheduleCall(forward_step_func=forward_step_func, iterators=list(iterators), chunks=chunks,
                                  num_microbatches=num_microbatches, forward_only=forward_only, state=state,
                                  shape=shape, timeline=timeline, grad_scale_func=grad_scale_func)).run(ops)


def _as_chunks(model: Union[nn.Module, Sequence[nn.Module]], expected: int) -> list[nn.Module]:
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if len(chunks) != expected:
        raise ValueError(f"expected {expected} model chunk(s) on this rank, got {len(chunks)}")
    return chunks


def _check_common(num_microbatches: int, state: ParallelState, chunks: list[nn.Module], seq_length: int) -> None:
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    config = getattr(unwrap(chunks[0]), "config", None)
    if state.cp_size > 1 and seq_length % (2 * state.cp_size) != 0:
        raise ValueError(f"seq_length {seq_length} is not divisible by 2 x context_parallel_size {state.cp_size} "
                         "(the load-balanced causal split cuts the sequence into 2 cp chunks)")
    local = seq_length // state.cp_size
    if config is not None and config.sequence_parallel and local % state.tp_size != 0:
        raise ValueError(f"seq_length {seq_length} / context_parallel_size {state.cp_size} is not divisible by "
                         f"tensor_model_parallel_size {state.tp_size} (sequence parallelism splits the sequence)")


def pipeline_tensor_shape(chunk: nn.Module, seq_length: int,
                          micro_batch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the activations between stages: ``[s(/cp)(/tp), b, h]`` in the params dtype."""
    config = getattr(unwrap(chunk), "config", None)
    if config is None:
        raise ValueError("pipeline schedules read hidden_size from model.config; the model chunk has no config")
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    local = seq_length // config.context_parallel_size
    return (local // tp, micro_batch_size, config.hidden_size), config.params_dtype


