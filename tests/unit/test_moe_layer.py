"""The MoE layer (single process) against a plain per-token reference: outputs, aux and z losses, input and
weight grads (fp32), for each routing option, capacity dropping and padding, shared experts, grouped GEMM."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.transformer.moe import MoEConfig, MoELayer, moe_layer_spec

S, B, H, E = 6, 2, 8, 4


def _config(activation="gelu", **moe):
    moe = {"num_moe_experts": E, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01, **moe}
    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=12,
                             activation=activation, hidden_dropout=0.0, attention_dropout=0.0,
                             max_position_embeddings=S, moe=MoEConfig(**moe))


def _expert(x, expert, swiglu):
    h = F.linear(x, expert.linear_fc1.weight, expert.linear_fc1.bias)
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    return F.linear(h, expert.linear_fc2.weight, expert.linear_fc2.bias)


def _route(logits, moe, bias):
    """Per token: ``(experts, weights)`` and the scores the aux loss uses."""
    k = moe.moe_router_topk
    if moe.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, -1)
        if moe.moe_router_pre_softmax:
            weights, experts = torch.topk(scores, k)
        else:
            top, experts = torch.topk(logits, k)
            weights = torch.softmax(top, -1)
        return experts, weights, scores
    sig = torch.sigmoid(logits)
    experts = torch.topk(sig.detach() + bias, k).indices
    weights = sig.gather(0, experts)
    return experts, weights / weights.sum() if k > 1 else weights, sig / sig.sum()


def reference(layer, x, swiglu=False):
    """``(output [s, b, h], aux_loss, z_loss)`` computed token by token."""
    moe = layer.moe
    tokens = x.reshape(-1, H)
    logits = tokens @ layer.router.weight.t() + (0 if layer.router.bias is None else layer.router.bias)
    bias = layer.router.expert_bias if layer.router.expert_bias is not None else torch.zeros(E)
    routes = [_route(logits[t], moe, bias) for t in range(len(tokens))]
    assigned = [{int(e): w for e, w in zip(ex, ws)} for ex, ws, _ in routes]
    if moe.moe_expert_capacity_factor is not None:
        capacity = math.ceil(len(tokens) * moe.moe_router_topk / E * moe.moe_expert_capacity_factor)
        for e in range(E):
            holders = sorted((t for t in range(len(tokens)) if e in assigned[t]),
                             key=lambda t: -float(assigned[t][e].detach()))
            for t in holders[capacity:]:
                del assigned[t][e]
    experts = layer.experts.local_experts
    out = torch.stack([sum((w * _expert(tokens[t], experts[str(e)], swiglu) for e, w in assigned[t].items()),
                           torch.zeros(H)) for t in range(len(tokens))])
    scores = torch.stack([r[2] for r in routes])
    routed = torch.zeros(len(tokens), E)
    for t, (ex, _, _) in enumerate(routes):
        routed[t, ex] = 1.0
    k, coeff = moe.moe_router_topk, moe.moe_aux_loss_coeff
    if moe.moe_router_load_balancing_type == "aux_loss":
        f, p = routed.sum(0) / (len(tokens) * k), scores.mean(0)
        aux = coeff * E * (f * p).sum()
    elif moe.moe_router_load_balancing_type == "seq_aux_loss":
        per_seq = []
        for b in range(B):
            rows = torch.arange(S) * B + b
            per_seq.append(E * ((routed[rows].sum(0) / (S * k)) * scores[rows].mean(0)).sum())
        aux = coeff * torch.stack(per_seq).mean()
    else:
        aux = torch.zeros(())
    z = moe.moe_z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    out = out.view(S, B, H)
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        h = F.gelu(F.linear(x, shared.linear_fc1.weight, shared.linear_fc1.bias))
        out = out + F.linear(h, shared.linear_fc2.weight, shared.linear_fc2.bias)
    return out, aux, z


CASES = {
    "softmax-top2": {},
    "pre-softmax": {"moe_router_pre_softmax": True},
    "top1": {"moe_router_topk": 1},
    "sigmoid-expert-bias": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
    "seq-aux-loss": {"moe_router_load_balancing_type": "seq_aux_loss"},
    "no-aux-loss": {"moe_router_load_balancing_type": "none"},
    "capacity-drop": {"moe_expert_capacity_factor": 0.5},
    "capacity-pad": {"moe_expert_capacity_factor": 0.5, "moe_pad_expert_input_to_capacity": True},
    "grouped-gemm-capacity": {"moe_grouped_gemm": True, "moe_expert_capacity_factor": 0.75},
    "shared-experts": {"moe_shared_expert_intermediate_size": 16},
    "swiglu-grouped": {"moe_grouped_gemm": True, "activation": "swiglu"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layer_matches_reference(name):
    options = dict(CASES[name])
    activation = options.pop("activation", "gelu")
    torch.manual_seed(3)
    layer = MoELayer(_config(activation, **options), layer_number=1, parallel_state=initialize_model_parallel())
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(S, B, H, requires_grad=True)
    g = torch.randn(S, B, H)
    out, bias = layer(x)
    assert bias is None
    (out * g).sum().backward()
    got = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    sums = {k: v.clone() for k, v in layer.router.loss_sums.items()}
    x.grad = None
    layer.zero_grad()
    ref_out, aux, z = reference(layer, x, swiglu=activation == "swiglu")
    ((ref_out * g).sum() + aux + z).backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["x"], x.grad, rtol=1e-5, atol=1e-6)
    for n, p in layer.named_parameters():
        expected = torch.zeros_like(p) if p.grad is None else p.grad  # an expert no token reached
        torch.testing.assert_close(got[n], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    coeff = layer.moe.moe_aux_loss_coeff
    if layer.moe.moe_router_load_balancing_type != "none":
        torch.testing.assert_close(sums["load_balancing_loss"], aux.detach() / coeff, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(sums["z_loss"], z.detach() / layer.moe.moe_z_loss_coeff, rtol=1e-5, atol=1e-7)


def test_capacity_padding_gives_every_expert_its_capacity():
    layer = MoELayer(_config(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True),
                     layer_number=1, parallel_state=initialize_model_parallel())
    probs, routing_map = layer.router(torch.randn(S, B, H))
    assert routing_map.sum(0).tolist() == [math.ceil(S * B * 2 / E * 0.5)] * E


def test_spec_builds_moe_layers_by_frequency():
    from megatron_core.models import GPTModel
    config = _config()
    config.moe.moe_layer_freq = [0, 1]
    model = GPTModel(config, parallel_state=initialize_model_parallel(), vocab_size=32, max_sequence_length=S,
                     layer_spec=moe_layer_spec())
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    assert kinds == ["MLP", "MoELayer"]
    loss = model(torch.randint(0, 32, (B, S)), torch.arange(S).expand(B, S), labels=torch.randint(0, 32, (B, S)))
    loss.mean().backward()
    assert model.decoder.layers[1].mlp.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("options, message", [
    ({"moe_router_topk": 5}, "moe_router_topk 5 must lie in"),
    ({"moe_pad_expert_input_to_capacity": True}, "needs moe_expert_capacity_factor"),
    ({"moe_router_enable_expert_bias": True}, "sigmoid"),
])
def test_bad_moe_config_names_the_values(options, message):
    with pytest.raises(ValueError, match=message):
        _config(**options)


def test_expert_groups_match_the_documented_listing():
    from megatron_core.parallel_state import layout_groups
    groups = layout_groups(8, tp=2, pp=2, ep=2)
    assert groups["ep"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups["expert_dp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups["expert_mp"] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert layout_groups(8, tp=1, pp=1, ep=4)["expert_dp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    etp = layout_groups(8, tp=2, pp=1, ep=2, etp=2)  # the etp listings of parallel_state's docstring
    assert (etp["etp"], etp["ep"], etp["expert_dp"], etp["expert_mp"]) == (
        etp["tp"], [(0, 2), (1, 3), (4, 6), (5, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)], [(0, 1, 2, 3), (4, 5, 6, 7)])
    half = layout_groups(8, tp=4, pp=1, ep=2, etp=2)  # etp < tp: two etp groups per tp group
    assert (half["tp"], half["etp"], half["ep"], half["expert_dp"], half["expert_mp"]) == (
        [(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (1, 3), (4, 6), (5, 7)],
        [(0, 4), (1, 5), (2, 6), (3, 7)], [(0, 1, 2, 3), (4, 5, 6, 7)])
    wide = layout_groups(8, tp=1, pp=1, ep=2, etp=4)  # tp 1: the etp groups span dp ranks
    assert (wide["etp"], wide["ep"], wide["expert_dp"]) == ([(0, 1, 2, 3), (4, 5, 6, 7)],
                                                            [(0, 4), (1, 5), (2, 6), (3, 7)], [(r,) for r in range(8)])
    assert layout_groups(8, tp=2, pp=2, ep=1, etp=4)["etp"] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # etp > tp, per stage
    with pytest.raises(ValueError, match=r"expert_model_parallel_size 2 x expert_tensor_parallel_size 4 = 8 does not "
                                         r"divide the 4 ranks of a pipeline stage .*expert_tensor_parallel_size=4"):
        layout_groups(8, tp=2, pp=2, ep=2, etp=4)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size must be an integer >= 1, got 0"):
        layout_groups(8, tp=2, pp=1, ep=2, etp=0)
    with pytest.raises(ValueError, match="expert_model_parallel_size 4 does not divide the 6 ranks"):
        layout_groups(6, tp=1, pp=1, ep=4)


def test_flops_count_active_parameters():
    """An MoE layer with top-k experts of size f counts like a dense MLP of size k x f (plus the shared one)."""
    import dataclasses

    from megatron_core.training.metrics import gpt_flops_per_iteration
    moe = _config(moe_ffn_hidden_size=6, moe_shared_expert_intermediate_size=4)
    dense = dataclasses.replace(moe, moe=None, ffn_hidden_size=2 * 6 + 4)
    count = dict(batch_size=2, seq_length=S, padded_vocab_size=128)
    assert gpt_flops_per_iteration(moe, **count) == pytest.approx(gpt_flops_per_iteration(dense, **count))
    half = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, moe_layer_freq=2))  # layer 1 MoE, 2 dense
    mixed = (gpt_flops_per_iteration(dense, **count) + gpt_flops_per_iteration(
        dataclasses.replace(dense, ffn_hidden_size=12), **count)) / 2
    assert gpt_flops_per_iteration(half, **count) == pytest.approx(mixed)


def test_generate_takes_the_checkpoints_etp_at_any_tp():
    """tools/generate.py launches a checkpoint at its own layout: an etp 2 saved at tp 1 (the etp group over dp
    ranks) needs 2 processes."""
    from tests.data.conftest import load_tool
    tool = load_tool("generate")
    metadata = {"layout": {"tp": 1, "pp": 1}, "config": {"num_experts": 4, "expert_tensor_parallel_size": 2}}
    assert tool.saved_layout(metadata) == (1, 1, 1, 2) and tool.processes_for(1, 1, 1, 2) == 2
    assert tool.saved_layout({"layout": {"tp": 2, "pp": 1}, "config": {"expert_tensor_parallel_size": 2}})[3] == 1
