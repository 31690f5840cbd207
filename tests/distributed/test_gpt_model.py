"""GPTModel at tp 1, 2, 4: layout-independent init, loss and every gathered weight grad equal to tp 1;
sequence parallelism, recompute and dropout placement; Llama through a spec; a hand-split pipeline."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import initialize_model_parallel
from megatron_core.distributed import finalize_model_grads
from megatron_core.models import llama_config, llama_model
from megatron_core.tensor_parallel import model_parallel_seed
from megatron_core.transformer import MLP, TransformerLayerSpec
from tests.model_helpers import (
    SEQ,
    VOCAB,
    build_model,
    full_grads,
    loss_and_grads,
    make_batch,
    run_tiny_model,
    tiny_config,
)

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(autouse=True)
def _torch_kernels():
    yield


def _in_worker(tp, overrides, model_kwargs=None):
    return run_tiny_model(tp, overrides, model_kwargs)


def _assert_same(reference, results, what):
    ref_loss, ref_grads = reference
    gathered = full_grads([grads for _, grads in results])
    for rank, (loss, _) in enumerate(results):
        torch.testing.assert_close(loss, ref_loss, **LOSS_TOL, msg=lambda m: f"{what} loss rank {rank}: {m}")
    assert gathered.keys() == ref_grads.keys()
    for name, grad in gathered.items():
        torch.testing.assert_close(grad, ref_grads[name][0], **GRAD_TOL, msg=lambda m: f"{what} grad {name}: {m}")


CONFIGS = {
    "gpt": {},
    "gqa-rope-swiglu-rmsnorm": dict(num_query_groups=2 * 2, num_attention_heads=8, position_embedding_type="rope",
                                    activation="swiglu", normalization="RMSNorm"),
    "untied-nobias": dict(untie_embeddings_and_output_weights=True, add_bias_linear=False),
    # Megatron's --qk-layernorm --apply-layernorm-1p --rotary-percent 0.5: the q/k norm weights see only this
    # rank's heads, so their grads must be summed over tp
    "qk-norm-1p-partial-rope": dict(qk_layernorm=True, layernorm_zero_centered_gamma=True, normalization="RMSNorm",
                                    position_embedding_type="rope", rotary_percent=0.5),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_grads_match_tp1(distributed, tp, name):
    overrides = dict(CONFIGS[name])
    reference = run_tiny_model(1, overrides)
    _assert_same(reference, distributed(tp, _in_worker, tp, overrides), f"{name} tp={tp}")


def test_sequence_parallel_matches_no_sequence_parallel(distributed):
    overrides = dict(CONFIGS["gqa-rope-swiglu-rmsnorm"])
    reference = run_tiny_model(1, overrides)
    _assert_same(reference, distributed(2, _in_worker, 2, {**overrides, "sequence_parallel": True}), "sp tp=2")


def _recompute_grads(recompute):
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    config = tiny_config(num_layers=4, tensor_model_parallel_size=state.tp_size, hidden_dropout=0.2,
                         attention_dropout=0.2, sequence_parallel=True, **recompute)
    model = build_model(config, state)
    model_parallel_seed(7, tp_rank=state.tp_rank, tracker=state.rng_tracker)
    return loss_and_grads(model, state)


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    dict(recompute_granularity="selective"),
], ids=["full-uniform", "full-block", "selective"])
def test_recompute_gives_identical_grads(distributed, recompute):
    plain = distributed(2, _recompute_grads, {})
    recomputed = distributed(2, _recompute_grads, recompute)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(plain, recomputed):
        assert torch.equal(loss_a, loss_b)
        for name in grads_a:
            assert torch.equal(grads_a[name][0], grads_b[name][0]), name


def _hidden_dropout_outputs():
    tp = dist.get_world_size() if dist.is_initialized() else 1
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    model = build_model(tiny_config(tensor_model_parallel_size=tp, hidden_dropout=0.3), state,
                        parallel_output=False)
    model_parallel_seed(11, tp_rank=state.tp_rank, tracker=state.rng_tracker)
    input_ids, positions, _ = make_batch()
    return model(input_ids, positions).detach()


def test_replicated_dropout_masks_are_identical_across_tp(distributed):
    reference = _hidden_dropout_outputs()  # tp=1 draws the same default-generator masks
    for logits in distributed(2, _hidden_dropout_outputs):
        torch.testing.assert_close(logits, reference, **LOSS_TOL)


def test_padded_vocab_never_affects_loss_or_predictions():
    state = initialize_model_parallel()
    model = build_model(tiny_config(), state, parallel_output=True)
    input_ids, positions, labels = make_batch()
    logits = model(input_ids, positions)
    assert logits.shape == (2, SEQ, 64) and torch.isinf(logits[..., VOCAB:]).all()
    loss = model(input_ids, positions, labels=labels)
    expected = F.cross_entropy(logits[..., :VOCAB].flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(loss.flatten(), expected, **LOSS_TOL)
    gathered = build_model(tiny_config(), state, parallel_output=False)(input_ids, positions)
    assert gathered.shape == (2, SEQ, VOCAB)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 50\)"):
        model(input_ids, positions, labels=torch.full_like(labels, VOCAB))


def _llama(tp):
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    config = llama_config(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=48, tensor_model_parallel_size=tp)
    torch.manual_seed(5)
    model = llama_model(config, parallel_state=state, vocab_size=VOCAB, max_sequence_length=SEQ,
                        make_vocab_size_divisible_by=16)
    assert "embedding.position_embeddings.weight" not in dict(model.named_parameters())
    return loss_and_grads(model, state)


def test_llama_through_spec_matches_tp1(distributed):
    _assert_same(_llama(1), distributed(2, _llama, 2), "llama tp=2")


class SquaredReLUMLP(MLP):
    """A user's architecture change: only the activation differs."""

    def activation(self, x):
        return F.relu(x) ** 2


def test_user_spec_swaps_a_submodule():
    state = initialize_model_parallel()
    model = build_model(tiny_config(), state, layer_spec=TransformerLayerSpec(mlp=SquaredReLUMLP))
    assert all(isinstance(layer.mlp, SquaredReLUMLP) for layer in model.decoder.layers)
    baseline = build_model(tiny_config(), state)
    input_ids, positions, labels = make_batch()
    assert not torch.allclose(model(input_ids, positions, labels=labels), baseline(input_ids, positions, labels=labels))


@pytest.mark.parametrize("tied", [True, False])
def test_hand_split_pipeline_equals_whole_model(tied):
    whole_state = initialize_model_parallel()
    reference_loss, reference_grads = loss_and_grads(build_model(tiny_config(num_layers=4), whole_state,
                                                                 share_embeddings_and_output_weights=tied), whole_state)
    config = tiny_config(num_layers=4, pipeline_model_parallel_size=2)
    stages = [dataclasses.replace(whole_state, pp_size=2, pp_rank=r, pp_ranks=(0, 1)) for r in range(2)]
    first = build_model(config, stages[0], pre_process=True, post_process=False,
                        share_embeddings_and_output_weights=tied)
    last = build_model(config, stages[1], pre_process=False, post_process=True,
                       share_embeddings_and_output_weights=tied)
    assert [layer.layer_number for layer in last.decoder.layers] == [3, 4]
    input_ids, positions, labels = make_batch()
    sent = first(input_ids, positions)  # [s, b, h]
    received = sent.detach().requires_grad_()
    last.set_input_tensor(received)
    loss = last(None, positions, labels=labels)
    torch.testing.assert_close(loss, reference_loss, **LOSS_TOL)
    loss.mean().backward()
    sent.backward(received.grad)
    grads = {_global_name(name, shift): param.grad
             for model, shift in ((first, 0), (last, 2)) for name, param in model.named_parameters()}
    if tied:  # what finalize_model_grads does over the embedding group
        grads["embedding.word_embeddings.weight"] = (grads["embedding.word_embeddings.weight"]
                                                     + grads.pop("output_layer.weight"))
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name][0], **GRAD_TOL, msg=lambda m: f"{name}: {m}")


def _global_name(name: str, layer_shift: int) -> str:
    """``decoder.layers.<local>.x`` of a stage -> the whole model's ``decoder.layers.<global>.x``."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_shift)
    return ".".join(parts)


def test_explicit_causal_mask_equals_implicit():
    state = initialize_model_parallel()
    model = build_model(tiny_config(), state)
    input_ids, positions, labels = make_batch()
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).expand(2, 1, SEQ, SEQ)
    torch.testing.assert_close(model(input_ids, positions, causal, labels), model(input_ids, positions, None, labels),
                               **LOSS_TOL)
    padded = causal.clone()
    padded[..., :2] = True  # keys 0-1 hidden from every query: rows 0 and 1 are fully masked -> zeros, not NaN
    assert torch.isfinite(model(input_ids, positions, padded, labels)).all()


def test_model_rejects_a_layout_mismatch():
    with pytest.raises(ValueError, match="config.tensor_model_parallel_size=2 does not match the parallel state's 1"):
        build_model(tiny_config(tensor_model_parallel_size=2), initialize_model_parallel())


def _two_stage_pipeline(tied):
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    first = state.is_pipeline_first_stage
    model = build_model(tiny_config(num_layers=4, pipeline_model_parallel_size=2), state, pre_process=first,
                        post_process=not first, share_embeddings_and_output_weights=tied)
    input_ids, positions, labels = make_batch()
    loss = None
    if first:
        sent = model(input_ids, positions)  # [s, b, h]
        dist.send(sent.detach(), state.next_pipeline_rank)
        grad = torch.empty_like(sent)
        dist.recv(grad, state.next_pipeline_rank)
        sent.backward(grad)
    else:
        received = torch.empty(SEQ, 2, 16)
        dist.recv(received, state.prev_pipeline_rank)
        received.requires_grad_()
        model.set_input_tensor(received)
        loss = model(None, positions, labels=labels)
        loss.mean().backward()
        dist.send(received.grad, state.prev_pipeline_rank)
    finalize_model_grads(model, state)  # sums the tied embedding grads over ranks 0 and 1
    return loss, {_global_name(n, 0 if first else 2): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_two_pipeline_ranks_with_finalize_equal_whole_model(distributed, tied):
    state = initialize_model_parallel()
    ref_loss, ref_grads = loss_and_grads(build_model(tiny_config(num_layers=4), state,
                                                     share_embeddings_and_output_weights=tied), state)
    (_, first_grads), (loss, last_grads) = distributed(2, _two_stage_pipeline, tied)
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
    if tied:  # both copies of the tied weight received the summed grad
        torch.testing.assert_close(last_grads.pop("output_layer.weight"),
                                   ref_grads["embedding.word_embeddings.weight"][0],
                                   **GRAD_TOL)
    merged = {**first_grads, **last_grads}
    assert merged.keys() == ref_grads.keys()
    for name, grad in merged.items():
        torch.testing.assert_close(grad, ref_grads[name][0], **GRAD_TOL, msg=lambda m: f"{name}: {m}")


def _disagreeing_stages():
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    first = state.is_pipeline_first_stage
    model = build_model(tiny_config(num_layers=4, pipeline_model_parallel_size=2), state, pre_process=first,
                        post_process=not first, share_embeddings_and_output_weights=first)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    finalize_model_grads(model, state)


def test_tying_disagreement_between_stages_raises_instead_of_hanging(distributed):
    with pytest.raises(ValueError, match="must appear once on each end of the pipeline, found between 0 and 1") as info:
        distributed(2, _disagreeing_stages)
    assert not any("were still running" in note for note in info.value.__notes__)
