"""Sequence parallelism under the per-tensor FP8 recipes (Transformer Engine's way): a column-parallel FP8 linear
quantizes its local input chunk with the whole tensor's scale, all-gathers the FP8 bytes (forward, and again for
dW in backward) and saves only the local FP8 chunk; outputs and grads are bit-identical to gathering the
high-precision input and quantizing the gathered tensor (the same layer without SP, fed the whole input). Before
this, it gathered and saved the input in high precision (the byte checks fail there)."""
import contextlib

import pytest
import torch

from megatron_core.fp8 import Fp8Config
from megatron_core.fp8 import linear as fp8_linear_module

S, B, K, N = 8, 3, 24, 40


@contextlib.contextmanager
def _counting_gathers():
    """Records ``(dtype, numel)`` of every tensor the FP8 linear all-gathers while inside."""
    gathers, original = [], fp8_linear_module._all_gather

    def counting_gather(tensor, group):
        gathers.append((tensor.dtype, tensor.numel()))
        return original(tensor, group)

    fp8_linear_module._all_gather = counting_gather
    try:
        yield gathers
    finally:
        fp8_linear_module._all_gather = original


def _sp_against_whole_input(recipe):
    from megatron_core import initialize_model_parallel
    from megatron_core.tensor_parallel import ColumnParallelLinear
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    config = Fp8Config(fp8_recipe=recipe)
    torch.manual_seed(0)
    layers = [ColumnParallelLinear(K, N, tp_group=state.tp_group, sequence_parallel=sp, fp8=config)
              for sp in (True, False)]
    with torch.no_grad():
        layers[1].weight.copy_(layers[0].weight)
        layers[1].bias.copy_(layers[0].bias)
        if recipe == "delayed":  # a calibrated state, as after some steps
            for layer in layers:
                layer.fp8_state.fp8_scale.copy_(torch.tensor([3.0, 700.0, 50.0]))
    x = torch.randn(S, B, K)  # the same on both ranks (same seed)
    torch.manual_seed(1 + state.tp_rank)
    dy = torch.randn(S, B, N // 2) * 1e-3
    local = x.chunk(2)[state.tp_rank].clone()

    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tensor.numel()))
        return tensor

    with _counting_gathers() as gathers:
        x_sp = local.requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out_sp, _ = layers[0](x_sp)
        out_sp.backward(dy)
    x_ref = x.clone().requires_grad_(True)
    out_ref, _ = layers[1](x_ref)
    out_ref.backward(dy)
    results = dict(out=torch.equal(out_sp, out_ref), dx=torch.equal(x_sp.grad, x_ref.grad.chunk(2)[state.tp_rank]),
                   dw=torch.equal(layers[0].weight.grad, layers[1].weight.grad),
                   db=torch.equal(layers[0].bias.grad, layers[1].bias.grad))
    if recipe == "delayed":
        results["amax"] = torch.equal(layers[0].fp8_state.fp8_amax_step, layers[1].fp8_state.fp8_amax_step)
    return results, gathers, saved, local.numel()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_sequence_parallel_gathers_and_saves_fp8_bytes(distributed, recipe):
    for results, gathers, saved, local_numel in distributed(2, _sp_against_whole_input, recipe):
        assert all(results.values()), results
        # forward and the weight grad's re-gather: the local chunk's FP8 bytes (1 byte each), never fp32
        assert gathers == [(torch.uint8, local_numel)] * 2, gathers
        assert (torch.float8_e4m3fn, local_numel) in saved, saved
        assert not any(numel == local_numel and dtype.itemsize > 1 for dtype, numel in saved), saved  # (was fp32)


def _block_recipe_gathers_high_precision(recipe):
    """Block recipes quantize along the gathered tensor's rows: they keep gathering x itself."""
    from megatron_core import initialize_model_parallel
    from megatron_core.tensor_parallel import ColumnParallelLinear
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    layer = ColumnParallelLinear(K, N, tp_group=state.tp_group, sequence_parallel=True,
                                 fp8=Fp8Config(fp8_recipe=recipe))
    with _counting_gathers() as gathers:
        out, _ = layer(torch.randn(S // 2, B, K, requires_grad=True))
        out.sum().backward()
    return [dtype for dtype, _ in gathers]


def test_block_recipes_still_gather_the_input_itself(distributed):
    assert distributed(2, _block_recipe_gathers_high_precision, "blockwise")[0] == [torch.float32] * 2
