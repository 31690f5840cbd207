"""A tiny gpt-oss-style GPTModel (learnable sinks, a sliding window on every other layer, clamped quick GeGLU
with offset, qkv / linear biases; dense and MoE with expert biases) at tp 2 with sequence parallelism equals
tp 1: the loss and every gathered weight grad, the tp-split sink ``softmax_offset`` put back together. And
context parallelism 2 (allgather, p2p, a2a) equals cp 1: per-token losses and weight grads summed over cp."""
import pytest
import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.context_parallel import split_batch, to_natural_order
from megatron_core.transformer.moe import MoEConfig
from tests.model_helpers import build_model, full_grads, loss_and_grads, make_batch, tiny_config

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
GPT_OSS = dict(num_layers=4, num_attention_heads=4, num_query_groups=2, position_embedding_type="rope",
               normalization="RMSNorm", window_size=(2, 0), window_attn_skip_freq=2, softmax_type="learnable",
               activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=0.5, add_qkv_bias=True,
               untie_embeddings_and_output_weights=True, init_method_std=0.2)
"""Weights large enough that attention is far from uniform and the clamp (gpt-oss's is 7) acts."""
MOE = dict(moe=MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.0))
CONFIGS = {"dense": {}, "moe": MOE}


def _set_sinks(model, tp_size: int, tp_rank: int) -> None:
    """Every layer's sinks from one full ``[heads]`` draw, this rank's heads kept (tp-layout independent)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.decoder.layers:
            full = torch.randn(GPT_OSS["num_attention_heads"], generator=g) * 2
            layer.self_attention.core_attention.softmax_offset.copy_(full.chunk(tp_size)[tp_rank])


def _tp_worker(tp: int, overrides: dict):
    """At etp = tp the experts are tp-split (fc1 rows ``[gate; up]`` with stride 2, their biases alike) and
    see every token of the tp group, so finalize_model_grads leaves every grad complete (at etp 1 the whole
    experts' grads are partial sums that DDP reduces over expert-dp)."""
    state = initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp)
    try:
        config = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, **GPT_OSS, **overrides)
        model = build_model(config, state)
        _set_sinks(model, state.tp_size, state.tp_rank)
        return loss_and_grads(model, state)
    finally:
        if tp > 1:
            destroy_model_parallel(state)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_sequence_parallel_matches_tp1(distributed, name):
    ref_loss, ref_grads = _tp_worker(1, CONFIGS[name])
    results = distributed(2, _tp_worker, 2, CONFIGS[name])
    for rank, (loss, _) in enumerate(results):
        torch.testing.assert_close(loss, ref_loss, **LOSS_TOL, msg=lambda m: f"loss rank {rank}: {m}")
    gathered = full_grads([grads for _, grads in results])
    assert gathered.keys() == ref_grads.keys()
    sinks = [n for n in gathered if n.endswith("core_attention.softmax_offset")]
    assert len(sinks) == GPT_OSS["num_layers"] and results[0][1][sinks[0]][0].shape == (2,)  # [heads/tp]
    for name_, grad in gathered.items():
        torch.testing.assert_close(grad, ref_grads[name_][0], **GRAD_TOL, msg=lambda m: f"grad {name_}: {m}")
    assert all(ref_grads[n][0].abs().max() > 1e-3 for n in sinks)


def _cp_worker(cp: int, cp_comm_type: str, hierarchical=None):
    """Per-token losses ``[b, s]`` (natural order) and the weight grads of the mean loss, summed over cp."""
    state = initialize_model_parallel(context_parallel_size=cp, hierarchical_context_parallel_sizes=hierarchical)
    try:
        config = tiny_config(context_parallel_size=cp, cp_comm_type=cp_comm_type, **GPT_OSS)
        model = build_model(config, state)
        _set_sinks(model, 1, 0)
        input_ids, positions, labels = make_batch(0)
        batch = split_batch(dict(input_ids=input_ids, positions=positions, labels=labels), cp_size=cp,
                            cp_rank=state.cp_rank)
        loss = model(batch["input_ids"], batch["positions"], labels=batch["labels"])  # [b, s/cp]
        (loss.sum() / labels.numel()).backward()  # the mean over every cp rank's tokens
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        if cp > 1:
            for grad in grads.values():
                dist.all_reduce(grad, group=state.cp_group)
            pieces = [torch.empty_like(loss) for _ in range(cp)]
            dist.all_gather(pieces, loss.detach().contiguous(), group=state.cp_group)
            loss = to_natural_order(torch.cat(pieces, dim=1), dim=1, cp_size=cp)
        return loss.detach(), grads
    finally:
        if cp > 1:
            destroy_model_parallel(state)


@pytest.mark.parametrize("cp_comm_type", ["allgather", "p2p", "a2a", "a2a+p2p"])
def test_cp2_matches_cp1(distributed, cp_comm_type):
    """cp 2 (a2a+p2p: cp 4 as 2 x 2) with sinks and a sliding window equals one rank."""
    ref_loss, ref_grads = _cp_worker(1, cp_comm_type)
    cp, hierarchical = (4, (2, 2)) if cp_comm_type == "a2a+p2p" else (2, None)
    for rank, (loss, grads) in enumerate(distributed(cp, _cp_worker, cp, cp_comm_type, hierarchical)):
        torch.testing.assert_close(loss, ref_loss, **LOSS_TOL, msg=lambda m: f"loss rank {rank}: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], **GRAD_TOL, msg=lambda m: f"grad {name}: {m}")
