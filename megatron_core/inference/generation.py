"""Autoregressive generation with a key/value cache, at any tp x pp layout.

Each step runs only the new tokens (the whole prompt first): pipeline stages pass the hidden states
``[s, b, h]`` with ``dist.send``/``dist.recv`` on ``state.pp_group``; tensor parallelism works inside the
model (the last stage gathers the logits over tp). The last stage picks the next token (the same on every
tp rank: identical logits, identically seeded generator) and broadcasts it over the pipeline group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core.models import GPTModel
from megatron_core.parallel_state import ParallelState
from megatron_core.transformer.inference_cache import InferenceCache


def pipeline_forward(model: GPTModel, state: ParallelState, tokens: torch.Tensor,
                     inference_cache: Optional[InferenceCache] = None, *,
                     position_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """One forward of ``tokens`` ``[b, s]`` through every pipeline stage (no sequence parallelism).

    Returns the logits ``[b, s, V]`` (gathered over tp: build the model with ``parallel_output=False``) on
    the last stage, None elsewhere. Positions ``position_ids`` ``[b, s]``, by default from the cache's offset
    (0 without a cache). ``inference_cache``: an ``InferenceCache``, or any object with its hooks (the
    engine's ``PagedStep``).
    """
    b, s = tokens.shape
    offset = inference_cache.offset if inference_cache is not None else 0
    positions = position_ids if position_ids is not None else (
        offset + torch.arange(s, device=tokens.device)).unsqueeze(0).expand(b, s)
    if not state.is_pipeline_first_stage:
        hidden = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype, device=state.device)
        dist.recv(hidden, src=state.prev_pipeline_rank, group=state.pp_group)
        model.set_input_tensor(hidden)
    cache = {} if inference_cache is None else {"inference_cache": inference_cache}
    output = model(tokens if state.is_pipeline_first_stage else None, positions, **cache)
    if not state.is_pipeline_last_stage:
        dist.send(output.contiguous(), dst=state.next_pipeline_rank, group=state.pp_group)
        return None
    return output


def sample_token(logits: torch.Tensor, *, greedy: bool, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: Optional[torch.Generator] = None) -> int:
    """The next token from fp32 logits ``[V]``: argmax, or a draw after temperature, top-k and top-p."""
    if greedy:
        return int(logits.argmax())
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}; use greedy decoding instead")
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def _broadcast_from_last_stage(values: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.pp_size > 1:
        dist.broadcast(values, src=state.pp_ranks[-1], group=state.pp_group)
    return values


@torch.no_grad()
def generate(model: GPTModel, state: ParallelState, prompt_ids: list[int], *, max_new_tokens: int,
             greedy: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, max_sequence_length: Optional[int] = None) -> dict:
    """Generates ``max_new_tokens`` tokens after ``prompt_ids`` (collective over the model-parallel ranks).

    Returns (on every rank) ``{"tokens": generated ids, "prompt_logprobs": log p(prompt[i] | prompt[:i]) for
    i >= 1, "generated_logprobs": log p of each generated token}``; the log-probabilities are the model's
    (before temperature, top-k or top-p). ``max_sequence_length``: the model's positions (default
    ``config.max_position_embeddings``); prompt + new tokens must fit.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    total = len(prompt_ids) + max_new_tokens
    limit = max_sequence_length or model.config.max_position_embeddings or total
    if total > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"the model's {limit} positions")
    cache = InferenceCache(max_sequence_length=total, batch_size=1)
    generator = torch.Generator().manual_seed(seed)
    new = torch.tensor([prompt_ids], dtype=torch.long, device=state.device)
    prompt_logprobs = torch.zeros(len(prompt_ids) - 1, dtype=torch.float64, device=state.device)
    tokens, logprobs = [], []
    for step in range(max_new_tokens):
        logits = pipeline_forward(model, state, new, cache)
        chosen = torch.zeros(2, dtype=torch.float64, device=state.device)  # (token, its log-probability)
        if logits is not None:
            logp = F.log_softmax(logits[0].float(), dim=-1)  # [s, V]
            if step == 0 and len(prompt_ids) > 1:
                prompt_logprobs = logp[:-1].gather(1, new[0, 1:, None]).squeeze(1).double()
            token = sample_token(logits[0, -1].float().cpu(), greedy=greedy, temperature=temperature, top_k=top_k,
                                 top_p=top_p, generator=generator)
            chosen = torch.tensor([token, float(logp[-1, token])], dtype=torch.float64, device=state.device)
        chosen = _broadcast_from_last_stage(chosen, state)
        tokens.append(int(chosen[0]))
        logprobs.append(float(chosen[1]))
        new = torch.tensor([[tokens[-1]]], dtype=torch.long, device=state.device)
    prompt_logprobs = _broadcast_from_last_stage(prompt_logprobs.contiguous(), state)
    return {"tokens": tokens, "prompt_logprobs": prompt_logprobs.tolist(), "generated_logprobs": logprobs}


__all__ = ["pipeline_forward", "sample_token", "generate"]
