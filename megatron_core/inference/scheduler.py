"""Continuous batching: which tokens of which requests run in the next forward (rank 0 only, no tensors).

Every step packs up to ``max_tokens_per_step`` new tokens: first one token of each running request that is
decoding (all of them fit: the budget is at least the batch size), then the next chunk of each running request
still reading its prompt (chunked prefill), then the prompts of waiting requests, oldest first, while the budget,
the batch size and the block pool allow. A request joins the running batch at any step and leaves it at the step
it ends, when its blocks return to the pool.

Admission reserves the blocks of the request's whole budget (prompt + max_tokens - 1 positions: the last
token is never fed back), so a running request never runs out of cache and nothing is ever preempted; a
request that does not fit waits at the head of the queue (no overtaking, so no starvation). A request that could
not fit even in an empty pool is refused when it is added.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional, Sequence

from megatron_core.inference.paged_cache import BlockPool


class QueueFull(RuntimeError):
    """More requests wait than the scheduler's ``max_queued`` (the server answers HTTP 429)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Args:
        max_tokens: tokens to generate at most (>= 1).
        temperature: 0 for greedy (argmax); > 0 to sample after dividing the logits by it.
        top_k: sample among the k most likely tokens only (0: all).
        top_p: sample among the smallest set of tokens whose probability reaches top_p (1.0: all).
        seed: the request's own generator seed (same seed, same tokens); None draws one.
        stop: strings that end the generation; the text is cut before the first one found.
        stop_token_ids: token ids that end the generation (kept in the tokens, not in the text).
        ignore_eos: keep generating past the end-of-document token.
        prompt_logprobs: also return log p(prompt[i] | prompt[:i]) for i >= 1.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One request's part of a step: feed ``tokens`` at positions ``start..`` into the blocks of
    ``block_table``; when ``sample``, pick the next token after the last one with ``(temperature, top_k, top_p,
    seed)``; ``prompt_targets``: the prompt tokens that the first ``len(prompt_targets)`` fed tokens predict
    (their log-probabilities are wanted)."""

    request_id: str
    block_table: tuple[int, ...]
    start: int
    tokens: tuple[int, ...]
    sample: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    prompt_targets: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What every rank runs next: ``kind`` "step" (run ``entries``), "idle" (nothing: a heartbeat that keeps the
    followers' collectives from timing out) or "stop" (leave the loop). ``finished``: requests that ended since
    the last plan (their sampling generators are dropped)."""

    kind: str
    entries: tuple[PlanEntry, ...] = ()
    finished: tuple[str, ...] = ()


@dataclasses.dataclass(eq=False)
class Request:
    """A request's state on rank 0: prompt, params, blocks, and what it generated so far."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # positions whose keys/values are in the cache
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    first_token_time: Optional[float] = None

    @property
    def sequence(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.generated)

    @property
    def positions_needed(self) -> int:
        """Cache positions the request may fill: prompt + max_tokens - 1 (the last token is not fed back)."""
        return len(self.prompt) + self.params.max_tokens - 1


class Scheduler:
    """The waiting queue and running batch of rank 0 (see the module docstring). Not thread-safe: the engine
    serializes calls. No communication.

    Args:
        pool: the block pool the requests' caches come from.
        max_tokens_per_step: new tokens per forward (>= max_batch_size, so every running request decodes).
        max_batch_size: requests in the running batch at most.
        max_queued: waiting requests at most; ``add`` raises QueueFull past it.
    """

    def __init__(self, pool: BlockPool, *, max_tokens_per_step: int, max_batch_size: int, max_queued: int) -> None:
        if max_batch_size < 1 or max_tokens_per_step < max_batch_size or max_queued < 0:
            raise ValueError(f"need max_batch_size >= 1, max_tokens_per_step >= max_batch_size and max_queued >= 0; "
                             f"got max_batch_size {max_batch_size}, max_tokens_per_step {max_tokens_per_step}, "
                             f"max_queued {max_queued}")
        self.pool = pool
        self.max_tokens_per_step, self.max_batch_size, self.max_queued = max_tokens_per_step, max_batch_size, max_queued
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._finished_since_plan: list[str] = []

    def check_fits(self, request: Request) -> None:
        """Raises ValueError when even the empty pool cannot hold ``request``."""
        need = self.pool.blocks_for(request.positions_needed)
        if need > self.pool.num_blocks:
            raise ValueError(f"the request needs {need} cache blocks ({request.positions_needed} positions of "
                             f"{self.pool.block_size}) but the whole pool holds {self.pool.num_blocks}; lower "
                             "max_tokens or the prompt, or start the server with a larger --inference-max-memory")

    def add(self, request: Request) -> None:
        """Queues ``request``. Raises ValueError when even the empty pool cannot hold it, QueueFull when
        ``max_queued`` requests already wait."""
        self.check_fits(request)
        if len(self.waiting) >= self.max_queued:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (the server's limit); retry later")
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """The next step's plan ("idle" when there is nothing to run). Admits waiting requests (allocating
        their blocks) as the token budget, batch size and free blocks allow."""
        budget, entries = self.max_tokens_per_step, []
        decoding = [r for r in self.running if r.num_computed >= len(r.prompt)]
        prefilling = [r for r in self.running if r.num_computed < len(r.prompt)]
        for request in decoding + prefilling:  # decodes first: every one fits (budget >= max_batch_size)
            if budget == 0:
                break
            entries.append(self._entry(request, budget))
            budget -= len(entries[-1].tokens)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            need = self.pool.blocks_for(request.positions_needed)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            request.blocks = self.pool.allocate(need)
            self.running.append(request)
            entries.append(self._entry(request, budget))
            budget -= len(entries[-1].tokens)
        finished, self._finished_since_plan = tuple(self._finished_since_plan), []
        return StepPlan("step" if entries else "idle", tuple(entries), finished)

    def _entry(self, request: Request, budget: int) -> PlanEntry:
        sequence = request.sequence
        end = min(len(sequence), request.num_computed + budget)
        targets = ()
        if request.params.prompt_logprobs and request.num_computed < len(request.prompt):
            targets = tuple(request.prompt[request.num_computed + 1:min(end + 1, len(request.prompt))])
        params = request.params
        return PlanEntry(request.request_id, tuple(request.blocks), request.num_computed,
                         tuple(sequence[request.num_computed:end]), end == len(sequence), params.temperature,
                         params.top_k, params.top_p, request.seed, targets)

    def advance(self, plan: StepPlan, results: Sequence[tuple[Optional[int], float, Sequence[float]]],
                now: Optional[float] = None) -> list[Request]:
        """Records a step's results: ``results[i]`` is ``(token, its log-probability, prompt log-probs)`` for
        entry i (token None for a prefill chunk that samples nothing). Returns the requests that got a token."""
        by_id = {request.request_id: request for request in self.running}
        updated, now = [], time.monotonic() if now is None else now
        for entry, (token, logprob, prompt_logprobs) in zip(plan.entries, results):
            request = by_id.get(entry.request_id)
            if request is None:  # finished (aborted) while the step ran
                continue
            request.num_computed = entry.start + len(entry.tokens)
            request.prompt_logprobs.extend(prompt_logprobs)
            if token is None:
                continue
            request.generated.append(token)
            request.logprobs.append(logprob)
            request.first_token_time = request.first_token_time or now
            updated.append(request)
        return updated

    def finish(self, request: Request, reason: str) -> None:
        """Ends ``request`` (running or waiting) with ``reason``; its blocks return to the pool."""
        if request.finish_reason is not None:
            return
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
            self.pool.free(request.blocks)
            request.blocks = []
            self._finished_since_plan.append(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)

    def find(self, request_id: str) -> Optional[Request]:
        return next((r for r in (*self.running, *self.waiting) if r.request_id == request_id), None)


__all__ = ["SamplingParams", "PlanEntry", "StepPlan", "Request", "Scheduler", "QueueFull"]
