"""Training steps of a tiny MoE GPT at ep 2 x expert-dp 2 (dp 4) with ZeRO 0/1/2/3 equal the single-process
run: losses, grad norms (clipping active: expert elements counted once) and every parameter, experts compared
under their global names. Expert grads are reduced over expert-dp, dense ones over dp; at ZeRO-3 the experts are also
gathered and sharded over expert-dp."""
import pytest
import torch
import torch.distributed as dist

S, V, MICRO = 8, 64, 4  # global batch: 4 micro-batches of one sequence
ADAM_EPS = 1e-4  # above the round-off of a near-zero grad, which Adam at eps 1e-8 turns into a 1e-5 step


def _model(state):
    from megatron_core.config import TransformerConfig
    from megatron_core.models import GPTModel
    from megatron_core.transformer.moe import MoEConfig, moe_layer_spec
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24,
                               hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=S,
                               moe=MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05,
                                             moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.0))
    torch.manual_seed(11)
    return GPTModel(config, parallel_state=state, vocab_size=V, max_sequence_length=S, layer_spec=moe_layer_spec())


def _train_body(ep, zero_stage, steps=3):
    from megatron_core import destroy_model_parallel, initialize_model_parallel
    from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron_core.optimizer import OptimizerConfig, get_optimizer
    from megatron_core.transformer.moe.tracking import set_aux_loss_scale
    state = initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        model = _model(state)
        ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=zero_stage),
                                      dp_group=state.dp_group, expert_dp_group=state.expert_dp_group)
        optimizer = get_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05, adam_eps=ADAM_EPS), ddp,
                                  parallel_state=state)
        data = torch.randint(0, V, (steps, MICRO, S + 1), generator=torch.Generator().manual_seed(3))
        per_rank = MICRO // state.dp_size
        set_aux_loss_scale([ddp], 1.0 / per_rank)
        losses, norms = [], []
        for step in range(steps):
            optimizer.zero_grad()
            mine = data[step, state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank]
            total = torch.zeros(())
            for i, sample in enumerate(mine):
                tokens, labels = sample[None, :-1], sample[None, 1:]
                loss = ddp(tokens, torch.arange(S)[None], labels=labels).mean() / per_rank
                if i < per_rank - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                total += loss.detach()
            finalize_model_grads([ddp], state)
            ok, norm, _ = optimizer.step()
            assert ok
            if state.dp_group is not None:
                dist.all_reduce(total, group=state.dp_group)
            losses.append(total.item() / state.dp_size)
            norms.append(norm)
        if zero_stage == 3:  # expert buckets are gathered and sharded over expert-dp, the dense ones over dp
            assert {(b.kind.expert, b.dp_size) for b in ddp.buckets} == {(True, state.expert_dp_size),
                                                                         (False, state.dp_size)}
        full = ddp.state_dict()  # ZeRO-3: every parameter gathered (over dp or expert-dp)
        params = {name: full[name].detach().clone() for name, _ in model.named_parameters()}
        return losses, norms, params
    finally:
        destroy_model_parallel(state)


@pytest.fixture(scope="module")
def reference(distributed):
    return distributed(1, _train_body, 1, 0)[0]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_ep2_dp4_training_equals_single_process(distributed, reference, zero_stage):
    ref_losses, ref_norms, ref_params = reference
    results = distributed(4, _train_body, 2, zero_stage)
    for losses, norms, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert norms[0] > 0.05  # clipping is active
        for name, value in params.items():
            # atol: the last-bit differences (reduce-scatter vs all-reduce order) of near-zero elements
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    held = set().union(*(params for _, _, params in results))
    assert held == set(ref_params)  # every expert lives on some rank
