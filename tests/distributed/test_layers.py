"""ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding at tp 1, 2, 4 against nn.Linear /
nn.Embedding semantics with the full weight: outputs, input grads and weight/bias grads (fp32).

Each distributed run loops over every flag combination of one layer, so one pool start covers them all.
"""
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

S, B, IN, OUT = 8, 2, 12, 16  # [s, b, h]; all divisible by 4
TOL = dict(rtol=1e-5, atol=1e-5)


def _reference(seed, in_features, out_features):
    """Full weight, bias, input and output grad (the same on every rank), and the reference results."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(S, B, in_features, generator=g, requires_grad=True)
    grad_out = torch.randn(S, B, out_features, generator=g)
    return weight, bias, x, grad_out


def _linear_reference(weight, bias, x, grad_out, use_bias):
    x = x.detach().clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if use_bias else None
    out = F.linear(x, w, b)
    out.backward(grad_out)
    return out.detach(), x.grad, w.grad, (b.grad if use_bias else None)


def _check(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _column_cases():
    tp_world = dist.get_world_size()
    state = initialize_model_parallel(tensor_model_parallel_size=tp_world)
    r, tp = state.tp_rank, state.tp_size
    weight, bias, x, grad_out = _reference(1, IN, OUT)
    for use_bias, gather_output, skip_bias_add, sp in itertools.product([True, False], repeat=4):
        if gather_output and sp:
            continue
        case = f"column tp={tp} bias={use_bias} gather_output={gather_output} skip_bias_add={skip_bias_add} sp={sp}"
        layer = ColumnParallelLinear(IN, OUT, tp_group=state.tp_group, bias=use_bias, gather_output=gather_output,
                                     skip_bias_add=skip_bias_add, sequence_parallel=sp)
        with torch.no_grad():
            layer.weight.copy_(weight.chunk(tp, 0)[r])
            if use_bias:
                layer.bias.copy_(bias.chunk(tp, 0)[r])
        ref_out, ref_dx, ref_dw, ref_db = _linear_reference(weight, bias, x, grad_out, use_bias)
        inp = (x.detach().chunk(tp, 0)[r] if sp else x.detach()).clone().requires_grad_()
        out, out_bias = layer(inp)
        expected_out = ref_out if gather_output else ref_out.chunk(tp, -1)[r]
        if skip_bias_add and use_bias:
            _check(out_bias, bias if gather_output else bias.chunk(tp, 0)[r], f"{case} output_bias")
            out = out + out_bias  # the caller adds it, as a fused bias-GELU would
        else:
            assert out_bias is None, case
        _check(out, expected_out, f"{case} output")
        out.backward(grad_out if gather_output else grad_out.chunk(tp, -1)[r])
        _check(inp.grad, ref_dx.chunk(tp, 0)[r] if sp else ref_dx, f"{case} input grad")
        _check(layer.weight.grad, ref_dw.chunk(tp, 0)[r], f"{case} weight grad")
        if use_bias:
            _check(layer.bias.grad, ref_db.chunk(tp, 0)[r], f"{case} bias grad")
    destroy_model_parallel(state)
    return "ok"


def _row_cases():
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    r, tp = state.tp_rank, state.tp_size
    weight, bias, x, grad_out = _reference(2, IN, OUT)
    for use_bias, input_is_parallel, skip_bias_add, sp in itertools.product([True, False], repeat=4):
        if sp and not input_is_parallel:
            continue
        case = (f"row tp={tp} bias={use_bias} input_is_parallel={input_is_parallel} "
                f"skip_bias_add={skip_bias_add} sp={sp}")
        layer = RowParallelLinear(IN, OUT, tp_group=state.tp_group, bias=use_bias, input_is_parallel=input_is_parallel,
                                  skip_bias_add=skip_bias_add, sequence_parallel=sp)
        with torch.no_grad():
            layer.weight.copy_(weight.chunk(tp, 1)[r])
            if use_bias:
                layer.bias.copy_(bias)
        ref_out, ref_dx, ref_dw, ref_db = _linear_reference(weight, bias, x, grad_out, use_bias)
        inp = (x.detach().chunk(tp, -1)[r] if input_is_parallel else x.detach()).clone().requires_grad_()
        out, out_bias = layer(inp)
        if skip_bias_add and use_bias:
            _check(out_bias, bias, f"{case} output_bias")
            out = out + out_bias
        else:
            assert out_bias is None, case
        _check(out, ref_out.chunk(tp, 0)[r] if sp else ref_out, f"{case} output")
        out.backward(grad_out.chunk(tp, 0)[r] if sp else grad_out)
        _check(inp.grad, ref_dx.chunk(tp, -1)[r] if input_is_parallel else ref_dx, f"{case} input grad")
        _check(layer.weight.grad, ref_dw.chunk(tp, 1)[r], f"{case} weight grad")
        if use_bias:
            # Under sequence parallelism each rank holds the bias grad of its sequence chunk: the sum over tp
            # (done by the grad-reduction of params tagged sequence_parallel) is the full grad.
            bias_grad = layer.bias.grad.clone()
            if sp:
                assert layer.bias.sequence_parallel
                dist.all_reduce(bias_grad, group=state.tp_group)
            _check(bias_grad, ref_db, f"{case} bias grad")
    destroy_model_parallel(state)
    return "ok"


def _embedding_cases():
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    r, tp = state.tp_rank, state.tp_size
    vocab, hidden = 16, 8
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(vocab, hidden, generator=g)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    ids[0, :2] = torch.tensor([0, vocab - 1])  # both ends of the vocab
    grad_out = torch.randn(B, S, hidden, generator=g)
    w_ref = weight.clone().requires_grad_()
    ref = F.embedding(ids, w_ref)
    ref.backward(grad_out)
    for reduce_scatter in (False, True):
        case = f"embedding tp={tp} reduce_scatter_embeddings={reduce_scatter}"
        layer = VocabParallelEmbedding(vocab, hidden, tp_group=state.tp_group,
                                       reduce_scatter_embeddings=reduce_scatter)
        with torch.no_grad():
            layer.weight.copy_(weight.chunk(tp, 0)[r])
        out = layer(ids)
        if reduce_scatter:  # [s/tp, b, h]
            _check(out, ref.detach().transpose(0, 1).chunk(tp, 0)[r], f"{case} output")
            out.backward(grad_out.transpose(0, 1).chunk(tp, 0)[r])
        else:  # [b, s, h]
            _check(out, ref.detach(), f"{case} output")
            out.backward(grad_out)
        _check(layer.weight.grad, w_ref.grad.chunk(tp, 0)[r], f"{case} weight grad")
    destroy_model_parallel(state)
    return "ok"


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("cases", [_column_cases, _row_cases, _embedding_cases], ids=["column", "row", "embedding"])
def test_layer_matches_full_weight_reference(distributed, tp, cases):
    assert distributed(tp, cases) == ["ok"] * tp


def _partition_records():
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    column = ColumnParallelLinear(IN, OUT, tp_group=state.tp_group, stride=2)
    row = RowParallelLinear(IN, OUT, tp_group=state.tp_group, sequence_parallel=True)
    emb = VocabParallelEmbedding(16, 4, tp_group=state.tp_group)
    records = {name: (p.tensor_model_parallel, p.partition_dim, p.partition_stride, tuple(p.shape))
               for prefix, m in (("column", column), ("row", row), ("emb", emb)) for name, p in
               ((f"{prefix}.{n}", p) for n, p in m.named_parameters())}
    destroy_model_parallel(state)
    return records, row.bias.sequence_parallel


def test_parameters_record_their_partitioning(distributed):
    records, row_bias_sp = distributed(2, _partition_records)[0]
    assert records == {
        "column.weight": (True, 0, 2, (OUT // 2, IN)),
        "column.bias": (True, 0, 2, (OUT // 2,)),
        "row.weight": (True, 1, 1, (OUT, IN // 2)),
        "row.bias": (False, -1, 1, (OUT,)),
        "emb.weight": (True, 0, 1, (8, 4)),
    }
    assert row_bias_sp is True
