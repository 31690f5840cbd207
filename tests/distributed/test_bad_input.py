"""Bad input to the tensor-parallel layers: ValueError naming the values, on one process and on 4 ranks."""
import pytest
import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_size_with_padding,
)


def _build_on_tp(layer_name, *args, **kwargs):
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    try:
        {"column": ColumnParallelLinear, "row": RowParallelLinear, "embedding": VocabParallelEmbedding}[layer_name](
            *args, tp_group=state.tp_group, **kwargs)
    finally:
        destroy_model_parallel(state)


@pytest.mark.parametrize("layer, args, fragment", [
    ("column", (8, 10), "output_size 10 is not divisible by tensor_model_parallel_size 4"),
    ("row", (10, 8), "input_size 10 is not divisible by tensor_model_parallel_size 4"),
    ("embedding", (10, 8), r"vocab size \(padded\) 10 is not divisible by tensor_model_parallel_size 4"),
])
def test_sizes_not_divisible_by_tp(distributed, layer, args, fragment):
    with pytest.raises(ValueError, match=fragment):
        distributed(4, _build_on_tp, layer, *args)


def test_stride_must_divide_shard():
    with pytest.raises(ValueError, match="partitioned dim 0 of size 8 is not divisible by stride x "
                                         "tensor_model_parallel_size 3"):
        ColumnParallelLinear(4, 8, stride=3)


@pytest.mark.parametrize("build, inp, fragment", [
    (lambda: ColumnParallelLinear(8, 4), torch.randn(2, 3, 7),
     r"ColumnParallelLinear expects an input whose last dim is input_size = 8, got shape \(2, 3, 7\)"),
    (lambda: RowParallelLinear(8, 4), torch.randn(2, 5),
     r"RowParallelLinear expects an input whose last dim is input_size / tp = 8, got shape \(2, 5\)"),
    (lambda: RowParallelLinear(8, 4, input_is_parallel=False), torch.randn(2, 5),
     r"expects an input whose last dim is input_size = 8"),
    (lambda: VocabParallelEmbedding(16, 4), torch.tensor([[0, 16]]),
     r"token ids must lie in \[0, 16\), got values in \[0, 16\]"),
    (lambda: VocabParallelEmbedding(16, 4), torch.tensor([[-3, 2]]), r"got values in \[-3, 2\]"),
])
def test_wrong_input_shapes_and_ids(build, inp, fragment):
    with pytest.raises(ValueError, match=fragment):
        build()(inp)


@pytest.mark.parametrize("build, fragment", [
    (lambda: ColumnParallelLinear(8, 4, gather_output=True, sequence_parallel=True),
     "gather_output=True cannot be combined with sequence_parallel=True"),
    (lambda: RowParallelLinear(8, 4, input_is_parallel=False, sequence_parallel=True),
     "sequence_parallel=True needs input_is_parallel=True"),
])
def test_conflicting_flags(build, fragment):
    with pytest.raises(ValueError, match=fragment):
        build()


def test_tied_output_layer_takes_weight_argument():
    embedding = VocabParallelEmbedding(16, 4)
    head = ColumnParallelLinear(4, 16, bias=False, skip_weight_param_allocation=True)
    assert head.weight is None and not list(head.parameters())
    hidden = torch.randn(3, 2, 4)
    logits, _ = head(hidden, weight=embedding.weight)
    torch.testing.assert_close(logits, hidden @ embedding.weight.T)
    with pytest.raises(ValueError, match="pass weight="):
        head(hidden)
    with pytest.raises(ValueError, match=r"weight must have shape \(16, 4\), got \(4, 16\)"):
        head(hidden, weight=embedding.weight.T)


def _sequence_parallel_indivisible():
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    try:
        RowParallelLinear(8, 4, tp_group=state.tp_group, sequence_parallel=True)(torch.randn(3, 2, 4))
    finally:
        destroy_model_parallel(state)


def test_sequence_length_not_divisible_by_tp(distributed):
    with pytest.raises(ValueError, match=r"dim 0 of size 3 \(shape \(3, 2, 4\)\) is not divisible by the "
                                         r"tensor-parallel group size 2"):
        distributed(2, _sequence_parallel_indivisible)


@pytest.mark.parametrize("orig, divisible_by, tp, padded", [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 8, 51200), (256, 128, 2, 256), (1, 1, 3, 3),
])
def test_vocab_padding_matches_megatron(orig, divisible_by, tp, padded):
    assert vocab_size_with_padding(orig, make_vocab_size_divisible_by=divisible_by,
                                   tensor_model_parallel_size=tp) == padded


def test_vocab_padding_rejects_nonpositive_sizes():
    with pytest.raises(ValueError, match="orig_vocab_size=0"):
        vocab_size_with_padding(0)
