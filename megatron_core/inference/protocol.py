"""Request bodies of the text generation server, validated by pydantic (unknown fields are refused).

OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (plus vLLM's ``top_k``, ``ignore_eos`` and
``stop_token_ids``) and Megatron-LM's ``PUT /api``. Each turns into ``SamplingParams``; a field that we accept
for compatibility but do not implement (penalties, logit_bias, more than one top log-probability, beam search)
is refused with a message naming it, never silently ignored. Imported by the server only: pydantic is a
dependency of the ``serve`` extra.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from megatron_core.inference.scheduler import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAIBase(_Strict):
    """The fields both OpenAI endpoints share."""

    model: Optional[str] = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None

    def unsupported(self) -> Optional[str]:
        """Why the request asks for something the engine does not do, or None."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported (leave them 0)"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def sampling(self, max_tokens: int, choice: int, *, prompt_logprobs: bool = False) -> SamplingParams:
        """The engine's parameters for choice ``choice`` (seed + choice, so the n choices differ)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=None if self.seed is None else self.seed + choice, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              prompt_logprobs=prompt_logprobs)


class CompletionRequest(_OpenAIBase):
    """``POST /v1/completions``."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def unsupported(self) -> Optional[str]:
        if self.logprobs is not None and self.logprobs > 1:
            return f"logprobs={self.logprobs}: only the chosen token's log-probability is returned (use 0 or 1)"
        if self.best_of not in (None, self.n):
            return "best_of other than n is not supported"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAIBase):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)

    def unsupported(self) -> Optional[str]:
        if self.top_logprobs:
            return "top_logprobs > 0 is not supported: only the chosen token's log-probability is returned"
        return super().unsupported()


class MegatronGenerateRequest(_Strict):
    """Megatron-LM's ``PUT /api`` (its defaults: sampling at temperature 1; ``top_k=1`` is greedy)."""

    prompts: list[str] = Field(min_length=1, max_length=128)
    tokens_to_generate: int = Field(64, ge=0)
    logprobs: bool = False
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    top_k: int = Field(0, ge=0, le=1000)
    top_p: float = Field(0.0, ge=0.0, le=1.0)
    add_BOS: bool = False
    random_seed: int = Field(-1, ge=-1)
    stop_token: Optional[int] = None
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    no_log: bool = False

    def unsupported(self) -> Optional[str]:
        if self.tokens_to_generate == 0 and not self.logprobs:
            return "tokens_to_generate=0 implies logprobs should be True"
        if self.top_k > 0 and self.top_p > 0.0:
            return "cannot set both top-k and top-p samplings."
        if any(not p for p in self.prompts) and not self.add_BOS:
            return "Empty prompts require add_BOS=true"
        return None

    def sampling(self, index: int) -> SamplingParams:
        """Prompt ``index``'s parameters; tokens_to_generate=0 (scoring) runs one token and drops it."""
        stop = ("\n\n",) if self.stop_on_double_eol else ("\n",) if self.stop_on_eol else ()
        return SamplingParams(max_tokens=max(self.tokens_to_generate, 1), temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p or 1.0,
                              seed=None if self.random_seed < 0 else self.random_seed + index, stop=stop,
                              stop_token_ids=() if self.stop_token is None else (self.stop_token,),
                              prompt_logprobs=self.logprobs)


__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "MegatronGenerateRequest", "StreamOptions"]
