"""--tp-comm-overlap (``tensor_parallel.comm_overlap``) at tp 2 and 4 with sequence parallelism: the chunked,
overlapped all-gather+GEMM and GEMM+reduce-scatter against the full-weight single-process linear (outputs,
input, weight and bias grads, fp32), and GPTModel with the flag against tp 1 over a few optimizer steps."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter, usable_chunks
from tests.model_helpers import build_model, full_grads, loss_and_grads, tiny_config

S, B, IN, OUT = 24, 2, 12, 16  # s divisible by tp 4 x 3 chunks and by tp 2 x 4 chunks
TOL = dict(rtol=1e-5, atol=1e-5)


def _reference(seed):
    g = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(OUT, IN, generator=g), torch.randn(OUT, generator=g)
    x, grad_out = torch.randn(S, B, IN, generator=g), torch.randn(S, B, OUT, generator=g)
    w, b, xr = weight.clone().requires_grad_(), bias.clone().requires_grad_(), x.clone().requires_grad_()
    out = F.linear(xr, w, b)
    out.backward(grad_out)
    return weight, bias, x, grad_out, (out.detach(), xr.grad, w.grad, b.grad)


def _check(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _functions():
    """Both overlapped ops at 1, 2, 3, 4 and 5 (falls back to a divisor) chunks."""
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    r, tp, group = state.tp_rank, state.tp_size, state.tp_group
    weight, bias, x, grad_out, (ref_out, ref_dx, ref_dw, ref_db) = _reference(5)
    for chunks in (1, 2, 3, 4, 5):
        case = f"column tp={tp} chunks={chunks}"
        w, b = weight.chunk(tp, 0)[r].clone().requires_grad_(), bias.chunk(tp, 0)[r].clone().requires_grad_()
        inp = x.chunk(tp, 0)[r].clone().requires_grad_()
        out = all_gather_linear(inp, w, b, group, num_chunks=chunks)  # [s, b, out/tp]
        _check(out, ref_out.chunk(tp, -1)[r], f"{case} output")
        out.backward(grad_out.chunk(tp, -1)[r])
        _check(inp.grad, ref_dx.chunk(tp, 0)[r], f"{case} input grad")
        _check(w.grad, ref_dw.chunk(tp, 0)[r], f"{case} weight grad")
        _check(b.grad, ref_db.chunk(tp, 0)[r], f"{case} bias grad")

        case = f"row tp={tp} chunks={chunks}"
        w = weight.chunk(tp, 1)[r].clone().requires_grad_()
        inp = x.chunk(tp, -1)[r].clone().requires_grad_()
        out = linear_reduce_scatter(inp, w, group, num_chunks=chunks)  # [s/tp, b, out]
        _check(out + bias, ref_out.chunk(tp, 0)[r], f"{case} output")
        out.backward(grad_out.chunk(tp, 0)[r])
        _check(inp.grad, ref_dx.chunk(tp, -1)[r], f"{case} input grad")
        _check(w.grad, ref_dw.chunk(tp, 1)[r], f"{case} weight grad")
    destroy_model_parallel(state)
    return "ok"


@pytest.mark.parametrize("tp", [2, 4])
def test_overlapped_linears_match_the_full_linear(distributed, tp):
    assert distributed(tp, _functions) == ["ok"] * tp


def test_usable_chunks_divides_the_local_sequence():
    assert [usable_chunks(6, n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 3, 3, 3, 6]
    assert usable_chunks(1, 4) == 1


def test_flag_needs_sequence_parallel():
    with pytest.raises(ValueError, match="tp_comm_overlap=True needs sequence_parallel=True"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                          tp_comm_overlap=True)
    with pytest.raises(ValueError, match="RowParallelLinear: tp_comm_overlap=True needs sequence_parallel"):
        RowParallelLinear(8, 8, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="ColumnParallelLinear: tp_comm_overlap=True needs sequence_parallel"):
        ColumnParallelLinear(8, 8, tp_comm_overlap=True)


def _train(overrides, steps=3):
    """Per-step losses and the final gathered-ready grads of a tiny GPT trained with SGD at this world size."""
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    config = tiny_config(tensor_model_parallel_size=state.tp_size, **overrides)
    model = build_model(config, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss, grads = loss_and_grads(model, state, seed=step)
        losses.append(loss.mean().detach())
        optimizer.step()
    destroy_model_parallel(state)
    return torch.stack(losses), grads


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_with_overlap_matches_tp1_over_steps(distributed, tp):
    overrides = dict(activation="swiglu", normalization="RMSNorm", untie_embeddings_and_output_weights=True)
    ref_losses, ref_grads = distributed(1, _train, overrides)[0]
    results = distributed(tp, _train, {**overrides, "sequence_parallel": True, "tp_comm_overlap": True})
    for losses, _ in results:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    gathered = full_grads([grads for _, grads in results])
    assert gathered.keys() == ref_grads.keys()
    for name, grad in gathered.items():
        torch.testing.assert_close(grad, ref_grads[name][0], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
