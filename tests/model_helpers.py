"""Shared pieces of the model tests: a tiny config, a batch, and gathering tp shards back to full tensors."""
from __future__ import annotations

import torch

from megatron_core import initialize_model_parallel
from megatron_core.checkpointing.layout import merge_shards
from megatron_core.config import TransformerConfig
from megatron_core.distributed import finalize_model_grads
from megatron_core.models import GPTModel

VOCAB, SEQ, BATCH = 50, 8, 2
DIVISIBLE_BY = 16  # padded vocab 64 at tp 1, 2 and 4


def tiny_config(**overrides) -> TransformerConfig:
    values = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                  max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**values, **overrides})


def make_batch(seed: int = 0, batch: int = BATCH, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    return tokens[:, :-1].contiguous(), positions, tokens[:, 1:].contiguous()


def build_model(config: TransformerConfig, state, seed: int = 1234, **kwargs) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config, parallel_state=state, vocab_size=VOCAB, max_sequence_length=SEQ,
                    make_vocab_size_divisible_by=DIVISIBLE_BY, **kwargs)


def loss_and_grads(model: GPTModel, state, seed: int = 0):
    """Mean loss of one batch, backward, finalize; returns (per-token loss, {name: (grad, dim, stride)})."""
    input_ids, positions, labels = make_batch(seed)
    loss = model(input_ids, positions, labels=labels)
    loss.mean().backward()
    finalize_model_grads(model, state)
    grads = {name: (p.grad.clone(), p.partition_dim if p.tensor_model_parallel else None, p.partition_stride)
             for name, p in model.named_parameters()}
    return loss.detach(), grads


def run_tiny_model(tp: int, config_overrides: dict, model_kwargs: dict | None = None, seed: int = 1234):
    """Builds the tiny model at ``tp`` (= this process's world size, or 1 without a process group)."""
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    config = tiny_config(tensor_model_parallel_size=tp, **config_overrides)
    model = build_model(config, state, seed, **(model_kwargs or {}))
    return loss_and_grads(model, state)


def unshard(shards: list[torch.Tensor], dim: int | None, stride: int) -> torch.Tensor:
    """Reassembles the full tensor from the tp shards of a parameter (or its grad)."""
    return merge_shards(shards, dim, stride)


def full_grads(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    names = per_rank[0].keys()
    return {name: unshard([grads[name][0] for grads in per_rank], *per_rank[0][name][1:]) for name in names}
