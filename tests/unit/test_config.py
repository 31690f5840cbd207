"""TransformerConfig: derived defaults, pipeline splits, and errors that name the values."""
import pytest

from megatron_core.config import TransformerConfig

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, max_position_embeddings=32)


def test_derived_defaults():
    config = TransformerConfig(**BASE)
    assert (config.num_query_groups, config.ffn_hidden_size, config.kv_channels) == (8, 256, 8)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(tensor_model_parallel_size=3), "num_attention_heads 8 is not divisible by tensor_model_parallel_size 3"),
    (dict(num_query_groups=3), "num_query_groups 3 does not divide num_attention_heads 8"),
    (dict(num_query_groups=2, tensor_model_parallel_size=4),
     "num_query_groups 2 is not divisible by tensor_model_parallel_size 4"),
    (dict(hidden_size=60), "hidden_size 60 is not divisible by num_attention_heads 8"),
    (dict(ffn_hidden_size=30, tensor_model_parallel_size=4),
     "ffn_hidden_size 30 is not divisible by tensor_model_parallel_size 4"),
    (dict(normalization="BatchNorm"), r"normalization must be one of \('LayerNorm', 'RMSNorm'\), got 'BatchNorm'"),
    (dict(activation="relu"), "activation must be one of"),
    (dict(recompute_granularity="full"), "recompute_granularity='full' needs recompute_method"),
    (dict(recompute_method="uniform"), "only apply to recompute_granularity='full'"),
    (dict(sequence_parallel=True, tensor_model_parallel_size=1),
     "sequence_parallel=True needs tensor_model_parallel_size > 1"),
    (dict(bf16=True, fp16=True), "mutually exclusive"),
    (dict(pipeline_model_parallel_size=3), "num_layers 4 is not divisible by pipeline_model_parallel_size 3"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
     "x virtual_pipeline_model_parallel_size 4"),
    (dict(num_layers=0), "num_layers must be >= 1, got 0"),
    (dict(hidden_dropout=1.0), r"hidden_dropout must lie in \[0, 1\), got 1.0"),
    (dict(max_position_embeddings=None), "learned_absolute' needs max_position_embeddings"),
])
def test_invalid_values_raise(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        TransformerConfig(**{**BASE, **overrides})


def test_uneven_split():
    config = TransformerConfig(**{**BASE, "num_layers": 5, "pipeline_model_parallel_size": 3,
                                  "first_pipeline_num_layers": 2, "last_pipeline_num_layers": 2})
    assert [config.pipeline_layer_range(r) for r in range(3)] == [(0, 2), (2, 1), (3, 2)]


def test_uneven_split_that_does_not_divide():
    with pytest.raises(ValueError, match="3 layers left for 2 other stages"):
        TransformerConfig(**{**BASE, "num_layers": 4, "pipeline_model_parallel_size": 3,
                             "first_pipeline_num_layers": 1})


def test_interleaved_layer_ranges():
    config = TransformerConfig(**{**BASE, "num_layers": 8, "pipeline_model_parallel_size": 2,
                                  "virtual_pipeline_model_parallel_size": 2})
    # chunk v of rank r holds layers (v * pp + r) * 2 ...: rank 0 -> 0-1 and 4-5, rank 1 -> 2-3 and 6-7
    assert [config.pipeline_layer_range(r, v) for r in range(2) for v in range(2)] == [(0, 2), (4, 2), (2, 2), (6, 2)]


def test_layout_sizes_come_from_the_parallel_state():
    """One source for the layout: a config without sizes takes the state's; a given size must match it."""
    from megatron_core import initialize_model_parallel
    state = initialize_model_parallel()
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, max_position_embeddings=8)
    assert config.tensor_model_parallel_size is None
    bound = config.bind_layout(state)
    assert (bound.tensor_model_parallel_size, bound.pipeline_model_parallel_size, bound.context_parallel_size,
            bound.virtual_pipeline_model_parallel_size) == (1, 1, 1, None)
    assert TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, max_position_embeddings=8,
                             tensor_model_parallel_size=1).bind_layout(state).tensor_model_parallel_size == 1
    with pytest.raises(ValueError, match="config.pipeline_model_parallel_size=2 does not match the parallel state's 1"):
        TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, max_position_embeddings=8,
                          pipeline_model_parallel_size=2).bind_layout(state)
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_model_parallel_size > 1"):
        TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, max_position_embeddings=8,
                          sequence_parallel=True).bind_layout(state)
