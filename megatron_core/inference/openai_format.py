"""OpenAI response bodies (completions and chat completions, whole and as stream chunks) from engine results.

Log-probabilities are those of the chosen tokens (the model's, before temperature / top-k / top-p);
``top_logprobs`` holds the chosen token only. The end-of-document token counts as a completion token (it is in
``usage`` and in the log-probabilities) but not in the text.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

from megatron_core.inference.engine import RequestOutput
from megatron_core.inference.scheduler import Request


def sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _token_strings(tokenizer, tokens: Sequence[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in tokens]


def _completion_logprobs(tokenizer, tokens: Sequence[int], logprobs: Sequence[float]) -> dict:
    strings = _token_strings(tokenizer, tokens)
    return {"tokens": strings, "token_logprobs": list(logprobs),
            "top_logprobs": [{s: lp} for s, lp in zip(strings, logprobs)], "text_offset": None}


def _chat_logprobs(tokenizer, tokens: Sequence[int], logprobs: Sequence[float]) -> dict:
    strings = _token_strings(tokenizer, tokens)
    return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                        for s, lp in zip(strings, logprobs)]}


def _usage(finals: Sequence[tuple[Request, str]], n: int) -> dict:
    prompt = sum(len(finals[i][0].prompt) for i in range(0, len(finals), n))  # each prompt once, not per choice
    completion = sum(len(request.generated) for request, _ in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(rid: str, created: int, model: str, finals: Sequence[tuple[Request, str]], tokenizer, *,
                        echo: Sequence[str], logprobs: bool, n: int) -> dict:
    """``text_completion`` for every job's ``(request, text)``."""
    choices = [{"index": i, "text": echo[i] + text, "finish_reason": request.finish_reason,
                "logprobs": _completion_logprobs(tokenizer, request.generated, request.logprobs) if logprobs else None}
               for i, (request, text) in enumerate(finals)]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(finals, n)}


def completion_chunk(rid: str, created: int, model: str, index: int, output: RequestOutput, tokenizer, *,
                     logprobs: bool) -> dict:
    """One streamed ``text_completion`` chunk with the output's new text."""
    choice = {"index": index, "text": output.text,
              "finish_reason": output.request.finish_reason if output.finished else None,
              "logprobs": _completion_logprobs(tokenizer, output.tokens, output.logprobs) if logprobs else None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_response(rid: str, created: int, model: str, finals: Sequence[tuple[Request, str]], tokenizer, *,
                  logprobs: bool, n: int) -> dict:
    """``chat.completion`` for every choice's ``(request, text)``."""
    choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": request.finish_reason,
                "logprobs": _chat_logprobs(tokenizer, request.generated, request.logprobs) if logprobs else None}
               for i, (request, text) in enumerate(finals)]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(finals, n)}


def chat_chunk(rid: str, created: int, model: str, index: int, output: Optional[RequestOutput], tokenizer, *,
               logprobs: bool = False) -> dict:
    """One ``chat.completion.chunk``: the assistant role first (``output`` None), then the new text."""
    if output is None:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                  "logprobs": None}
    else:
        choice = {"index": index, "delta": {"content": output.text} if output.text or not output.finished else {},
                  "finish_reason": output.request.finish_reason if output.finished else None,
                  "logprobs": _chat_logprobs(tokenizer, output.tokens, output.logprobs) if logprobs else None}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


__all__ = ["sse", "completion_response", "completion_chunk", "chat_response", "chat_chunk"]
