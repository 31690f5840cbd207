"""Token (vocab-parallel) and learned position embeddings of a language model, in Megatron's [s, b, h] layout."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import (
    VocabParallelEmbedding,
    init_method_normal,
    scatter_to_sequence_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.initialization import init_param_, padded_vocab_init
from megatron_core.transformer.block import seeded_init

__all__ = ["LanguageModelEmbedding", "padded_vocab_init"]

WORD_EMBEDDING_SEED_OFFSET = 0
POSITION_EMBEDDING_SEED_OFFSET = 1


class LanguageModelEmbedding(nn.Module):
    """``word_embeddings(ids) + position_embeddings(positions)``, then dropout.

    forward: input_ids, position_ids ``[b, s]`` -> ``[s, b, h]``, or ``[s/tp, b, h]`` with sequence
    parallelism (word embeddings reduce-scattered along s, position embeddings scattered). Communication: the
    word embedding's all-reduce (reduce-scatter) over tp.
    """

    def __init__(self, config: TransformerConfig, *, parallel_state: ParallelState, vocab_size: int,
                 padded_vocab_size: int, max_sequence_length: int, base_seed: int) -> None:
        super().__init__()
        self.config, self.tp_group = config, parallel_state.tp_group
        self.rng_tracker = parallel_state.rng_tracker  # sequence-parallel dropout: a different mask per tp rank
        with seeded_init(base_seed, WORD_EMBEDDING_SEED_OFFSET):
            self.word_embeddings = VocabParallelEmbedding(
                padded_vocab_size, config.hidden_size, tp_group=parallel_state.tp_group,
                init_method=padded_vocab_init(config.init_method_std, vocab_size), params_dtype=config.params_dtype,
                device=parallel_state.device, reduce_scatter_embeddings=config.sequence_parallel)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            shape = (max_sequence_length, config.hidden_size)
            self.position_embeddings = nn.Embedding(*shape, _weight=torch.empty(
                shape, dtype=config.params_dtype, device=parallel_state.device))
            with seeded_init(base_seed, POSITION_EMBEDDING_SEED_OFFSET):
                init_param_(self.position_embeddings.weight, shape,
                            init_method=init_method_normal(config.init_method_std))
            set_tensor_model_parallel_attributes(self.position_embeddings.weight, is_parallel=False, dim=-1, stride=1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        sequence_parallel = self.config.sequence_parallel
        if sequence_parallel:
            hidden = self.word_embeddings(input_ids)  # [s/tp, b, h], reduce-scattered along s
        else:  # the ids transposed (tiny), not the embeddings: [s, b, h] comes out contiguous
            hidden = self.word_embeddings(input_ids.t())  # [s, b, h]
        if self.position_embeddings is not None:
            positions = self.position_embeddings(position_ids.t())  # [s, b, h], replicated
            if sequence_parallel:  # backward all-gathers, so every rank's weight grad is complete
                positions = scatter_to_sequence_parallel_region(positions, self.tp_group)
            hidden = hidden + positions
        if self.training and self.config.hidden_dropout > 0:
            if sequence_parallel:  # each rank holds a different chunk: different masks
                with self.rng_tracker.fork():
                    return F.dropout(hidden, self.config.hidden_dropout)
            return F.dropout(hidden, self.config.hidden_dropout)
        return hidden.contiguous()  # a no-op unless the lookup returned a view
