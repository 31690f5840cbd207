"""The executor of the pipeline schedules: runs one rank's order of passes (``schedule_plan``) given a
``ScheduleCall``, and derives every transfer from it.

- F of (chunk, micro-batch): take the activation from the previous stage (or the data, on the model's first
  chunk), run ``forward_step_func``, send the output to the next stage (or, on the model's last chunk, turn
  it into the loss with the returned ``loss_func``). A sent output is deallocated at once (its storage freed,
  its autograd node kept), so a stage holds activations only for micro-batches whose backward is pending.
- B: take the output gradient from the next stage (or back-propagate the loss), run backward, send the
  input gradient to the previous stage.
- W (zero bubble only): the weight-gradient GEMMs the linear layers deferred in the micro-batch's B
  (``WeightGradStore``, held by the ``ParallelState``). Under zero bubble every B and every W but the last
  micro-batch's last pass runs inside the chunk's ``no_sync()``: a data-parallel wrapper reduces after it.

Model chunks with a ``no_sync()`` context (a data-parallel wrapper) run every backward but the last
micro-batch's inside it.

Transfers are posted in one ``batch_isend_irecv`` per pass: the pass's send plus the receive the next pass
needs, so receives are always posted ahead and no rank waits on a send. On gloo, where each transfer is its
own background operation, each stream's next receive is posted as soon as the previous one is taken. After
the last pass, ``finalize_model_grads`` sums tied-embedding grads over the first and last stage (and
sequence-parallel grads over tp). If a rank raises, it publishes the error in the default store and sends a
placeholder (all NaN) for every transfer it still owed; each peer's next receive completes, finds the error,
and raises ``PipelineError`` carrying it (then does the same for its own peers): no rank is left waiting.

The store is not asked on every receive (a TCPStore/FileStore round trip costs more than a small transfer):
on CPU a received tensor whose first element is NaN may be a placeholder, and only then is the store asked
(a real NaN activation costs one store look-up and runs on); on other devices, where reading an element
would synchronize the stream, the store is asked every ``STORE_CHECK_EVERY`` receives and once at the end.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.distributed import finalize_model_grads
from megatron_core.parallel_state import ParallelState
from megatron_core.pipeline_parallel.p2p import P2PCommunicator, PendingRecv
from megatron_core.pipeline_parallel.schedule_plan import Op
from megatron_core.pipeline_parallel.timeline import Timeline

STORE_CHECK_EVERY = 16
ForwardStepFunc = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable]]


class PipelineError(RuntimeError):
    """Another pipeline rank failed; the message carries its error."""


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost module inside wrappers (data parallel, ...) that hold it as ``.module``."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


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


class Executor:
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
        unwrap(model).set_input_tensor(input_tensor)
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
