"""The planner's zero-bubble memory (planning.zero_bubble): the bytes a split backward keeps for its W pass,
counted by hand for one layer, and the extra peak per rank for both splits. (The banner test checks the
prediction against a measured run.)"""
import pytest

from megatron_core.config import TransformerConfig
from megatron_core.planning.activations import ActivationShape
from megatron_core.planning.zero_bubble import weight_stash_bytes, zero_bubble_extra_bytes


def _config(**overrides):
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, max_position_embeddings=32,
                  tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    return TransformerConfig(**{**values, **overrides})


def test_one_layer_stash_counted_by_hand():
    s, b, h, t, ffn, vocab = 32, 2, 64, 2, 256, 512
    shape = ActivationShape(seq_length=s, micro_batch_size=b, tp=t, element_bytes=2)
    qkv = 3 * h  # q + 2 kv without GQA
    by_hand = 2 * ((s * b * h + s * b * qkv / t) + (s * b * h / t + s * b * h)      # QKV, proj
                   + (s * b * h + s * b * ffn / t) + (s * b * ffn / t + s * b * h))  # fc1, fc2
    assert weight_stash_bytes(_config(), shape, layers=1, last=False, padded_vocab_size=vocab) == by_hand
    with_output = weight_stash_bytes(_config(), shape, layers=1, last=True, padded_vocab_size=vocab)
    assert with_output == by_hand + 2 * (s * b * h + s * b * vocab / t)
    overlap = _config(sequence_parallel=True, tp_comm_overlap=True)
    assert weight_stash_bytes(overlap, shape, layers=1, last=True, padded_vocab_size=vocab) == 0.0


@pytest.mark.parametrize("defer", ["all", "cooldown"])
def test_rank_0_runs_whole_backwards(defer):
    assert zero_bubble_extra_bytes(pp_rank=0, pp_size=4, num_microbatches=8, defer=defer, microbatch_bytes=10.0,
                                   stash_bytes=3.0) == 0.0


def test_zb_h1_holds_r_stashes_and_cooldown_only_what_its_draining_stage_cannot_absorb():
    common = dict(pp_size=4, num_microbatches=8, microbatch_bytes=10.0, stash_bytes=3.0)
    assert [zero_bubble_extra_bytes(pp_rank=r, defer="all", **common) for r in range(4)] == [0, 3, 6, 9]
    # cooldown: the split backwards of ranks 1-2 come while they drain (each frees a micro-batch as it adds a
    # stash); the last stage holds 1 micro-batch and, before its last B, 2 stashes
    assert [zero_bubble_extra_bytes(pp_rank=r, defer="cooldown", **common) for r in range(4)] == [0, 0, 0, 6]
