"""FP8 under ``--tp-comm-overlap`` (``megatron_core.fp8.comm_overlap``): a column- then row-parallel FP8 pair under
sequence parallelism at tp 2 and 4 runs its collectives chunk by chunk beside the FP8 GEMMs, moving FP8 bytes
where the operand is FP8 (x forward and again for dW, dy of the row layer), and gives the plain FP8 path's
outputs, input grads, weight grads, bias grads and delayed amaxes (to fp32 rounding: the GEMMs run on blocks of
rows). Before this, FP8 with tp_comm_overlap ran the plain path (no chunked collectives: the counts fail there)."""
import contextlib

import pytest
import torch

from megatron_core.fp8 import Fp8Config
from megatron_core.fp8 import comm_overlap as fp8_overlap

S, B, K, N = 8, 3, 24, 40
CHUNKS = 2  # DEFAULT_NUM_CHUNKS: S / tp = 4 (tp 2) or 2 (tp 4) local rows split in 2


@contextlib.contextmanager
def _counting_overlapped_collectives():
    """Records each chunked FP8 all-gather ``("gather", dtype, chunks)`` and chunked reduce-scatter
    ``("reduce_scatter", chunks)`` the overlapped path starts while inside."""
    calls, gather, scatter = [], fp8_overlap._gather_bytes, fp8_overlap._gemm_reduce_scatter

    def counting_gather(data, group, chunks):
        started = gather(data, group, chunks)
        calls.append(("gather", data.dtype, len(started)))
        return started

    def counting_scatter(plan, a, b, out, group, chunks):
        started = scatter(plan, a, b, out, group, chunks)
        calls.append(("reduce_scatter", len(started)))
        return started

    fp8_overlap._gather_bytes, fp8_overlap._gemm_reduce_scatter = counting_gather, counting_scatter
    try:
        yield calls
    finally:
        fp8_overlap._gather_bytes, fp8_overlap._gemm_reduce_scatter = gather, scatter


def _pair(state, config, overlap: bool):
    from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    torch.manual_seed(0)
    common = dict(tp_group=state.tp_group, sequence_parallel=True, fp8=config, tp_comm_overlap=overlap)
    column = ColumnParallelLinear(K, N, **common)
    row = RowParallelLinear(N, K, input_is_parallel=True, **common)
    if config.fp8_recipe == "delayed":  # a calibrated state, as after some steps
        with torch.no_grad():
            for layer in (column, row):
                layer.fp8_state.fp8_scale.copy_(torch.tensor([3.0, 700.0, 50.0]))
    return column, row


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise difference relative to b's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max()).item()


def _overlapped_against_plain(recipe, tp):
    from megatron_core import initialize_model_parallel
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    config = Fp8Config(fp8_recipe=recipe)
    torch.manual_seed(1 + state.tp_rank)
    x = torch.randn(S // tp, B, K)
    dy = torch.randn(S // tp, B, K) * 1e-2
    runs = []
    for overlap in (True, False):
        column, row = _pair(state, config, overlap)
        x_in = x.clone().requires_grad_(True)
        with _counting_overlapped_collectives() as calls:
            out, _ = row(torch.nn.functional.gelu(column(x_in)[0]))
            out.backward(dy)
        runs.append(dict(out=out, dx=x_in.grad, calls=calls, column=column, row=row))
    overlapped, plain = runs
    results = {"out": _difference(overlapped["out"], plain["out"]), "dx": _difference(overlapped["dx"], plain["dx"])}
    for name in ("column", "row"):
        for param, reference in zip(overlapped[name].parameters(), plain[name].parameters()):
            results[f"{name} grad {tuple(param.shape)}"] = _difference(param.grad, reference.grad)
        if recipe == "delayed":
            results[f"{name} amax"] = _difference(overlapped[name].fp8_state.fp8_amax_step,
                                                  plain[name].fp8_state.fp8_amax_step)
    return results, overlapped["calls"], plain["calls"]


@pytest.mark.parametrize("recipe, tp", [("tensorwise", 2), ("delayed", 2), ("tensorwise", 4)])
def test_fp8_tp_comm_overlap_matches_the_plain_fp8_path(distributed, recipe, tp):
    for results, overlapped, plain in distributed(tp, _overlapped_against_plain, recipe, tp):
        assert max(results.values()) <= 1e-6, results  # fp32 rounding of the GEMMs' blocking (0 at tp 2)
        assert plain == []
        assert sorted(overlapped, key=str) == sorted([
            ("gather", torch.float8_e4m3fn, CHUNKS),  # column forward: x's FP8 bytes
            ("reduce_scatter", CHUNKS),  # row forward: the partial sums
            ("gather", torch.float8_e5m2, CHUNKS),  # row backward: dy's FP8 bytes (hybrid: E5M2)
            ("reduce_scatter", CHUNKS),  # column backward: dx
        ], key=str), overlapped


def _blockwise_falls_back():
    from megatron_core import initialize_model_parallel
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    column, row = _pair(state, Fp8Config(fp8_recipe="blockwise"), overlap=True)
    with _counting_overlapped_collectives() as calls:
        out, _ = row(column(torch.randn(S // 2, B, K, requires_grad=True))[0])
        out.sum().backward()
    return calls, column.weight.grad is not None


def test_block_recipes_under_tp_comm_overlap_take_the_plain_fp8_path(distributed):
    assert distributed(2, _blockwise_falls_back)[0] == ([], True)
