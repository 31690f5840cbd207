"""DeepSeek-V3's MoE block against transformers' own ``DeepseekV3MoE`` (fp32): sigmoid scores with the
score-correction (expert) bias, group-limited routing (``n_group`` / ``topk_group``), the routed scaling
factor and the shared experts; group-limited top-k against a hand computation; random router logits for
benchmarking pass gradients through; selective recompute of the MoE layer counts the router losses once."""
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.tensor_parallel import checkpoint, model_parallel_seed
from megatron_core.transformer.moe import MoEConfig, MoELayer
from megatron_core.transformer.moe.router import group_limited_topk

H, E, F_EXPERT, TOPK, GROUPS, GROUP_TOPK = 16, 8, 12, 4, 4, 2


def _ours(**moe):
    settings = dict(num_moe_experts=E, moe_router_topk=TOPK, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_num_groups=GROUPS,
                    moe_router_group_topk=GROUP_TOPK, moe_router_topk_scaling_factor=2.5, moe_ffn_hidden_size=F_EXPERT,
                    moe_shared_expert_intermediate_size=F_EXPERT, moe_router_load_balancing_type="none")
    settings.update(moe)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=24,
                               activation="swiglu", add_bias_linear=False, normalization="RMSNorm",
                               hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                               moe=MoEConfig(**settings))
    state = initialize_model_parallel()
    model_parallel_seed(0, tp_rank=0, tracker=state.rng_tracker)
    return MoELayer(config, layer_number=1, parallel_state=state)


def _theirs():
    config = DeepseekV3Config(hidden_size=H, moe_intermediate_size=F_EXPERT, n_routed_experts=E, n_shared_experts=1,
                              num_experts_per_tok=TOPK, n_group=GROUPS, topk_group=GROUP_TOPK,
                              routed_scaling_factor=2.5,
                              norm_topk_prob=True, hidden_act="silu")
    return DeepseekV3MoE(config)


def _copy_weights(ours: MoELayer, theirs: DeepseekV3MoE) -> None:
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.router.expert_bias)
        for e in range(E):
            expert = ours.experts.local_experts[str(e)]
            theirs.experts.gate_up_proj[e].copy_(expert.linear_fc1.weight)  # both [gate; up]
            theirs.experts.down_proj[e].copy_(expert.linear_fc2.weight)
        gate, up = ours.shared_experts.linear_fc1.weight.chunk(2)
        theirs.shared_experts.gate_proj.weight.copy_(gate)
        theirs.shared_experts.up_proj.weight.copy_(up)
        theirs.shared_experts.down_proj.weight.copy_(ours.shared_experts.linear_fc2.weight)


def test_deepseek_v3_moe_matches_transformers():
    torch.manual_seed(0)
    ours, theirs = _ours(), _theirs()
    with torch.no_grad():  # outputs of order 1 (a tolerance means something), router scores spread enough that
        for param in ours.parameters():  # the group limit changes the choice
            param.normal_(0, 0.5)
    ours.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))  # the bias changes which experts win
    _copy_weights(ours, theirs)
    x = torch.randn(5, 3, H)
    with torch.no_grad():
        got, _ = ours.eval()(x)
        expected = theirs(x.transpose(0, 1).contiguous()).transpose(0, 1)
    assert got.abs().max() > 1.0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the groups matter: without group limits the same weights route differently
    free = _ours(moe_router_num_groups=None, moe_router_group_topk=None)
    free.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (free.eval()(x)[0] - got).abs().max() > 0.1


def test_group_limited_topk_by_hand():
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.8, 0.7, 0.05, 0.0]])  # groups (0,1) (2,3) (4,5) (6,7)
    values, index = group_limited_topk(scores, 2, num_groups=4, group_topk=2)
    # group sums of the top 1 (2 // 2): 0.9, 0.3, 0.8, 0.05 -> groups 0 and 2 -> experts 0 and 4
    assert sorted(index[0].tolist()) == [0, 4]
    torch.testing.assert_close(values.sort(descending=True).values, torch.tensor([[0.9, 0.8]]))


@pytest.mark.parametrize("bad, message", [
    (dict(moe_router_num_groups=3), "divisible by num_groups"),
    (dict(moe_router_group_topk=None), "needs both"),
    (dict(moe_router_group_topk=5), "1 <= group_topk <= num_groups"),
])
def test_bad_group_settings_name_the_values(bad, message):
    with pytest.raises(ValueError, match=message):
        _ours(**bad)


def test_force_load_balancing_routes_randomly_and_passes_grads():
    torch.manual_seed(0)
    layer = _ours(moe_router_force_load_balancing=True, moe_router_num_groups=None, moe_router_group_topk=None,
                  moe_router_enable_expert_bias=False)
    x = torch.randn(64, 2, H, requires_grad=True)
    probs, routing_map = layer.router(x)
    counts = routing_map.sum(0)
    assert counts.min() > 0.5 * counts.float().mean()  # roughly balanced whatever the weights
    probs.sum().backward()
    assert torch.count_nonzero(layer.router.weight.grad) > 0  # straight through to the gate, as Megatron's RandomSTE


def test_moe_recompute_counts_router_losses_once():
    torch.manual_seed(0)
    layer = _ours(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1, moe_router_num_groups=None,
                  moe_router_group_topk=None, moe_router_enable_expert_bias=False, moe_router_score_function="softmax")
    x = torch.randn(6, 2, H, requires_grad=True)
    plain, _ = layer(x)
    plain.sum().backward()
    once = {k: v.clone() for k, v in layer.router.loss_sums.items()}
    layer.router.reset_loss_sums()
    out = checkpoint(lambda t: layer(t)[0], x, rng_tracker=layer.router.rng_tracker)
    out.sum().backward()
    assert layer.router.loss_count == 1
    torch.testing.assert_close(layer.router.loss_sums["load_balancing_loss"], once["load_balancing_loss"])
