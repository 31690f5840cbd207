"""An inference engine with continuous batching over a paged key/value cache, at any tp x pp layout.

Rank 0 owns the requests: its ``Scheduler`` makes each step's ``StepPlan`` (which tokens of which requests run,
in which cache blocks), and ``dist.broadcast_object_list`` sends the plan to every rank of the world group.
Every rank then runs the same packed forward (``PagedStep``: the new tokens of all requests as one sequence
``[1, T]``): pipeline stages pass hidden states ``[T, 1, h]`` with send/recv on ``pp_group``, tensor parallelism
works inside the model. The last stage samples one token per request that finished its prompt (greedy, or the
request's seeded generator with temperature / top-k / top-p: ``sample_token``, as ``generate`` does) and sends
the results to rank 0 (``broadcast_object_list`` on rank 0's pipeline group). Rank 0 applies the stop rules
(end of document, stop tokens, stop strings, max_tokens) and frees the blocks of requests that ended.

    engine = InferenceEngine(model, state, num_blocks=256, block_size=16, tokenizer=tokenizer)
    if state.rank == 0:
        requests = [engine.add_request(ids, SamplingParams(max_tokens=20)) for ids in prompts]
        engine.run_until_done()
        engine.stop()          # the followers leave follow()
    else:
        engine.follow()

Greedy requests give ``generate``'s tokens whatever batch they share: each request's tokens see only its own
context (the block-diagonal causal mask), and every op is row-wise in the packed sequence.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core.inference.generation import pipeline_forward, sample_token
from megatron_core.inference.paged_cache import BlockPool, PagedKVCache, PagedStep, StepEntry, blocks_in_memory
from megatron_core.inference.scheduler import PlanEntry, Request, SamplingParams, Scheduler, StepPlan
from megatron_core.inference.text import TextStream
from megatron_core.models import GPTModel
from megatron_core.parallel_state import ParallelState

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestOutput:
    """What one step added to a request (rank 0): new tokens, their log-probabilities and text, and whether the
    request ended (``request.finish_reason``: "stop", "length", "abort" or "error")."""

    request: Request
    tokens: list[int]
    logprobs: list[float]
    text: str
    finished: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id


class InferenceEngine:
    """Continuous batching of generation requests (see the module docstring).

    Args:
        model: this rank's stage, built with ``parallel_output=False`` (``load_gpt_from_checkpoint``), eval mode.
        state: the layout; every rank of its world takes part in every step.
        num_blocks: cache blocks; or ``max_memory_bytes``: the blocks that fit in that many bytes on every rank
            (the smallest count over the ranks: an all-reduce MIN at construction).
        block_size: token slots per block.
        max_tokens_per_step: new tokens per forward (prefill chunks and decodes together).
        max_batch_size: requests running at once.
        max_queued: requests waiting at most (then ``add_request`` raises QueueFull).
        max_sequence_length: prompt + max_tokens limit (default ``config.max_position_embeddings``).
        tokenizer: for text, stop strings and the end-of-document id (``eod``); None: token ids only.
        eos_id: the end-of-document id (default the tokenizer's ``eod`` when it is a vocab id).
    """

    def __init__(self, model: GPTModel, state: ParallelState, *, num_blocks: Optional[int] = None,
                 max_memory_bytes: Optional[int] = None, block_size: int = 16, max_tokens_per_step: int = 512,
                 max_batch_size: int = 64, max_queued: int = 1024, max_sequence_length: Optional[int] = None,
                 tokenizer=None, eos_id: Optional[int] = None) -> None:
        if model.config.multi_latent_attention:
            raise ValueError("the paged engine (and the server over it) caches per-head keys and values; a model "
                             "with multi_latent_attention caches its compressed latents instead, which the paged "
                             "cache does not hold: generate with the static path (megatron_core.inference.generate, "
                             "tools/generate.py), whose InferenceCache stores them")
        if (num_blocks is None) == (max_memory_bytes is None):
            raise ValueError("give the cache size as exactly one of num_blocks and max_memory_bytes")
        self.model, self.state, self.tokenizer = model, state, tokenizer
        if num_blocks is None:
            num_blocks = blocks_in_memory(max_memory_bytes, model.config, num_local_layers=len(model.decoder.layers),
                                          tp_size=state.tp_size, block_size=block_size)
        num_blocks = self._smallest_over_ranks(num_blocks)
        self.cache = PagedKVCache(num_blocks, block_size)
        self.vocab_size = model.vocab_size
        self.max_sequence_length = int(max_sequence_length or model.config.max_position_embeddings)
        default_eos = getattr(tokenizer, "eod", None)
        self.eos_id = eos_id if eos_id is not None else (
            default_eos if default_eos is not None and 0 <= default_eos < self.vocab_size else None)
        self.scheduler = Scheduler(BlockPool(num_blocks, block_size), max_tokens_per_step=max_tokens_per_step,
                                   max_batch_size=max_batch_size, max_queued=max_queued)
        self._ids = itertools.count()
        self._texts: dict[str, TextStream] = {}
        self._generators: dict[str, torch.Generator] = {}  # the last stage's sampling generators, by request

    def _smallest_over_ranks(self, count: int) -> int:
        if self.state.world_size == 1:
            return count
        value = torch.tensor([count], dtype=torch.long, device=self.state.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value)

    # -- rank 0: requests -------------------------------------------------------------------------------------

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                     request_id: Optional[str] = None) -> Request:
        """A validated request (not queued yet; no state touched, safe from any thread). Raises ValueError
        naming the values: an empty prompt, ids outside the vocab, prompt + max_tokens past the context."""
        prompt = tuple(int(i) for i in prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [i for i in prompt if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} fall outside the vocab [0, {self.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.max_sequence_length:
            raise ValueError(f"this model's maximum context length is {self.max_sequence_length} tokens, but "
                             f"{total} were requested ({len(prompt)} in the prompt, {params.max_tokens} for the "
                             "completion); shorten the prompt or lower max_tokens")
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        return Request(request_id or f"req-{next(self._ids)}", prompt, params, seed)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                    request_id: Optional[str] = None) -> Request:
        """Validates and queues a request (rank 0). Raises ValueError (see ``make_request``, or a request
        larger than the whole pool) or QueueFull."""
        return self.enqueue(self.make_request(prompt_ids, params, request_id))

    def enqueue(self, request: Request) -> Request:
        """Queues a request from ``make_request`` (rank 0, the engine's thread)."""
        self.scheduler.add(request)
        if self.tokenizer is not None:
            hidden = {*request.params.stop_token_ids, *(() if self.eos_id is None else (self.eos_id,))}
            self._texts[request.request_id] = TextStream(self.tokenizer.decode, request.params.stop, hidden)
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Ends a waiting or running request (finish_reason "abort"; its blocks return to the pool)."""
        request = self.scheduler.find(request_id)
        return None if request is None else self.finish(request, "abort")

    # -- every rank: steps ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step (rank 0; the others are in ``follow``): plan, broadcast, forward, sample, stop rules. An
        "idle" plan is broadcast when nothing runs (a heartbeat). Returns the outputs of the requests that got
        a token or ended."""
        plan = self._share_plan(self.scheduler.schedule())
        if plan.kind != "step":
            return []
        try:
            results = self._execute(plan)
        except Exception:  # noqa: BLE001 - the step's requests fail with "error"; the others go on
            logger.exception("inference step of %d requests failed", len(plan.entries))
            failed = [self.scheduler.find(e.request_id) for e in plan.entries]
            return [self.finish(r, "error") for r in failed if r is not None]
        return [self._output(request) for request in self.scheduler.advance(plan, results)]

    def follow(self) -> None:
        """Ranks other than 0: run rank 0's plans until it sends "stop" (collective with ``step``)."""
        while True:
            plan = self._share_plan(None)
            if plan.kind == "stop":
                return
            if plan.kind == "step":
                try:
                    self._execute(plan)
                except Exception:  # noqa: BLE001 - rank 0 fails the same requests and goes on
                    logger.exception("inference step of %d requests failed", len(plan.entries))

    def stop(self) -> None:
        """Rank 0: tells the followers to leave ``follow`` (collective)."""
        self._share_plan(StepPlan("stop"))

    def run_until_done(self) -> list[RequestOutput]:
        """Rank 0: steps until no request waits or runs; returns every output."""
        outputs = []
        while self.has_work():
            outputs.extend(self.step())
        return outputs

    def _share_plan(self, plan: Optional[StepPlan]) -> StepPlan:
        """Broadcasts rank 0's plan over the world group (``broadcast_object_list``)."""
        if self.state.world_size == 1:
            return plan
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _execute(self, plan: StepPlan) -> Optional[list[tuple[Optional[int], float, list[float]]]]:
        """The packed forward of ``plan`` on this rank; the sampled results on rank 0 (None elsewhere)."""
        for request_id in plan.finished:
            self._generators.pop(request_id, None)
        entries = [StepEntry(e.block_table, e.start, e.tokens) for e in plan.entries]
        step = PagedStep(self.cache, entries, self.state.device)
        with torch.no_grad():
            logits = pipeline_forward(self.model, self.state, step.tokens, step, position_ids=step.positions)
            results = None if logits is None else self._sample(plan.entries, logits[0])
        if self.state.pp_size > 1 and 0 in self.state.pp_ranks:  # rank 0's pipeline group
            box = [results]
            dist.broadcast_object_list(box, src=self.state.pp_ranks[-1], group=self.state.pp_group)
            results = box[0]
        return results

    def _sample(self, entries: Sequence[PlanEntry],
                logits: torch.Tensor) -> list[tuple[Optional[int], float, list[float]]]:
        """Last stage: logits ``[T, V]`` of the packed tokens -> per entry ``(token or None, its log-prob,
        prompt log-probs)``. Log-probabilities are the model's (before temperature, top-k or top-p)."""
        ends = list(itertools.accumulate(len(e.tokens) for e in entries))
        sampling = [i for i, e in enumerate(entries) if e.sample]
        tokens, chosen = {}, []
        if sampling:
            last = logits[[ends[i] - 1 for i in sampling]].float()  # [R, V]
            greedy = last.argmax(-1).tolist()
            for row, i in enumerate(sampling):
                entry = entries[i]
                tokens[i] = greedy[row] if entry.temperature == 0 else sample_token(
                    last[row].cpu(), greedy=False, temperature=entry.temperature, top_k=entry.top_k,
                    top_p=entry.top_p, generator=self._generator(entry))
            picked = torch.tensor([tokens[i] for i in sampling], device=last.device)
            chosen = F.log_softmax(last, -1).gather(1, picked[:, None]).squeeze(1).tolist()
        logprob = dict(zip(sampling, chosen))
        results = []
        for i, entry in enumerate(entries):
            prompt_logprobs = []
            if entry.prompt_targets:
                begin = ends[i] - len(entry.tokens)
                rows = F.log_softmax(logits[begin:begin + len(entry.prompt_targets)].float(), -1)
                targets = torch.tensor(entry.prompt_targets, device=rows.device)
                prompt_logprobs = rows.gather(1, targets[:, None]).squeeze(1).tolist()
            results.append((tokens.get(i), logprob.get(i, 0.0), prompt_logprobs))
        return results

    def _generator(self, entry: PlanEntry) -> torch.Generator:
        if entry.request_id not in self._generators:
            self._generators[entry.request_id] = torch.Generator().manual_seed(entry.seed)
        return self._generators[entry.request_id]

    # -- rank 0: stop rules -----------------------------------------------------------------------------------

    def _output(self, request: Request) -> RequestOutput:
        """The output of a request that just got a token, ending it when a stop rule holds."""
        token, params = request.generated[-1], request.params
        stream = self._texts.get(request.request_id)
        text, stopped = stream.push(request.generated) if stream is not None else ("", False)
        if stopped:  # the text ends before the stop string: nothing held back to flush
            return self.finish(request, "stop", text, new=1, flush=False)
        if token in params.stop_token_ids or (token == self.eos_id and not params.ignore_eos):
            return self.finish(request, "stop", text, new=1)
        if len(request.generated) >= params.max_tokens:
            return self.finish(request, "length", text, new=1)
        return RequestOutput(request, [token], [request.logprobs[-1]], text, False)

    def finish(self, request: Request, reason: str, text: str = "", new: int = 0, flush: bool = True) -> RequestOutput:
        """Ends ``request`` with ``reason`` (its blocks return to the pool); the output carries its last ``new``
        tokens and the text not yet returned."""
        stream = self._texts.pop(request.request_id, None)
        if stream is not None and flush:
            text += stream.finish(request.generated)
        self.scheduler.finish(request, reason)
        return RequestOutput(request, request.generated[len(request.generated) - new:],
                             request.logprobs[len(request.logprobs) - new:], text, True)


__all__ = ["InferenceEngine", "RequestOutput"]
