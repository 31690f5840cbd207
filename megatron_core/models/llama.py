"""A Llama-style model (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, untied output layer),
built only from a config and a layer spec: a worked example of adding an architecture without copying
the model code."""
from __future__ import annotations

from megatron_core.config import TransformerConfig
from megatron_core.models.gpt import GPTModel
from megatron_core.parallel_state import ParallelState
from megatron_core.transformer.norms import RMSNorm
from megatron_core.transformer.spec import TransformerLayerSpec


def llama_layer_spec() -> TransformerLayerSpec:
    """RMSNorm before attention, before the MLP and at the end of the decoder."""
    return TransformerLayerSpec(input_norm=RMSNorm, pre_mlp_norm=RMSNorm, final_norm=RMSNorm)


def llama_config(**overrides) -> TransformerConfig:
    """A TransformerConfig with Llama's choices; ``overrides`` sets sizes and anything else."""
    defaults = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                    add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                    attention_dropout=0.0, layernorm_epsilon=1e-5)
    return TransformerConfig(**{**defaults, **overrides})


def llama_model(config: TransformerConfig, *, parallel_state: ParallelState, vocab_size: int,
                max_sequence_length: int, **kwargs) -> GPTModel:
    """A GPTModel with the Llama layer spec and untied embeddings (other keywords as GPTModel)."""
    return GPTModel(config, parallel_state=parallel_state, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, layer_spec=llama_layer_spec(),
                    share_embeddings_and_output_weights=False, **kwargs)
