"""Multi-token prediction (single process, fp32) against a hand computation from the model's own modules:
each depth's loss (embedding of the tokens k ahead, enorm/hnorm, eh_proj, the layer, the final norm, the
shared head, F.cross_entropy on the labels shifted by k with the tail masked), the total gradient of
main + F/N * sum(MTP losses) and its schedule scale, the logged per-depth losses, generation untouched by the
MTP weights, the MoE kind of the MTP layer, and the cp-aware shift (2 gloo ranks)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_core import initialize_model_parallel
from megatron_core.models.mtp import ShiftedSequences, mtp_log_fields, mtp_loss_report, set_mtp_loss_scale
from megatron_core.transformer.inference_cache import InferenceCache
from tests.model_helpers import SEQ, VOCAB, build_model, make_batch, tiny_config

FACTOR = 0.3
VARIANTS = {"tied-learned": {}, "untied-rope": {"untie_embeddings_and_output_weights": True,
                                                "position_embedding_type": "rope"}}


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """Position i takes position i + k; the last k positions get 0."""
    out = torch.zeros_like(x)
    out[:, :-k] = x[:, k:]
    return out


def _mask(seed: int) -> torch.Tensor:
    mask = torch.ones(2, SEQ)
    mask[0, 1] = mask[1, 5:] = 0.0
    return mask if seed == 0 else mask.flip(1)


def _hand_mtp_losses(model, ids, positions, labels, mask) -> list[torch.Tensor]:
    rotary = model.rotary_pos_emb(positions) if model.rotary_pos_emb is not None else None
    hidden = model.decoder(model.embedding(ids, positions), None, rotary)  # [s, b, h] after the final norm
    head = model.output_layer.weight if model.output_layer.weight is not None \
        else model.embedding.word_embeddings.weight
    losses = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        embedded = model.embedding(_shift(ids, k), _shift(positions, k))
        projected = torch.cat([layer.enorm(embedded), layer.hnorm(hidden)], -1) @ layer.eh_proj.weight.t()
        hidden = layer.final_layernorm(layer.transformer_layer(projected, None, rotary))
        logits = (hidden @ head.t())[..., :VOCAB]  # [s, b, V]
        per_token = F.cross_entropy(logits.permute(1, 2, 0), _shift(labels, k), reduction="none")  # [b, s]
        shifted_mask = _shift(mask, k)
        losses.append((per_token * shifted_mask).sum() / shifted_mask.sum())
    return losses


def _pair(**overrides):
    """Two identical models with two MTP depths (same seed: the same weights)."""
    state = initialize_model_parallel()
    config = tiny_config(mtp_num_layers=2, mtp_loss_scaling_factor=FACTOR, **overrides)
    return state, build_model(config, state), build_model(config, state)


def _masked_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_losses_and_gradient_match_hand_computation(variant):
    state, model, reference = _pair(**VARIANTS[variant])
    ids, positions, labels = make_batch(0)
    mask = _mask(0)
    per_token = model(ids, positions, labels=labels, loss_mask=mask)
    _masked_mean(per_token, mask).backward()
    hand = _hand_mtp_losses(reference, ids, positions, labels, mask)
    torch.testing.assert_close(model.mtp.loss_sums.float(), torch.stack(hand).detach(), rtol=1e-5, atol=0)
    reference.eval()  # eval: no MTP inside forward, the main loss alone
    ref_main = reference(ids, positions, labels=labels)
    torch.testing.assert_close(per_token, ref_main, rtol=0, atol=0)  # the returned main loss is unchanged
    (_masked_mean(ref_main, mask) + FACTOR / 2 * sum(hand)).backward()
    ref_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0
    assert mtp_loss_report([model], state, 2)["mtp_2_loss"] == pytest.approx(hand[1].item(), rel=1e-6)


def test_loss_scale_scales_only_the_mtp_gradient_as_the_schedule_scales_the_main_loss():
    _, model, reference = _pair()
    ids, positions, labels = make_batch(1)
    set_mtp_loss_scale([model], 0.25)  # e.g. 1 / 4 micro-batches
    (model(ids, positions, labels=labels).mean() * 0.25).backward()
    reference(ids, positions, labels=labels).mean().backward()  # scale 1: main + F/N * sum(MTP)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad * 0.25, rtol=1e-5, atol=1e-8, msg=lambda m: f"{name}: {m}")


def test_logged_losses_average_the_micro_batches_and_reset():
    state, model, reference = _pair()
    expected = torch.zeros(2)
    for seed in (0, 1):
        ids, positions, labels = make_batch(seed)
        model(ids, positions, labels=labels, loss_mask=_mask(seed))
        expected += torch.stack(_hand_mtp_losses(reference, ids, positions, labels, _mask(seed))).detach() / 2
    report = mtp_loss_report([model], state, 2)
    assert list(report) == ["mtp_1_loss", "mtp_2_loss"] and all(v > 0 for v in report.values())
    torch.testing.assert_close(torch.tensor(list(report.values())), expected, rtol=1e-5, atol=0)
    assert mtp_log_fields(report) == f" mtp_1 loss: {report['mtp_1_loss']:.6E} | mtp_2 loss: " \
                                     f"{report['mtp_2_loss']:.6E} |"
    assert mtp_loss_report([model], state, 2) == {"mtp_1_loss": 0.0, "mtp_2_loss": 0.0}  # reset
    model.eval()
    with torch.no_grad():
        model(*make_batch(0)[:2], labels=make_batch(0)[2])
    assert model.mtp.loss_count == 0  # evaluation records nothing


def test_generation_ignores_the_mtp_weights():
    state = initialize_model_parallel()
    with_mtp = build_model(tiny_config(mtp_num_layers=2), state)
    plain = build_model(tiny_config(), state)
    names = {n for n, _ in plain.named_parameters()}
    assert names == {n for n, _ in with_mtp.named_parameters() if not n.startswith("mtp.")}
    assert {"mtp.layers.1.enorm.weight", "mtp.layers.1.hnorm.weight", "mtp.layers.1.eh_proj.weight",
            "mtp.layers.1.final_layernorm.weight"} <= {n for n, _ in with_mtp.named_parameters()}
    assert with_mtp.mtp.layers[1].eh_proj.weight.shape == (16, 32)  # [h, 2h]
    ids, positions, _ = make_batch(0)
    torch.testing.assert_close(with_mtp(ids, positions), plain(ids, positions), rtol=0, atol=0)
    caches = [InferenceCache(max_sequence_length=SEQ, batch_size=2) for _ in range(2)]
    outputs = [m(ids[:, :3], None, inference_cache=c) for m, c in zip((with_mtp, plain), caches)]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert with_mtp.mtp.loss_count == 0


@pytest.mark.parametrize("freq, moe_kind", [([0, 1], True), ([1, 0], False)])
def test_mtp_layer_is_of_the_last_decoder_layers_kind(freq, moe_kind):
    from megatron_core.transformer.moe import MoEConfig, MoELayer
    state = initialize_model_parallel()
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=freq)
    model = build_model(tiny_config(mtp_num_layers=1, moe=moe), state)
    mlp = model.mtp.layers[0].transformer_layer.mlp
    assert isinstance(mlp, MoELayer) == moe_kind
    if moe_kind:
        assert mlp.router.layer_number == 3  # num_layers + 1: no decoder layer's number
    ids, positions, labels = make_batch(0)
    model(ids, positions, labels=labels).mean().backward()
    weight = mlp.router.weight if moe_kind else mlp.linear_fc1.weight
    assert weight.grad is not None and weight.grad.abs().sum() > 0  # trained by the MTP loss


def _cp_shift():
    state = initialize_model_parallel(context_parallel_size=2)
    from megatron_core.context_parallel import split_sequence
    full = torch.arange(2 * 16).view(2, 16)
    local = split_sequence(full, dim=1, cp_size=2, cp_rank=state.cp_rank)
    shifted = ShiftedSequences(local, local, local, local.float(), state)
    return [tuple(t.tolist() for t in shifted.at(k)) for k in (1, 3)], state.cp_rank


def test_shift_crosses_context_parallel_ranks(distributed):
    from megatron_core.context_parallel import split_sequence
    full = torch.arange(2 * 16).view(2, 16)
    for got, rank in distributed(2, _cp_shift):
        for k, values in zip((1, 3), got):
            expected = split_sequence(_shift(full, k), dim=1, cp_size=2, cp_rank=rank).tolist()
            assert all(v == expected for v in values)
