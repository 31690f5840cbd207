"""Point-to-point transfers of activations (forward) and their gradients (backward) between pipeline stages.

All transfers use the pipeline group of the ``ParallelState`` (created up front, in the same order on every
rank) and ``torch.distributed.batch_isend_irecv`` (on gloo, one ``isend`` / ``irecv`` per transfer).
Activations and gradients travel with different tags, so the two streams between a pair of ranks never mix
(with interleaving, rank p-1 sends activations to rank 0 and rank 0 sends gradients to rank p-1 over the
same pair). Within a stream, messages arrive in the order
they were sent, which the schedules rely on.

Sends are asynchronous: ``post`` returns at once, and the communicator keeps a reference to each sent
tensor's storage until its transfer completed, so the schedule may free the output tensor right away.
Receives are posted ahead of need and waited for when the schedule needs the data, so no rank ever blocks on
a send: the only waits are for data a peer must produce. (NCCL reports completed sends as they finish and
their buffers are dropped then; gloo reports completion only on ``wait``, so there the buffers are dropped
at the end of the schedule.)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_core.parallel_state import ParallelState

ACTIVATION_TAG = 1
GRADIENT_TAG = 2


@dataclasses.dataclass
class PendingRecv:
    """A posted receive; ``wait()`` returns the tensor once it has arrived."""

    tensor: torch.Tensor
    work: Optional[object]

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor


class P2PCommunicator:
    """Sends and receives ``[s, b, h]`` tensors (``[s/tp, b, h]`` with sequence parallelism) between stages.

    Args:
        state: the layout; peers are ``state.next_pipeline_rank`` / ``prev_pipeline_rank`` (wrapping, as the
            interleaved schedule needs), over ``state.pp_group``.
        tensor_shape, dtype: of every transferred tensor.
        record: called ``(kind, start, end)`` for each send post and receive wait (the timeline).
    """

    def __init__(self, state: ParallelState, *, tensor_shape: Sequence[int], dtype: torch.dtype,
                 record: Callable[[str, float, float], None] = lambda kind, start, end: None) -> None:
        self.state, self.tensor_shape, self.dtype = state, tuple(tensor_shape), dtype
        self.record = record
        self._in_flight_sends: list[tuple[object, torch.Tensor]] = []
        # gloo runs each isend / irecv on its own, in the background: one call per op costs a fifth of a batch's
        # coalescing (160 against 30 us for a send and a receive); NCCL needs the batch (one group launch)
        self.batched = dist.get_backend(state.pp_group) != "gloo"

    def post(self, *, send_next: Optional[torch.Tensor] = None, send_prev: Optional[torch.Tensor] = None,
             recv_prev: bool = False, recv_next: bool = False) -> tuple[Optional[PendingRecv], Optional[PendingRecv]]:
        """Posts, as one batch: the activation to the next stage, the gradient to the previous stage, and
        receives of the next activation (from prev) and gradient (from next). Returns the pending receives."""
        start = time.perf_counter()
        transfers: list[tuple[bool, torch.Tensor, int, int]] = []  # (is a send, tensor, peer, tag)
        for tensor, peer, tag in ((send_next, self.state.next_pipeline_rank, ACTIVATION_TAG),
                                  (send_prev, self.state.prev_pipeline_rank, GRADIENT_TAG)):
            if tensor is not None:
                transfers.append((True, tensor.detach().contiguous(), peer, tag))
        sends = [tensor for _, tensor, _, _ in transfers]
        receives = []
        for wanted, peer, tag in ((recv_prev, self.state.prev_pipeline_rank, ACTIVATION_TAG),
                                  (recv_next, self.state.next_pipeline_rank, GRADIENT_TAG)):
            pending = None
            if wanted:
                pending = PendingRecv(torch.empty(self.tensor_shape, dtype=self.dtype, device=self.state.device), None)
                transfers.append((False, pending.tensor, peer, tag))
            receives.append(pending)
        works = self._start(transfers)
        self._in_flight_sends.extend(zip(works[: len(sends)], sends))
        for pending, work in zip([r for r in receives if r is not None], works[len(sends):]):
            pending.work = work
        if sends:
            self.record("send", start, time.perf_counter())
        return receives[0], receives[1]

    def _start(self, transfers: list[tuple[bool, torch.Tensor, int, int]]) -> list:
        group = self.state.pp_group
        if not transfers:
            return []
        if self.batched:
            return dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, group, tag)
                                           for send, tensor, peer, tag in transfers])
        return [(dist.isend if send else dist.irecv)(tensor, peer, group=group, tag=tag)
                for send, tensor, peer, tag in transfers]

    def wait(self, pending: PendingRecv) -> torch.Tensor:
        """Waits for a posted receive, recording the wait."""
        start = time.perf_counter()
        tensor = pending.wait()
        self.record("recv", start, time.perf_counter())
        return tensor

    def release_completed_sends(self, *, wait: bool = False) -> None:
        """Drops the buffers of completed sends; with ``wait`` (end of a schedule) waits for all of them."""
        if wait:
            for work, _ in self._in_flight_sends:
                work.wait()
            self._in_flight_sends = []
        else:
            self._in_flight_sends = [(work, t) for work, t in self._in_flight_sends if not work.is_completed()]
