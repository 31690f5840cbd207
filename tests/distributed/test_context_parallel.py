"""Context-parallel attention (p2p ring, a2a Ulysses, allgather, a2a+p2p hierarchical) at cp 2 and 4 against full
single-process
attention from the same weights and data: the output, the input grad and the weight grads (summed over cp)
of SelfAttention with causal masks, GQA, RoPE and padding masks, fp32 to tight tolerances."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.context_parallel import local_positions, split_sequence
from megatron_core.transformer import RotaryEmbedding, SelfAttention

TOL = dict(rtol=1e-5, atol=2e-6)
WEIGHT_GRAD_TOL = dict(rtol=1e-5, atol=1e-5)  # sums over s x b = 32 tokens of O(1) terms: fp32 noise ~3e-6
SEQ, BATCH = 16, 2
ATTENTION = {  # name: (hidden, heads, groups, rope, padded)
    "mha": (16, 4, 4, False, False),
    "gqa-rope-padded": (32, 8, 4, True, True),
}


def _config(name: str, **parallel) -> TransformerConfig:
    hidden, heads, groups, rope, _ = ATTENTION[name]
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                             position_embedding_type="rope" if rope else "learned_absolute",
                             max_position_embeddings=SEQ, attention_dropout=0.0, hidden_dropout=0.0, **parallel)


def _padding_mask(seq: int) -> torch.Tensor:
    """Causal plus padded keys: the second sequence has 5 padding tokens at its end. ``[b, 1, s, s]``."""
    lengths = torch.tensor([seq, seq - 5])
    padded_keys = torch.arange(seq)[None, :] >= lengths[:, None]  # [b, s]
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return causal[None, None] | padded_keys[:, None, None, :]


def _run(attention, x, positions, mask, dout, rope):
    rotary = RotaryEmbedding(attention.config.kv_channels)(positions) if rope else None
    out, bias = attention(x, mask, rotary)
    out = out + bias
    (out * dout).sum().backward()
    return out.detach()


def _self_attention_parity(cp: int, comm_type: str, name: str, hierarchical=None) -> None:
    _, _, _, rope, padded = ATTENTION[name]
    torch.manual_seed(0)  # the same weights on every rank, whatever an earlier task left in this worker
    state = initialize_model_parallel(context_parallel_size=cp, hierarchical_context_parallel_sizes=hierarchical)
    try:
        single = dataclasses.replace(state, cp_size=1, cp_rank=0, cp_group=None, cp_ranks=(state.rank,))
        reference = SelfAttention(_config(name), layer_number=1, parallel_state=single)
        with torch.no_grad():
            reference.linear_qkv.bias.normal_()
            reference.linear_proj.bias.normal_()
        sharded = SelfAttention(_config(name, context_parallel_size=cp, cp_comm_type=comm_type), layer_number=1,
                                parallel_state=state)
        sharded.load_state_dict(reference.state_dict())
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SEQ, BATCH, reference.config.hidden_size, generator=g, requires_grad=True)
        dout = torch.randn(SEQ, BATCH, reference.config.hidden_size, generator=g)
        mask = _padding_mask(SEQ) if padded else None
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        expected = _run(reference, x, positions, mask, dout, rope)

        split = dict(dim=0, cp_size=cp, cp_rank=state.cp_rank)
        x_local = split_sequence(x.detach(), **split).requires_grad_()
        local = local_positions(SEQ, cp_size=cp, cp_rank=state.cp_rank).expand(BATCH, SEQ // cp)
        out = _run(sharded, x_local, local, mask, split_sequence(dout, **split), rope)
        torch.testing.assert_close(out, split_sequence(expected, **split), **TOL)
        torch.testing.assert_close(x_local.grad, split_sequence(x.grad, **split), **TOL)
        for (param_name, param), ref_param in zip(sharded.named_parameters(), reference.parameters()):
            grad = param.grad.clone()
            dist.all_reduce(grad, group=state.cp_group)  # each cp rank holds its tokens' share
            torch.testing.assert_close(grad, ref_param.grad, **WEIGHT_GRAD_TOL, msg=lambda m: f"{param_name}: {m}")
    finally:
        destroy_model_parallel(state)


@pytest.mark.parametrize("name", list(ATTENTION))
@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_self_attention_matches_full_attention(distributed, cp, comm_type, name):
    distributed(cp, _self_attention_parity, cp, comm_type, name)


@pytest.mark.parametrize("name", list(ATTENTION))
@pytest.mark.parametrize("cp,sizes", [(4, (2, 2)), (2, (2, 1)), (2, (1, 2))])
def test_hierarchical_attention_matches_full_attention(distributed, cp, sizes, name):
    """a2a+p2p: Ulysses over the inner level, the ring over the outer one (degenerate levels of 1 included)."""
    distributed(cp, _self_attention_parity, cp, "a2a+p2p", name, sizes)


def _hierarchical_groups_and_errors() -> dict:
    from megatron_core.context_parallel import hierarchical_attention
    state = initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    flat = initialize_model_parallel(context_parallel_size=4)
    try:
        q = torch.zeros(4, 1, 2, 3)
        errors = {}
        for label, layout, shape in (("no levels", flat, (4, 1, 2, 3)), ("heads", state, (4, 1, 3, 3))):
            try:
                hierarchical_attention(torch.zeros(shape), q, q, None, parallel_state=layout, scale=1.0)
            except ValueError as error:
                errors[label] = str(error)
        return {"sizes": state.hierarchical_cp_sizes, "ranks": state.hierarchical_cp_ranks, "errors": errors}
    finally:
        destroy_model_parallel(state)
        destroy_model_parallel(flat)


def test_hierarchical_groups_follow_megatron_and_bad_layouts_are_named(distributed):
    results = distributed(4, _hierarchical_groups_and_errors)
    assert [r["ranks"] for r in results] == [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((2, 3), (0, 2)), ((2, 3), (1, 3))]
    assert results[0]["sizes"] == (2, 2)
    assert "--hierarchical-context-parallel-sizes" in results[0]["errors"]["no levels"]
    assert "3 query heads" in results[0]["errors"]["heads"]
    with pytest.raises(ValueError, match=r"product is context_parallel_size 4"):
        initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3])


def _dropout_is_consistent(kind: str, p: float) -> dict:
    """Ring or allgather attention with attention dropout, fp64: the same tracker state draws the same masks,
    and the backward's directional derivative equals central finite differences of the forward (so backward
    drew exactly the forward's masks)."""
    from megatron_core.context_parallel import allgather_attention, hierarchical_attention, ring_attention
    from megatron_core.tensor_parallel import model_parallel_seed
    hierarchical = kind == "a2a+p2p"
    state = initialize_model_parallel(context_parallel_size=4 if hierarchical else 2,
                                      hierarchical_context_parallel_sizes=(2, 2) if hierarchical else None)
    try:
        tracker = model_parallel_seed(5, tp_rank=0, tracker=state.rng_tracker)
        snapshot = tracker.get_states()
        g = torch.Generator().manual_seed(10 + state.rank)
        shapes = [(8, 1, 4, 3), (8, 1, 2, 3), (8, 1, 2, 3)]  # GQA: 4 query heads, 2 key/value groups
        qkv = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]
        weight = torch.randn(8, 1, 12, generator=g, dtype=torch.float64)
        directions = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]

        def total(tensors, dropout):
            tracker.set_states(snapshot)
            common = dict(cp_group=state.cp_group, cp_rank=state.cp_rank, scale=0.5, dropout_p=dropout,
                          rng_tracker=tracker)
            if hierarchical:
                out = hierarchical_attention(*tensors, None, parallel_state=state, scale=0.5, dropout_p=dropout)
            elif kind == "p2p":
                out = ring_attention(*tensors, None, cp_ranks=state.cp_ranks, **common)
            else:
                out = allgather_attention(*tensors, None, cp_size=state.cp_size, **common)
            return (out * weight).sum()

        leaves = [x.clone().requires_grad_() for x in qkv]
        total(leaves, p).backward()
        analytic = torch.stack([sum((x.grad * d).sum() for x, d in zip(leaves, directions))])
        eps = 1e-6
        with torch.no_grad():
            plus = total([x + eps * d for x, d in zip(qkv, directions)], p)
            minus = total([x - eps * d for x, d in zip(qkv, directions)], p)
            numeric = ((plus - minus) / (2 * eps)).reshape(1)
            values = torch.stack([total(qkv, p), total(qkv, p), total(qkv, 0.0)])
        for tensor in (analytic, numeric):  # the objective is the sum over cp ranks
            dist.all_reduce(tensor, group=state.cp_group)
        return {"analytic": analytic, "numeric": numeric, "values": values}
    finally:
        destroy_model_parallel(state)


@pytest.mark.parametrize("kind", ["p2p", "allgather", "a2a+p2p"])
def test_attention_dropout_backward_replays_the_forward_masks(distributed, kind):
    for result in distributed(4 if kind == "a2a+p2p" else 2, _dropout_is_consistent, kind, 0.3):
        torch.testing.assert_close(result["analytic"], result["numeric"], rtol=1e-6, atol=1e-8)
        first, again, undropped = result["values"].tolist()
        assert first == again and abs(first - undropped) > 1e-3
