"""FP8 linear layers (tp 1) against a hand emulation built from the reference quantizers (quantize, dequantize,
fp32 matmul): forward, input, weight and bias grads for every recipe and both formats; delayed scaling's amax
recording; GPTModel training in FP8 with its scaling state in the checkpoint (and an exact resume);
first_last_layers_bf16; the routed experts (loop and grouped GEMM) in FP8."""
import dataclasses

import numpy as np
import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.checkpointing import load_model_weights, save_checkpoint
from megatron_core.checkpointing.checkpoint import read_metadata
from megatron_core.checkpointing.layout import global_named_buffers
from megatron_core.fp8 import E4M3, E5M2, Fp8Config, update_fp8_scales
from megatron_core.fp8.state import scaling_states
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer.mla import ReplicatedLinear
from megatron_core.transformer.moe import MoEConfig, moe_layer_spec
from megatron_core.transformer.moe.experts import LocalExperts
from tests.model_helpers import VOCAB, build_model, make_batch, tiny_config
from tests.unit.test_fp8_quantize import ref_blocks, ref_mx, ref_quantize, ref_tensorwise

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
CLOSE = dict(rtol=1e-6, atol=1e-7)  # fp32 matmuls of the same operands: only the GEMM's layout may differ


def ref_dequantize(t: torch.Tensor, recipe: str, role: str, fp8_format: str, scale=None) -> torch.Tensor:
    """``t`` ``[rows, R]`` quantized along R by the references of test_fp8_quantize, dequantized (fp32)."""
    fmt = E5M2 if fp8_format == "hybrid" and role == "grad_output" else E4M3
    t = t.detach().float()
    if recipe == "delayed":
        scale = np.float32(scale)
        q, inv = ref_quantize(t.double().numpy(), scale, fmt), np.float32(1.0) / scale
    elif recipe == "tensorwise":
        q, inv = ref_tensorwise(t, fmt)
    elif recipe == "blockwise":
        q, inv = ref_blocks(t, fmt, (128, 128) if role == "weight" else (1, 128))
    else:
        q, exps = ref_mx(t, fmt)
        inv = np.repeat(np.exp2(exps.astype(np.float64)), 32, axis=1)[:, :t.shape[1]].astype(np.float32)
    return torch.from_numpy(q.astype(np.float32)) * torch.as_tensor(inv, dtype=torch.float32)


def hand_linear(x, w, b, dy, recipe, fp8_format, scales=(None, None, None), fp8_wgrad=True):
    """y = Q(x) Q(W)^T + b, dx = Q(dy) Q(W^T)^T, dW = Q(dy^T) Q(x^T)^T (each Q along its GEMM's reduction dim)."""
    def deq(t, role, scale):
        return ref_dequantize(t, recipe, role, fp8_format, scale)
    sx, sw, sg = scales
    y = deq(x, "input", sx) @ deq(w, "weight", sw).t()
    y = y + b if b is not None else y
    dx = deq(dy, "grad_output", sg) @ deq(w.t().contiguous(), "weight", sw).t()
    if not fp8_wgrad:
        return y, dx, dy.t() @ x
    return y, dx, deq(dy.t().contiguous(), "grad_output", sg) @ deq(x.t().contiguous(), "input", sx).t()


def _run_layer(layer, x, dy):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(dy)
    return out.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_matches_hand_emulation(kind, recipe, fp8_format):
    torch.manual_seed(0)
    config = Fp8Config(fp8_recipe=recipe, fp8_format=fp8_format)
    k, n = (24, 40) if kind != "row" else (40, 24)  # not multiples of 16; blocks partial
    if kind == "column":
        layer = ColumnParallelLinear(k, n, fp8=config)
    elif kind == "row":
        layer = RowParallelLinear(k, n, fp8=config)
    else:
        layer = ReplicatedLinear(k, n, init_method=torch.nn.init.normal_, sequence_parallel=False, bias=True,
                                 fp8=config)
    with torch.no_grad():
        if layer.bias is not None:
            layer.bias.normal_()
    scales = (None, None, None)
    if recipe == "delayed":  # a state as after some steps
        scales = (3.0, 700.0, 50.0)
        layer.fp8_state.fp8_scale.copy_(torch.tensor(scales))
    x, dy = torch.randn(5, 3, k), torch.randn(5, 3, n) * 1e-3
    out, dx, dw, db = _run_layer(layer, x, dy)
    y, hand_dx, hand_dw = hand_linear(x.view(-1, k), layer.weight, layer.bias, dy.view(-1, n), recipe, fp8_format,
                                      scales)
    torch.testing.assert_close(out.view(-1, n), y.detach(), **CLOSE)
    torch.testing.assert_close(dx.view(-1, k), hand_dx.detach(), **CLOSE)
    torch.testing.assert_close(dw, hand_dw.detach(), **CLOSE)
    if db is not None:
        torch.testing.assert_close(db, dy.view(-1, n).sum(0))
    if recipe == "delayed":  # the step's amaxes of the three roles
        expected = [x.abs().max(), layer.weight.detach().abs().max(), dy.abs().max()]
        assert layer.fp8_state.fp8_amax_step.tolist() == [float(v) for v in expected]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_wgrad_off_uses_unquantized_operands(recipe):
    torch.manual_seed(1)
    layer = ColumnParallelLinear(24, 40, bias=False, fp8=Fp8Config(fp8_recipe=recipe, fp8_wgrad=False))
    x, dy = torch.randn(7, 24), torch.randn(7, 40)
    out, dx, dw, _ = _run_layer(layer, x, dy)
    y, hand_dx, hand_dw = hand_linear(x, layer.weight, None, dy, recipe, "hybrid", fp8_wgrad=False)
    torch.testing.assert_close(out, y.detach(), **CLOSE)
    torch.testing.assert_close(dx, hand_dx.detach(), **CLOSE)
    torch.testing.assert_close(dw, dy.t() @ x, **CLOSE)


def test_delayed_first_step_calibrates_unquantized():
    """Before a role has a scale (fp8_scale 0) its operand is the unquantized tensor while the amax is recorded;
    after the update the GEMMs quantize."""
    torch.manual_seed(2)
    layer = ColumnParallelLinear(24, 40, fp8=Fp8Config(fp8_recipe="delayed"))
    x, dy = torch.randn(6, 24), torch.randn(6, 40)
    out, dx, dw, _ = _run_layer(layer, x, dy)
    w = layer.weight.detach()
    torch.testing.assert_close(out, x @ w.t() + layer.bias.detach(), **CLOSE)
    torch.testing.assert_close(dx, dy @ w, **CLOSE)
    torch.testing.assert_close(dw, dy.t() @ x, **CLOSE)
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    update_fp8_scales([layer], state)
    scales = layer.fp8_state.fp8_scale.tolist()
    maxima = ((448.0, x), (448.0, w), (57344.0, dy))  # hybrid: E4M3 input and weight, E5M2 output grad
    assert scales == [float(np.float32(m) / np.float32(t.abs().max())) for m, t in maxima]
    layer.weight.grad = None
    out, dx, dw, _ = _run_layer(layer, x, dy)
    y, hand_dx, hand_dw = hand_linear(x, layer.weight, layer.bias, dy, "delayed", "hybrid", scales)
    torch.testing.assert_close(out, y.detach(), **CLOSE)
    torch.testing.assert_close(dw, hand_dw.detach(), **CLOSE)


def test_bf16_input_gives_bf16_outputs_and_no_record_in_eval():
    layer = RowParallelLinear(32, 16, params_dtype=torch.bfloat16, fp8=Fp8Config(fp8_recipe="delayed"))
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    out, _ = layer(x)
    out.float().sum().backward()
    assert out.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    layer.fp8_state.fp8_amax_step.zero_()
    layer.eval()
    layer(x)
    assert (layer.fp8_state.fp8_amax_step == 0).all()  # evaluation leaves the scaling state alone


def _train(model, state, steps, lr=0.05):
    losses = []
    for step in range(steps):
        input_ids, positions, labels = make_batch(seed=step % 2)
        loss = model(input_ids, positions, labels=labels).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
                p.grad = None
        update_fp8_scales([model], state)
        losses.append(loss.item())
    return losses


def test_gpt_model_trains_in_fp8_and_resumes_exactly(tmp_path):
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    fp8 = Fp8Config(fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    config = tiny_config(fp8=fp8, normalization="RMSNorm", activation="swiglu")
    model = build_model(config, state)
    losses = _train(model, state, 6, lr=0.2)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses
    assert model.output_layer.fp8 is None and model.decoder.layers[0].self_attention.linear_qkv.fp8 == fp8
    buffers = global_named_buffers([model], config, state)
    history = "decoder.layers.1.mlp.linear_fc2.fp8_state.fp8_amax_history"
    assert history in buffers and "decoder.layers.0.self_attention.linear_qkv.fp8_state.fp8_scale" in buffers
    assert (buffers[history][:, :4] > 0).all() and buffers[history].shape == (3, 4)
    assert not any(name.endswith("fp8_amax_step") for name in buffers)
    save_checkpoint(str(tmp_path), iteration=6, model_chunks=[model], config=config, state=state,
                    true_vocab_size=VOCAB, consumed_samples=0)
    expected = _train(model, state, 3)
    resumed = build_model(config, state, seed=99)
    folder, metadata = read_metadata(str(tmp_path))
    load_model_weights(folder, metadata, model_chunks=[resumed], config=config, state=state)
    for mine, theirs in zip(scaling_states([resumed]), scaling_states([model])):
        assert mine.fp8_amax_history.shape == theirs.fp8_amax_history.shape
    assert _train(resumed, state, 3) == expected


def test_first_last_layers_bf16_leave_those_layers_unquantized():
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    fp8 = Fp8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True)
    config = tiny_config(num_layers=4, fp8=fp8)
    model = build_model(config, state)
    in_fp8 = [layer.self_attention.linear_qkv.fp8 is not None and layer.mlp.linear_fc1.fp8 is not None
              for layer in model.decoder.layers]
    assert in_fp8 == [False, True, True, False]
    plain = build_model(dataclasses.replace(config, fp8=None), state)
    first, x = model.decoder.layers[0].mlp, torch.randn(3, 2, 16)
    torch.testing.assert_close(first(x)[0], plain.decoder.layers[0].mlp(x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("grouped", [False, True])
def test_first_last_layers_bf16_keep_the_outer_moe_layers_experts_unquantized(grouped):
    """MoELayer names its layer to the experts: the first and last MoE layers' expert GEMMs run in high
    precision (bit-equal to a model without FP8), the middle ones in FP8."""
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=grouped)
    config = tiny_config(num_layers=4, moe=moe, fp8=Fp8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True))
    model = build_model(config, state, layer_spec=moe_layer_spec())
    plain = build_model(dataclasses.replace(config, fp8=None), state, layer_spec=moe_layer_spec())
    experts = [layer.mlp.experts for layer in model.decoder.layers]
    assert [e.fp8 is not None for e in experts] == [False, True, True, False]
    tokens, counts = torch.randn(10, 16), [4, 0, 3, 3]
    for number, (mine, ref) in enumerate(zip(experts, (layer.mlp.experts for layer in plain.decoder.layers))):
        same = torch.equal(mine(tokens, counts), ref(tokens, counts))
        assert same == (number in (0, 3)), number


def _experts(grouped, recipe="tensorwise", gated=True):
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=grouped)
    config = tiny_config(fp8=Fp8Config(fp8_recipe=recipe), moe=moe, activation="swiglu" if gated else "gelu")
    return LocalExperts(config, expert_ids=range(1, 4), expert_seeds=[11, 12, 13, 14], device="cpu")


@pytest.mark.parametrize("recipe", RECIPES)
def test_experts_loop_and_grouped_gemm_agree_in_fp8(recipe):
    loop, grouped = _experts(False, recipe), _experts(True, recipe)
    grouped.load_state_dict(loop.state_dict())
    counts = [5, 0, 9]
    tokens, g = torch.randn(14, 16), torch.randn(14, 16)
    results = []
    for experts in (loop, grouped):
        x = tokens.clone().requires_grad_(True)
        out = experts(x, counts)
        (out * g).sum().backward()
        results.append((out.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)
    for name, grad in results[0][2].items():
        torch.testing.assert_close(results[1][2][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if recipe == "delayed":  # rows of the global table: expert 0 is not here, expert 2 got no tokens
        for experts in (loop, grouped):
            step = experts.fp8_state.fp8_amax_step
            assert (step[0] == 0).all() and (step[1] > 0).all() and (step[3] > 0).all()
            assert (step[2, :, 0] == 0).all() and (step[2, :, 1] > 0).all()
        torch.testing.assert_close(grouped.fp8_state.fp8_amax_step, loop.fp8_state.fp8_amax_step)


def test_expert_fc1_matches_hand_emulation():
    experts = _experts(False, gated=False)
    tokens, g = torch.randn(6, 16), torch.randn(6, 16)
    x = tokens.clone().requires_grad_(True)
    (experts(x, [6, 0, 0]) * g).sum().backward()
    fc1, fc2 = experts.local_experts["1"].linear_fc1, experts.local_experts["1"].linear_fc2
    y1 = hand_linear(tokens, fc1.weight, fc1.bias, torch.zeros(6, fc1.weight.shape[0]), "tensorwise", "hybrid")[0]
    h = torch.nn.functional.gelu(y1)
    y2 = hand_linear(h, fc2.weight, fc2.bias, g, "tensorwise", "hybrid")
    torch.testing.assert_close(experts(tokens, [6, 0, 0]), y2[0].detach(), **CLOSE)
    torch.testing.assert_close(fc2.weight.grad, y2[2].detach(), **CLOSE)


def test_moe_gpt_model_trains_in_fp8():
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, moe_aux_loss_coeff=0.01)
    config = tiny_config(fp8=Fp8Config(fp8_recipe="delayed"), moe=moe)
    model = build_model(config, state, layer_spec=moe_layer_spec())
    losses = _train(model, state, 5, lr=0.2)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    table = global_named_buffers([model], config, state)["decoder.layers.0.mlp.experts.fp8_state.fp8_scale"]
    assert table.shape == (4, 2, 3) and (table != 1).any()


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_weight_grad_waits_for_the_zero_bubble_weight_pass(recipe):
    from megatron_core.tensor_parallel.weight_grad_store import WeightGradStore
    store = WeightGradStore()
    layer = ColumnParallelLinear(24, 40, fp8=Fp8Config(fp8_recipe=recipe), weight_grad_store=store)
    x, dy = torch.randn(6, 24), torch.randn(6, 40)
    _, expected_dx, expected_dw, _ = _run_layer(layer, x, dy)
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    with store.schedule():
        with store.deferrable_forward():
            out, _ = layer(x)
        with store.backward_pass():
            out.backward(dy)
        assert layer.weight.grad is None and torch.equal(x.grad, expected_dx)
        store.run_weight_pass()
    assert torch.equal(layer.weight.grad, expected_dw)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_compiled_layer_matches_eager(recipe):
    """Under torch.compile (``--compile``'s layers): per-tensor recipes are traced, block recipes run eager."""
    layer = RowParallelLinear(40, 24, fp8=Fp8Config(fp8_recipe=recipe))
    x, dy = torch.randn(6, 40), torch.randn(6, 24)
    expected = _run_layer(layer, x, dy)
    layer.zero_grad()
    compiled = _run_layer(torch.compile(layer), x, dy)
    for mine, ref in zip(compiled, expected):
        if ref is not None:
            torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)
