"""The engine on a background thread of rank 0, fed from an asyncio server.

The HTTP handlers run on the event loop; ``engine.step()`` (a forward, and the collectives that keep the other
ranks in step) runs on one thread of its own, so a forward never blocks the event loop. They meet in three
places, all under one lock: new requests (validated on the event loop, queued on the engine's thread at the
next step), aborts (a client that went away), and outputs (handed back to each request's ``asyncio.Queue``
with ``call_soon_threadsafe``). With nothing to run the thread still steps every ``heartbeat_s`` seconds: an
"idle" plan that keeps the followers' broadcast from timing out.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Optional, Sequence

from megatron_core.inference.engine import InferenceEngine, RequestOutput
from megatron_core.inference.scheduler import QueueFull, Request, SamplingParams

logger = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The server is stopping and takes no new request (HTTP 503)."""


class EngineLoop:
    """Runs ``engine`` on a thread (rank 0). ``submit`` / ``abort`` from the event loop; ``shutdown`` stops it.

    Args:
        engine: rank 0's engine (the other ranks run ``engine.follow()``).
        heartbeat_s: the longest time between two plans when idle.
    """

    def __init__(self, engine: InferenceEngine, *, heartbeat_s: float = 2.0) -> None:
        self.engine, self.heartbeat_s = engine, heartbeat_s
        self._wake = threading.Condition()
        self._pending: list[Request] = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping, self._closed, self._drain_deadline = False, False, 0.0
        self._thread: Optional[threading.Thread] = None
        self.steps = 0
        self.finished: collections.Counter[str] = collections.Counter()  # requests ended, by finish_reason

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inference-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, *,
               queue: Optional[asyncio.Queue] = None) -> tuple[str, asyncio.Queue]:
        """Queues a request (call on the event loop); returns its id and the queue (``queue``, or a new one)
        its ``RequestOutput``s arrive on, the last one with ``finished``. Raises ValueError (bad request),
        QueueFull, ShuttingDown."""
        request = self.engine.make_request(prompt_ids, params)
        self.engine.scheduler.check_fits(request)  # (reads the pool's size only: safe from this thread)
        queue = asyncio.Queue() if queue is None else queue
        with self._wake:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            waiting = len(self.engine.scheduler.waiting) + len(self._pending)
            if waiting >= self.engine.scheduler.max_queued:
                raise QueueFull(f"{waiting} requests are already waiting (the server's limit); retry later")
            self._pending.append(request)
            self._queues[request.request_id] = (asyncio.get_running_loop(), queue)
            self._wake.notify()
        return request.request_id, queue

    def abort(self, request_id: str) -> None:
        """Ends a request whose client went away (its blocks return to the pool at the next step)."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def shutdown(self, *, drain_s: float = 10.0) -> None:
        """Stops taking requests, lets running ones finish for up to ``drain_s`` seconds, aborts the rest,
        sends "stop" to the followers and joins the thread."""
        with self._wake:
            if self._closed:
                return
            self._closed = self._stopping = True
            self._drain_deadline = time.monotonic() + drain_s
            self._wake.notify()
        if self._thread is None:  # never started: the followers still wait for a plan
            self.engine.stop()
        else:
            self._thread.join()

    def _run(self) -> None:
        try:
            while self._cycle():
                pass
        except Exception:  # noqa: BLE001 - a broken engine: fail every request, then stop the followers
            logger.exception("the inference engine failed; failing every request")
            for request in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
                self._deliver([self.engine.finish(request, "error")])
        finally:
            self.engine.stop()

    def _cycle(self) -> bool:
        """One pass: take new requests and aborts, step (or heartbeat), deliver. False when done."""
        with self._wake:
            if not (self.engine.has_work() or self._pending or self._aborts or self._stopping):
                self._wake.wait(timeout=self.heartbeat_s)
            pending, self._pending = self._pending, []
            aborts, self._aborts = self._aborts, []
            stopping, deadline = self._stopping, self._drain_deadline
        outputs = [self._enqueue(request) for request in pending]
        outputs += [self.engine.abort(request_id) for request_id in aborts]
        if stopping and (not self.engine.has_work() or time.monotonic() > deadline):
            scheduler = self.engine.scheduler
            outputs += [self.engine.abort(r.request_id) for r in [*scheduler.running, *scheduler.waiting]]
            self._deliver([o for o in outputs if o is not None])
            return False
        outputs += self.engine.step()
        self.steps += 1
        self._deliver([o for o in outputs if o is not None])
        return True

    def _enqueue(self, request: Request) -> Optional[RequestOutput]:
        try:
            self.engine.enqueue(request)
            return None
        except (ValueError, QueueFull) as error:  # checked in submit already; a race with the limit
            logger.warning("request %s refused: %s", request.request_id, error)
            request.finish_reason = "error"
            return RequestOutput(request, [], [], "", True)

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        with self._wake:
            for output in outputs:
                target = self._queues.get(output.request_id)
                if target is None:
                    continue
                if output.finished:
                    self.finished[output.request.finish_reason] += 1
                    del self._queues[output.request_id]
                loop, queue = target
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, output)
                except RuntimeError:  # the event loop is closed: nobody is listening any more
                    pass


__all__ = ["EngineLoop", "ShuttingDown"]
