"""The MoE layer at ep 2 and 4 (alltoall and allgather dispatchers, loop and grouped GEMM, capacity dropping
and padding), at tp 2 with sequence parallelism and at expert tensor parallel sizes other than 1 or tp (tp 1 x
dp 2 etp 2, tp 2 x dp 2 etp 4, tp 4 etp 2, with ep) equals the single-process layer holding every expert:
outputs, aux and z losses, input grads and weight grads (summed over the ranks whose tokens reach a weight)."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

S, B, H, E = 8, 2, 8, 4

OPTION_SETS = [
    {"moe_token_dispatcher_type": "alltoall"},
    {"moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True, "moe_expert_capacity_factor": 0.75},
    {"moe_token_dispatcher_type": "alltoall", "moe_expert_capacity_factor": 0.5,
     "moe_pad_expert_input_to_capacity": True},
    {"moe_token_dispatcher_type": "allgather"},
    {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": True, "moe_expert_capacity_factor": 0.5},
    {"moe_token_dispatcher_type": "alltoall", "moe_router_load_balancing_type": "seq_aux_loss",
     "moe_shared_expert_intermediate_size": 8},
]


def _config(sequence_parallel=False, tp=1, activation="gelu", **moe):
    from megatron_core.config import TransformerConfig
    from megatron_core.transformer.moe import MoEConfig
    moe = {"num_moe_experts": E, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01, **moe}
    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=max(2, tp), ffn_hidden_size=12,
                             hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=S,
                             tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                             activation=activation, moe=MoEConfig(**moe))


def _single(state):
    """The same rank without any parallelism: every expert on one rank."""
    return dataclasses.replace(state, tp_size=1, tp_rank=0, tp_group=None, ep_size=1, ep_rank=0, ep_group=None,
                               etp_size=1, etp_rank=0, etp_group=None)


def _run(layer, x, g):
    x = x.detach().requires_grad_(True)
    out, _ = layer(x)
    (out * g).sum().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads, {k: v.clone() for k, v in layer.router.loss_sums.items()}


def _sum_over(tensor, group):
    tensor = tensor.clone()
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def _ep_body(ep, option_sets, uneven=False):
    from megatron_core import destroy_model_parallel, initialize_model_parallel
    from megatron_core.transformer.moe import MoELayer
    state = initialize_model_parallel(expert_model_parallel_size=ep)
    worst = 0.0
    try:
        for options in option_sets:
            torch.manual_seed(5)
            layer = MoELayer(_config(**options), layer_number=1, parallel_state=state)
            torch.manual_seed(5)
            ref = MoELayer(_config(**options), layer_number=1, parallel_state=_single(state))
            gen = torch.Generator().manual_seed(100 + state.rank)
            seq = S - 2 * state.ep_rank if uneven else S  # uneven: a different token count on every ep rank
            x, g = torch.randn(seq, B, H, generator=gen), torch.randn(seq, B, H, generator=gen)
            out, dx, grads, losses = _run(layer, x, g)
            ref_out, ref_dx, ref_grads, ref_losses = _run(ref, x, g)
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
            # experts see the tokens of the whole ep group (the same names in the same order on every rank)
            summed = {n: _sum_over(v, state.ep_group) if ".local_experts." in n else v for n, v in ref_grads.items()}
            for name, grad in grads.items():
                expected = summed[name]
                torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
                worst = max(worst, (grad - expected).abs().max().item())
            for key, value in ref_losses.items():
                torch.testing.assert_close(losses[key], value, rtol=1e-5, atol=1e-7)
            assert len(layer.experts.local_experts) == E // ep
    finally:
        destroy_model_parallel(state)
    return worst


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_layer_matches_single_process(distributed, ep):
    worst = distributed(ep, _ep_body, ep, OPTION_SETS)
    assert max(worst) < 1e-5


UNEVEN_SETS = [
    {"moe_token_dispatcher_type": "allgather"},
    {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": True, "moe_expert_capacity_factor": 0.5},
    {"moe_token_dispatcher_type": "alltoall"},
]


@pytest.mark.parametrize("ep", [2, 4])
def test_uneven_token_counts_per_ep_rank_match_single_process(distributed, ep):
    """Ep rank r routes S - 2r positions: the allgather dispatcher pads to the group's largest count."""
    worst = distributed(ep, _ep_body, ep, UNEVEN_SETS, True)
    assert max(worst) < 1e-5


def _tp_body(ep, options):
    """tp 2 with sequence parallelism: each rank routes its half of the sequence."""
    from megatron_core import destroy_model_parallel, initialize_model_parallel
    from megatron_core.transformer.moe import MoELayer
    state = initialize_model_parallel(2, expert_model_parallel_size=ep)
    try:
        torch.manual_seed(5)
        layer = MoELayer(_config(True, 2, **options), layer_number=1, parallel_state=state)
        torch.manual_seed(5)
        ref = MoELayer(_config(**options), layer_number=1, parallel_state=_single(state))
        gen = torch.Generator().manual_seed(100)
        x, g = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
        mine = slice(state.tp_rank * S // 2, (state.tp_rank + 1) * S // 2)
        out, dx, grads, losses = _run(layer, x[mine], g[mine])
        ref_out, ref_dx, ref_grads, ref_losses = _run(ref, x, g)
        torch.testing.assert_close(out, ref_out[mine], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx, ref_dx[mine], rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():  # the same names on both ranks when ep 1; different experts at ep 2
            group = state.tp_group if name in ("router.weight", "router.bias") else state.expert_dp_group
            summed = _sum_over(grad, group)  # router: partial per tp rank; experts: reduced over expert-dp
            torch.testing.assert_close(summed, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for key, value in ref_losses.items():
            torch.testing.assert_close(_sum_over(losses[key], state.tp_group), value, rtol=1e-5, atol=1e-7)
    finally:
        destroy_model_parallel(state)


@pytest.mark.parametrize("ep", [1, 2])
def test_sequence_parallel_layer_matches_single_process(distributed, ep):
    distributed(2, _tp_body, ep, {"moe_token_dispatcher_type": "alltoall", "moe_router_load_balancing_type":
                                  "seq_aux_loss" if ep == 2 else "aux_loss"})  # no shared experts: tp-split


def _etp_shard(name, grad, rank, size, gated):
    """This etp rank's part of a full expert grad: fc1 rows (weight and bias; ``[gate; up]`` halves each split
    when gated, stride 2), fc2 columns; fc2 bias whole (replicated over etp)."""
    from megatron_core.checkpointing.layout import take_shard
    if "linear_fc1" in name:
        return take_shard(grad, 0, 2 if gated else 1, rank, size)
    if "linear_fc2.weight" in name:
        return take_shard(grad, 1, 1, rank, size)
    return grad


def _etp_body(tp, ep, etp, options):
    """Expert tensor parallelism at any etp (the etp group need not be the tp group): tp ranks split each dp
    replica's sequence (sequence parallel), every rank holds 1/etp of each local expert's fc1 rows and fc2
    columns. Outputs and input grads equal the single-process layer's on this rank's tokens; the router's grads
    summed over tp, and the experts' summed over expert-dp (as DDP does), equal the reference's summed over dp."""
    from megatron_core import destroy_model_parallel, initialize_model_parallel
    from megatron_core.parallel_state import layout_groups
    from megatron_core.transformer.moe import MoELayer
    state = initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    try:
        expected_etp = next(g for g in layout_groups(state.world_size, tp, 1, 1, ep, etp)["etp"] if state.rank in g)
        assert (state.etp_size, state.etp_ranks, state.etp_rank) == (etp, expected_etp, expected_etp.index(state.rank))
        assert (state.etp_group is state.tp_group) if etp == tp > 1 else (state.etp_group is None) == (etp == 1)
        torch.manual_seed(5)
        layer = MoELayer(_config(tp > 1, tp, **options), layer_number=1, parallel_state=state)
        torch.manual_seed(5)
        ref = MoELayer(_config(**options), layer_number=1, parallel_state=_single(state))
        gen = torch.Generator().manual_seed(100 + state.dp_rank)
        x, g = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
        mine = slice(state.tp_rank * S // tp, (state.tp_rank + 1) * S // tp)
        out, dx, grads, _ = _run(layer, x[mine], g[mine])
        ref_out, ref_dx, ref_grads, _ = _run(ref, x, g)
        torch.testing.assert_close(out, ref_out[mine], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx, ref_dx[mine], rtol=1e-5, atol=1e-6)
        # every token of the stage reaches each expert shard once over expert-dp (no etp or tp reduction); all
        # reference names in the same order on every rank
        summed = {n: _sum_over(v, state.dp_group) for n, v in ref_grads.items() if ".local_experts." in n}
        worst = 0.0
        for name, grad in grads.items():
            if ".local_experts." not in name:  # the router: partial per tp rank, one dp replica's tokens
                torch.testing.assert_close(_sum_over(grad, state.tp_group), ref_grads[name], rtol=1e-5, atol=1e-6)
                continue
            expected = _etp_shard(name, summed[name], state.etp_rank, etp, options.get("activation") == "swiglu")
            grad = _sum_over(grad, state.expert_dp_group)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            worst = max(worst, (grad - expected).abs().max().item())
        fc1 = next(p for n, p in layer.named_parameters() if n.endswith("linear_fc1.weight"))
        rows = (2 if options.get("activation") == "swiglu" else 1) * 12 // etp
        assert fc1.shape[0] == rows and bool(getattr(fc1, "tensor_model_parallel", False)) == (etp > 1)
        return worst
    finally:
        destroy_model_parallel(state)


ETP_LAYOUTS = {  # name: (world, tp, ep, etp, MoE options)
    "tp1-dp2-etp2": (2, 1, 1, 2, {"moe_token_dispatcher_type": "alltoall", "activation": "swiglu"}),
    "tp1-dp4-ep2-etp2": (4, 1, 2, 2, {"moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True}),
    "tp2-dp2-etp2-ep2": (4, 2, 2, 2, {"moe_token_dispatcher_type": "allgather",
                                      "moe_router_load_balancing_type": "seq_aux_loss"}),
    "tp2-dp2-etp4": (4, 2, 1, 4, {"moe_token_dispatcher_type": "alltoall", "activation": "swiglu"}),
    "tp2-dp2-etp1-ep2": (4, 2, 2, 1, {"moe_token_dispatcher_type": "alltoall"}),
    "tp4-etp2": (4, 4, 1, 2, {"moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True}),
    "tp4-etp2-ep2": (4, 4, 2, 2, {"moe_token_dispatcher_type": "allgather"}),
}


@pytest.mark.parametrize("name", list(ETP_LAYOUTS))
def test_expert_tensor_parallel_layer_matches_single_process(distributed, name):
    world, tp, ep, etp, options = ETP_LAYOUTS[name]
    assert max(distributed(world, _etp_body, tp, ep, etp, options)) < 1e-5


def _bad_layout_body():
    from megatron_core import destroy_model_parallel, initialize_model_parallel
    from megatron_core.transformer.moe import MoELayer
    state = initialize_model_parallel(expert_model_parallel_size=2)
    try:
        MoELayer(_config(num_moe_experts=3, moe_router_topk=1), layer_number=1, parallel_state=state)
    finally:
        destroy_model_parallel(state)


def test_experts_not_divisible_by_ep_names_the_values(distributed):
    with pytest.raises(ValueError, match="num_moe_experts 3 is not divisible by expert_model_parallel_size 2"):
        distributed(2, _bad_layout_body)
