"""The HTTP face of the engine (rank 0): OpenAI's completions and chat completions (``stream: true`` as
server-sent events), ``GET /v1/models``, ``GET /health``, and Megatron-LM's ``PUT /api``.

A bad request is answered with an OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}``:
400 for malformed JSON, unknown fields, invalid values and prompts past the context, 404 for another model's
name, 429 when the waiting queue is full, 503 while shutting down. A client that goes away (mid-stream, or
while waiting for a whole answer) has its request aborted and its cache blocks freed. fastapi is imported here
only (``tools/run_text_generation_server.py``), so ``import megatron_core`` does not need it.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import AsyncIterator, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from megatron_core.inference.engine import RequestOutput
from megatron_core.inference.engine_loop import EngineLoop, ShuttingDown
from megatron_core.inference.openai_format import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    sse,
)
from megatron_core.inference.protocol import ChatCompletionRequest, CompletionRequest, MegatronGenerateRequest
from megatron_core.inference.scheduler import QueueFull, SamplingParams

ERROR_TYPES = ((400, "invalid_request_error"), (404, "not_found_error"), (429, "rate_limit_error"),
               (500, "server_error"), (503, "service_unavailable"))


class ApiError(Exception):
    """An error answered with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    kind = dict(ERROR_TYPES).get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(x) for x in item.get("loc", ()) if x != "body")
        if item.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {item.get('ctx', {}).get('error', item.get('msg'))}")
        elif item.get("type") == "extra_forbidden":
            parts.append(f"unknown field '{where}'")
        elif item.get("type") == "missing":
            parts.append(f"missing field '{where}'" if where else "missing JSON body")
        else:
            parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "; ".join(parts) or "invalid request"


class TextGenerationServer:
    """The routes over one ``EngineLoop``.

    Args:
        engine_loop: rank 0's engine thread.
        tokenizer: encodes prompts, decodes tokens (``encode``/``decode``; ``eod`` is Megatron's BOS).
        model_name: the id ``/v1/models`` lists; a request naming another model gets 404.
        drain_s: on shutdown, how long running requests may take to finish before they are aborted.
    """

    def __init__(self, engine_loop: EngineLoop, tokenizer, *, model_name: str, drain_s: float = 10.0) -> None:
        self.loop, self.tokenizer, self.model_name, self.drain_s = engine_loop, tokenizer, model_name, drain_s
        self.engine = engine_loop.engine
        self.created = int(time.time())

    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.loop.start()
            yield
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.loop.shutdown(drain_s=self.drain_s))

        app = FastAPI(title="megatron_core text generation", lifespan=lifespan)
        app.add_exception_handler(RequestValidationError,
                                  lambda _r, e: error_response(400, _validation_message(e)))
        app.add_exception_handler(ApiError, lambda _r, e: error_response(e.status, e.message, e.param))
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/api", self.megatron_generate, methods=["PUT"])
        return app

    # -- routes -----------------------------------------------------------------------------------------------

    async def health(self) -> dict:
        pool, scheduler = self.engine.scheduler.pool, self.engine.scheduler
        return {"status": "ok", "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "free_blocks": pool.num_free, "total_blocks": pool.num_blocks, "steps": self.loop.steps,
                "finished": dict(self.loop.finished)}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "megatron_core",
                                            "max_model_len": self.engine.max_sequence_length}]}

    async def completions(self, body: CompletionRequest, request: Request):
        self._check(body)
        prompts = [self._ids(p) for p in body.prompts()]
        jobs = [(ids, self._params(lambda: body.sampling(self._max_tokens(body.max_tokens, ids), c)))
                for ids in prompts for c in range(body.n)]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return self._stream(request, jobs, lambda i, out: completion_chunk(
                rid, created, self.model_name, i, out, self.tokenizer, logprobs=body.logprobs is not None),
                include_usage=bool(body.stream_options and body.stream_options.include_usage), rid=rid,
                created=created, kind="text_completion")
        finals = await self._collect(request, jobs)
        echo = [self.tokenizer.decode(jobs[i][0]) if body.echo else "" for i in range(len(jobs))]
        return completion_response(rid, created, self.model_name, finals, self.tokenizer, echo=echo,
                                   logprobs=body.logprobs is not None, n=body.n)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check(body)
        ids = self._chat_ids(body)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        jobs = [(ids, self._params(lambda: body.sampling(self._max_tokens(limit, ids), c))) for c in range(body.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return self._stream(request, jobs, lambda i, out: chat_chunk(
                rid, created, self.model_name, i, out, self.tokenizer, logprobs=body.logprobs),
                include_usage=bool(body.stream_options and body.stream_options.include_usage), rid=rid,
                created=created, kind="chat.completion.chunk", first=lambda i: chat_chunk(
                    rid, created, self.model_name, i, None, self.tokenizer))
        finals = await self._collect(request, jobs)
        return chat_response(rid, created, self.model_name, finals, self.tokenizer, logprobs=body.logprobs, n=body.n)

    async def megatron_generate(self, body: MegatronGenerateRequest, request: Request):
        problem = body.unsupported()
        if problem:
            raise ApiError(400, problem)
        bos = [self.tokenizer.eod] if body.add_BOS else []
        jobs = []
        for i, prompt in enumerate(body.prompts):
            ids = bos + self.tokenizer.encode(prompt)
            jobs.append((ids, self._params(lambda: body.sampling(i))))
        finals = await self._collect(request, jobs)
        result = {"text": [], "segments": [], "tokens": []}
        if body.logprobs:
            result["logprobs"] = []
        for (ids, _), (request_state, _text) in zip(jobs, finals):
            generated = request_state.generated if body.tokens_to_generate > 0 else []
            tokens = list(ids) + list(generated)
            result["tokens"].append(tokens)
            result["text"].append(self.tokenizer.decode(tokens))
            result["segments"].append([self.tokenizer.decode([t]) for t in tokens])
            if body.logprobs:
                generated_logprobs = request_state.logprobs if body.tokens_to_generate > 0 else []
                result["logprobs"].append(list(request_state.prompt_logprobs) + list(generated_logprobs))
        return result

    # -- helpers ----------------------------------------------------------------------------------------------

    def _check(self, body: Union[CompletionRequest, ChatCompletionRequest]) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                           "model")
        problem = body.unsupported()
        if problem:
            raise ApiError(400, problem)

    def _ids(self, prompt: Union[str, list[int]]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty: give at least one token", "prompt")
        return ids

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        hf = getattr(self.tokenizer, "_tok", None)  # HuggingFaceTokenizer's transformers tokenizer
        if hf is not None and getattr(hf, "chat_template", None):
            encoded = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self._ids(text)  # no chat template: a plain "role: content" transcript

    def _max_tokens(self, requested: Optional[int], ids: Sequence[int]) -> int:
        if requested is None:  # as much as the context leaves
            requested = max(self.engine.max_sequence_length - len(ids), 0)
            if requested == 0:
                raise ApiError(400, f"the prompt ({len(ids)} tokens) fills the model's context of "
                               f"{self.engine.max_sequence_length} tokens", "prompt")
        if requested <= 0:
            raise ApiError(400, f"max_tokens must be >= 1, got {requested}", "max_tokens")
        return requested

    @staticmethod
    def _params(build) -> SamplingParams:
        try:
            return build()
        except ValueError as error:
            raise ApiError(400, str(error)) from error

    def _submit(self, jobs: Sequence[tuple[list[int], SamplingParams]]) -> tuple[dict[str, int], asyncio.Queue]:
        """Submits every job or none (one refused: the others are aborted); returns (request id -> job index,
        the queue all their outputs arrive on). Refusals are ApiErrors: 400, 429 (queue full), 503."""
        ids: dict[str, int] = {}
        queue: asyncio.Queue = asyncio.Queue()
        try:
            for index, (prompt, params) in enumerate(jobs):
                ids[self.loop.submit(prompt, params, queue=queue)[0]] = index
        except (ValueError, QueueFull, ShuttingDown) as error:
            for request_id in ids:
                self.loop.abort(request_id)
            status = 400 if isinstance(error, ValueError) else 429 if isinstance(error, QueueFull) else 503
            raise ApiError(status, str(error)) from error
        return ids, queue

    async def _outputs(self, request: Request, ids: dict[str, int], queue: asyncio.Queue, *,
                       poll_disconnect: bool) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(job index, output)`` as they come; aborts what is left when the client goes (polled every 0.5 s
        when ``poll_disconnect``; a stream is cancelled by the framework instead) or the caller stops."""
        open_ids = set(ids)
        try:
            while open_ids:
                try:
                    output = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if poll_disconnect and await request.is_disconnected():
                        return
                    continue
                if output.finished:
                    open_ids.discard(output.request_id)
                yield ids[output.request_id], output
        finally:
            for request_id in open_ids:
                self.loop.abort(request_id)

    async def _collect(self, request: Request, jobs) -> list[tuple]:
        """Every job's ``(final Request, its whole text)`` in job order. A job the engine failed is a 500, one
        aborted by shutdown a 503."""
        ids, queue = self._submit(jobs)
        finals: list = [None] * len(jobs)
        texts = [""] * len(jobs)
        async for index, output in self._outputs(request, ids, queue, poll_disconnect=True):
            texts[index] += output.text
            if output.finished:
                finals[index] = output.request
        if any(f is None for f in finals):
            raise ApiError(499, "the client went away")
        failed = [f for f in finals if f.finish_reason in ("error", "abort")]
        if failed:
            raise ApiError(500 if failed[0].finish_reason == "error" else 503,
                           f"the request ended with '{failed[0].finish_reason}' (see the server log)")
        return list(zip(finals, texts))

    def _stream(self, request: Request, jobs, chunk, *, include_usage: bool, rid: str, created: int, kind: str,
                first=None) -> StreamingResponse:
        """Server-sent events: ``chunk(job index, output)`` per output, usage last when asked, then [DONE].
        The jobs are submitted before the response starts, so a refusal is still an HTTP error."""
        ids, queue = self._submit(jobs)

        async def events() -> AsyncIterator[str]:
            usage = {"prompt_tokens": 0, "completion_tokens": 0}
            for index in range(len(jobs) if first is not None else 0):
                yield sse(first(index))
            async for index, output in self._outputs(request, ids, queue, poll_disconnect=False):
                if output.finished:
                    usage["prompt_tokens"] += len(output.request.prompt)
                    usage["completion_tokens"] += len(output.request.generated)
                yield sse(chunk(index, output))
            if include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                yield sse({"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                           "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


__all__ = ["TextGenerationServer", "ApiError", "error_response"]
