"""Megatron's forward-backward schedules: no pipelining, 1F1B, interleaved 1F1B, and zero bubble (ZB-H1).

Each schedule is an order of passes from ``schedule_plan`` run by one executor (``_Executor``, given a
``ScheduleCall``):

- F of (chunk, micro-batch): take the activation from the previous stage (or the data, on the model's first
  chunk), run ``forward_step_func``, send the output to the next stage (or, on the model's last chunk, turn
  it into the loss with the returned ``loss_func``). A sent output is deallocated at once (its storage freed,
  its autograd node kept), so a stage holds activations only for micro-batches whose backward is pending.
- B: take the output gradient from the next stage (or back-propagate the loss), run backward, send the
  input gradient to the previous stage.
- W (zero bubble only): the weight-gradient GEMMs the linear layers deferred in an earlier B
  (``WeightGradStore``, held by the ``ParallelState``). Under zero bubble every B and every W but the last
  micro-batch's runs inside the chunk's ``no_sync()``: a data-parallel wrapper reduces after the last W.

Optional keywords beyond Megatron's: ``timeline`` (a ``Timeline`` to record into) and ``grad_scale_func``
(applied to the loss before backward: the fp16 loss scaler). Model chunks with a ``no_sync()`` context (a
data-parallel wrapper) run every backward but the last micro-batch's inside it.

Transfers are posted in one ``batch_isend_irecv`` per pass: the pass's send plus the receive the next pass
needs, so receives are always posted ahead and no rank waits on a send. On gloo, where each transfer is its
own background operation, each stream's next receive is posted as soon as the previous one is taken. After
the last pass, ``finalize_model_grads`` sums tied-embedding grads over the first and last stage (and sequence-parallel
grads over tp). If a rank raises, it publishes the error in the default store and sends a placeholder (all
NaN) for every transfer it still owed; each peer's next receive completes, finds the error, and raises
``PipelineError`` carrying it (then does the same for its own peers): no rank is left waiting.

The store is not asked on every receive (a TCPStore/FileStore round trip costs more than a small transfer):
on CPU a received tensor whose first element is NaN may be a placeholder, and only then is the store asked
(a real NaN activation costs one store look-up and runs on); on other devices, where reading an element
would synchronize the stream, the store is asked every ``STORE_CHECK_EVERY`` receives and once at the end.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.distributed import finalize_model_grads
from megatron_core.parallel_state import ParallelState
from megatron_core.pipeline_parallel.p2p import P2PCommunicator, PendingRecv
from megatron_core.pipeline_parallel.schedule_plan import (
    ZERO_BUBBLE_DEFER,
    Op,
    interleaved_ops,
    no_pipelining_ops,
    one_f_one_b_ops,
    zero_bubble_ops,
)
from megatron_core.pipeline_parallel.timeline import Timeline

STORE_CHECK_EVERY = 16
ForwardStepFunc = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable]]


class PipelineError(RuntimeError):
    """Another pipeline rank failed; the message carries its error."""


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
    return _Executor(ScheduleCall(forward_step_func=forward_step_func, iterators=[data_iterator], chunks=chunks,
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
    shape = _tensor_shape(chunks[0], seq_length, micro_batch_size)
    return _Executor(ScheduleCall(forward_step_func=forward_step_func, iterators=[data_iterator], chunks=chunks,
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
    defer = defer or ("cooldown" if parallel_state.device.type == "cpu" else "all")
    ops = zero_bubble_ops(parallel_state.pp_rank, parallel_state.pp_size, num_microbatches, forward_only=forward_only,
                          defer=defer)
    shape = _tensor_shape(chunks[0], seq_length, micro_batch_size)
    call = ScheduleCall(forward_step_func=forward_step_func, iterators=[data_iterator], chunks=chunks,
                        num_microbatches=num_microbatches, forward_only=forward_only, state=parallel_state,
                        shape=shape, timeline=timeline, grad_scale_func=grad_scale_func, zero_bubble=True)
    with parallel_state.weight_grad_store.schedule():
        return _Executor(call).run(ops)


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
    """Interleaved 1F1B: ``model`` is the list of this rank's vpp chunks, ``data_iterator`` one per chunk."""
    state = parallel_state
    vpp = state.vpp_size or 1
    chunks = _as_chunks(model, vpp)
    if num_microbatches % state.pp_size != 0:
        raise ValueError(f"num_microbatches {num_microbatches} is not divisible by pipeline_model_parallel_size "
                         f"{state.pp_size}, which the interleaved schedule requires")
    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else None
    if iterators is None or len(iterators) != vpp:
        raise ValueError(f"the interleaved schedule needs one data iterator per model chunk ({vpp}), "
                         f"got {type(data_iterator).__name__}")
    _check_common(num_microbatches, state, chunks, seq_length)
    ops = interleaved_ops(state.pp_rank, state.pp_size, vpp, num_microbatches, forward_only=forward_only)
    shape = _tensor_shape(chunks[0], seq_length, micro_batch_size)
    return _Executor(ScheduleCall(forward_step_func=forward_step_func, iterators=list(iterators), chunks=chunks,
                                  num_microbatches=num_microbatches, forward_only=forward_only, state=state,
                                  shape=shape, timeline=timeline, grad_scale_func=grad_scale_func)).run(ops)


def _as_chunks(model: Union[nn.Module, Sequence[nn.Module]], expected: int) -> list[nn.Module]:
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if len(chunks) != expected:
        raise ValueError(f"expected {expected} model chunk(s) on this rank, got {len(chunks)}")
    return chunks


def _unwrap(model: nn.Module) -> nn.Module:
    """The innermost module inside wrappers (data parallel, ...) that hold it as ``.module``."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _check_common(num_microbatches: int, state: ParallelState, chunks: list[nn.Module], seq_length: int) -> None:
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    config = getattr(_unwrap(chunks[0]), "config", None)
    if state.cp_size > 1 and seq_length % (2 * state.cp_size) != 0:
        raise ValueError(f"seq_length {seq_length} is not divisible by 2 x context_parallel_size {state.cp_size} "
                         "(the load-balanced causal split cuts the sequence into 2 cp chunks)")
    local = seq_length // state.cp_size
    if config is not None and config.sequence_parallel and local % state.tp_size != 0:
        raise ValueError(f"seq_length {seq_length} / context_parallel_size {state.cp_size} is not divisible by "
                         f"tensor_model_parallel_size {state.tp_size} (sequence parallelism splits the sequence)")


def _tensor_shape(chunk: nn.Module, seq_length: int, micro_batch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the activations between stages: ``[s(/cp)(/tp), b, h]`` in the params dtype."""
    config = getattr(_unwrap(chunk), "config", None)
    if config is None:
        raise ValueError("pipeline schedules read hidden_size from model.config; the model chunk has no config")
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    local = seq_length // config.context_parallel_size
    return (local // tp, micro_batch_size, config.hidden_size), config.params_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleCall:
    """What one call of a schedule runs: the executor's inputs."""

    forward_step_func: ForwardStepFunc
    iterators: list
    """One data iterator per model chunk."""
    chunks: list[nn.Module]
    num_microbatches: int
    forward_only: bool
    state: ParallelState
    shape: Optional[tuple[tuple[int, ...], torch.dtype]]
    """Shape and dtype of the activations between stages; None without pipelining (no transfers)."""
    timeline: Optional[Timeline] = None
    grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    zero_bubble: bool = False
    """B computes input gradients only; the weight gradients wait for the W ops (``state.weight_grad_store``)."""


class _Executor:
    """Runs one rank's ops; see the module docstring."""

    def __init__(self, call: ScheduleCall) -> None:
        state, shape, chunks = call.state, call.shape, call.chunks
        self.forward_step_func, self.iterators, self.chunks = call.forward_step_func, call.iterators, chunks
        self.grad_scale_func = call.grad_scale_func
        self.num_microbatches, self.forward_only, self.state = call.num_microbatches, call.forward_only, state
        self.timeline, self.zero_bubble = call.timeline, call.zero_bubble
        self.vpp = len(chunks)
        self.comm = (P2PCommunicator(state, tensor_shape=shape[0], dtype=shape[1], record=self._record)
                     if shape is not None else None)
        self.saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        self.pending: dict[tuple[str, int, int], PendingRecv] = {}
        self.losses: list = []
        # The same on every rank, as all ranks run the same sequence of schedules.
        self.failure_key = f"megatron_core/pipeline_failure/{next(self.state.schedule_calls)}"
        self.store = _default_store() if self.comm is not None else None
        self.receives = 0
        # On gloo each stream (activations for F, gradients for B) keeps its next receive posted from the moment
        # the previous one is taken, so data a peer sends early lands while this rank computes. (NCCL pairs each
        # receive with the pass's send in one batch, as Megatron does: separate launches could deadlock.)
        self.receive_early = self.comm is not None and not self.comm.batched
        self.upcoming: dict[str, collections.deque[Op]] = {}
        self.deferred: set[tuple[int, int]] = set()
        """Zero bubble: (chunk, micro-batch) whose B leaves the weight gradients to its W (the other B run whole)."""

    def _record(self, kind: str, start: float, end: float, op: Optional[Op] = None) -> None:
        if self.timeline is not None:
            self.timeline.record(kind, start, end, op.microbatch if op else None, op.chunk if op else None)

    def first_chunk(self, chunk: int) -> bool:
        return self.state.is_first_model_chunk(chunk) if self.vpp > 1 else self.state.is_pipeline_first_stage

    def last_chunk(self, chunk: int) -> bool:
        return self.state.is_last_model_chunk(chunk) if self.vpp > 1 else self.state.is_pipeline_last_stage

    def needs_recv(self, op: Op) -> bool:
        if self.comm is None:
            return False
        return not self.first_chunk(op.chunk) if op.kind == "F" else not self.last_chunk(op.chunk)

    def post(self, send_next=None, send_prev=None, next_op: Optional[Op] = None) -> None:
        if self.receive_early:
            if send_next is not None or send_prev is not None:
                self.comm.post(send_next=send_next, send_prev=send_prev)
            return
        recv_prev = next_op is not None and next_op.kind == "F" and self.needs_recv(next_op)
        recv_next = next_op is not None and next_op.kind == "B" and self.needs_recv(next_op)
        if self.comm is None or not (send_next is not None or send_prev is not None or recv_prev or recv_next):
            return
        from_prev, from_next = self.comm.post(send_next=send_next, send_prev=send_prev, recv_prev=recv_prev,
                                              recv_next=recv_next)
        if next_op is not None and (from_prev or from_next):
            self.pending[(next_op.kind, next_op.chunk, next_op.microbatch)] = from_prev or from_next

    def _post_next_receive(self, kind: str) -> None:
        """Posts the receive of the next op of ``kind`` that needs one (``receive_early``)."""
        queue = self.upcoming.get(kind)
        if queue:
            op = queue.popleft()
            from_prev, from_next = self.comm.post(recv_prev=kind == "F", recv_next=kind == "B")
            self.pending[(op.kind, op.chunk, op.microbatch)] = from_prev or from_next

    def take(self, op: Op) -> Optional[torch.Tensor]:
        pending = self.pending.pop((op.kind, op.chunk, op.microbatch), None)
        if pending is None:
            return None
        if self.receive_early:
            self._post_next_receive(op.kind)
        tensor = self.comm.wait(pending)
        self.receives += 1
        if self._may_be_placeholder(tensor):
            self.check_peers()
        return tensor

    def _may_be_placeholder(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type == "cpu":
            return tensor.numel() > 0 and math.isnan(tensor.view(-1)[0].item())
        return self.receives % STORE_CHECK_EVERY == 0

    def check_peers(self) -> None:
        """Raises ``PipelineError`` with a failed peer's message if one was published (one store look-up)."""
        if self.store is not None and self.store.check([self.failure_key]):
            raise PipelineError(self.store.get(self.failure_key).decode())

    def forward(self, op: Op, next_op: Optional[Op]) -> None:
        input_tensor = self.take(op)
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_()
        start = time.perf_counter()
        model = self.chunks[op.chunk]
        _unwrap(model).set_input_tensor(input_tensor)
        with self._forward_pass(op):
            output, loss_func = self.forward_step_func(self.iterators[op.chunk], model)
        if self.last_chunk(op.chunk):
            output = self._loss(output, loss_func)
        self._record("forward", start, time.perf_counter(), op)
        if not self.forward_only:
            self.saved[(op.chunk, op.microbatch)] = (input_tensor, output)
            if self.timeline is not None:
                self.timeline.max_in_flight = max(self.timeline.max_in_flight, len(self.saved))
        send = None if self.last_chunk(op.chunk) else output
        self.post(send_next=send, next_op=next_op)
        if send is not None:
            _deallocate(output)  # the communicator keeps the storage until the send completed

    def _loss(self, output: torch.Tensor, loss_func: Callable) -> torch.Tensor:
        result = loss_func(output)
        loss, reported = (result[0], result[-1]) if isinstance(result, tuple) else (result, result)
        self.losses.append(reported)
        return loss / self.num_microbatches

    def backward(self, op: Op, next_op: Optional[Op]) -> None:
        output_grad = self.take(op)
        input_tensor, output = self.saved.pop((op.chunk, op.microbatch))
        start = time.perf_counter()
        chunk = self.chunks[op.chunk]
        deferred = (op.chunk, op.microbatch) in self.deferred  # zero bubble: a split backward (it has a W)
        # A data-parallel wrapper reduces grads only in the backward of the last micro-batch (accumulation);
        # under zero bubble, in its last W.
        backward_pass = self.state.weight_grad_store.backward_pass() if deferred else contextlib.nullcontext()
        with self._no_sync(chunk, op, last_pass=not deferred), backward_pass:
            self._backward(output, output_grad)
        self._record("backward", start, time.perf_counter(), op)
        input_grad = None if self.first_chunk(op.chunk) or input_tensor is None else input_tensor.grad
        self.post(send_prev=input_grad, next_op=next_op)

    def weight(self, op: Op, next_op: Optional[Op]) -> None:
        """The weight gradients of micro-batch ``op.microbatch`` (the oldest B whose W has not run)."""
        start = time.perf_counter()
        with self._no_sync(self.chunks[op.chunk], op, last_pass=True):
            self.state.weight_grad_store.run_weight_pass()
        self._record("weight", start, time.perf_counter(), op)
        self.post(next_op=next_op)

    def _forward_pass(self, op: Op):
        """Zero bubble: the forward of a micro-batch whose B defers its weight gradients builds deferrable
        linears (the others run torch's own)."""
        if not self.zero_bubble:
            return contextlib.nullcontext()
        return self.state.weight_grad_store.deferrable_forward((op.chunk, op.microbatch) in self.deferred)

    def _no_sync(self, chunk: nn.Module, op: Op, *, last_pass: bool = True):
        """``chunk.no_sync()`` unless this pass is the last to produce grads of the last micro-batch."""
        last = op.microbatch == self.num_microbatches - 1 and last_pass
        return chunk.no_sync() if hasattr(chunk, "no_sync") and not last else contextlib.nullcontext()

    def _backward(self, output: torch.Tensor, output_grad: Optional[torch.Tensor]) -> None:
        if output_grad is None:  # the loss, on the model's last chunk
            torch.autograd.backward(self.grad_scale_func(output) if self.grad_scale_func else output)
        else:
            torch.autograd.Variable._execution_engine.run_backward(  # the output's storage was freed
                tensors=(output,), grad_tensors=(output_grad,), keep_graph=False, create_graph=False, inputs=(),
                allow_unreachable=True, accumulate_grad=True)

    def run(self, ops: list[Op]) -> list:
        self.deferred = {(op.chunk, op.microbatch) for op in ops if op.kind == "W"}
        if self.receive_early:
            self.upcoming = {kind: collections.deque(op for op in ops if op.kind == kind and self.needs_recv(op))
                             for kind in "FB"}
            for kind in "FB":
                self._post_next_receive(kind)
        elif ops:
            self.post(next_op=ops[0])
        for index, (op, next_op) in enumerate(zip(ops, ops[1:] + [None])):
            try:
                {"F": self.forward, "B": self.backward, "W": self.weight}[op.kind](op, next_op)
            except Exception as error:
                if self.comm is not None:
                    self.fail(error, ops[index:])
                raise
            if self.comm is not None:
                self.comm.release_completed_sends()
        if self.comm is not None:
            if self.state.device.type != "cpu":  # the periodic look-ups may have missed the last placeholders
                self.check_peers()
            self.comm.release_completed_sends(wait=True)
        if not self.forward_only:
            finalize_model_grads(self.chunks, self.state)
        if self.timeline is not None:
            self.timeline.stop()
        return self.losses if self.last_chunk(self.vpp - 1) else []


    def fail(self, error: Exception, remaining: list[Op]) -> None:
        """Publishes the error (unless a peer's came first) and sends a placeholder for every transfer this
        rank still owed, so that each peer's pending receive completes, finds the error and raises it."""
        if self.store is not None and not self.store.check([self.failure_key]):
            self.store.set(self.failure_key, f"pipeline rank {self.state.pp_rank} (global rank {self.state.rank}) "
                                             f"raised {type(error).__name__}: {error}")
        placeholder = torch.full(self.comm.tensor_shape, float("nan"), dtype=self.comm.dtype,
                                 device=self.state.device)
        for op in remaining:
            if op.kind == "F" and not self.last_chunk(op.chunk):
                self.comm.post(send_next=placeholder)
            elif op.kind == "B" and not self.first_chunk(op.chunk):
                self.comm.post(send_prev=placeholder)
        # never waited for: a peer may be gone; kept alive (by the layout) so the sends can go out
        self.state.abandoned_transfers.append(self.comm)


def _default_store():
    """The store of the default process group (used to publish a rank's failure to its peers)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: failures still surface, through the process group timeout
        return None


def _deallocate(output: torch.Tensor) -> None:
    """Frees the storage of a tensor already sent downstream; its autograd node (grad_fn) stays."""
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
