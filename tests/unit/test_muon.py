"""Muon (``--optimizer muon``) against megatron-core's own ``TensorParallelMuon`` on Emerging-Optimizers:
Newton-Schulz of every coefficient set and precision bit-equal, and the tiny GPT (GQA, QKV split) trained by
our optimizer equal to Megatron's Muon on the matrices plus torch's AdamW on the rest, step by step."""
import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.optimizer import OptimizerConfig, get_optimizer
from megatron_core.optimizer.muon import COEFFICIENTS, newton_schulz
from tests import megatron_muon
from tests.model_helpers import build_model, make_batch, tiny_config

STEPS = 3
GQA = dict(num_query_groups=2)  # 4 heads in 2 groups: q rows 2 x kv_channels per group, k and v 1 each


@pytest.mark.parametrize("coefficient_type", sorted(COEFFICIENTS))
@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("shape", [(24, 16), (16, 40)])
def test_newton_schulz_equals_emerging_optimizers(coefficient_type, bf16, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    steps = 8 if coefficient_type == "polar_express" else 5
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium" if bf16 else "highest")
        reference = megatron_muon.newton_schulz(x, steps, coefficient_type)
    finally:
        torch.set_float32_matmul_precision(previous)
    ours = newton_schulz(x, steps=steps, coefficient_type=coefficient_type, bf16=bf16)
    assert torch.equal(ours, reference)
    singular = torch.linalg.svdvals(ours)  # nearly orthogonal: singular values near 1 (NS's noisy band)
    assert 0.3 < singular.min() and singular.max() < 1.6


def _muon_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n and "output_layer" not in n}


def _loss(model, step):
    input_ids, positions, labels = make_batch(seed=step)
    return model(input_ids, positions, labels=labels).mean()


def _reference(model, *, lr, weight_decay, momentum, nesterov, scale_mode, split_qkv, prec):
    """Megatron's TensorParallelMuon over the weight matrices, torch's fused AdamW over the rest."""
    muon_names = _muon_names(model)
    params = dict(model.named_parameters())
    for name in muon_names:
        params[name].is_qkv = name.endswith("linear_qkv.weight")
    config = model.config
    kv = config.kv_channels
    qkv = (config.num_attention_heads // config.num_query_groups * kv, kv, kv) if split_qkv else None
    muon = megatron_muon.tensor_parallel_muon(
        [params[n] for n in sorted(muon_names)], qkv_split_shapes=qkv, lr=lr, momentum_beta=momentum,
        use_nesterov=nesterov, weight_decay=weight_decay, scale_mode=scale_mode, fp32_matmul_prec=prec,
        mode="blockwise")  # one process: every matrix whole (its tp attributes name no group)
    rest = [p for n, p in params.items() if n not in muon_names]
    adam = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}], lr=lr, fused=True)
    for step in range(STEPS):
        model.zero_grad()
        _loss(model, step).backward()
        adam.step()
        muon.step()
    return {n: p.detach().clone() for n, p in params.items()}


@pytest.mark.parametrize("nesterov,scale_mode,split_qkv,prec", [
    (False, "spectral", True, "medium"), (True, "unit_rms_norm", False, "high"), (True, "shape_scaling", True, "high")])
def test_tiny_gpt_equals_megatron_muon_plus_adamw(nesterov, scale_mode, split_qkv, prec):
    settings = dict(lr=1e-2, weight_decay=0.1, momentum=0.8, nesterov=nesterov, scale_mode=scale_mode,
                    split_qkv=split_qkv, prec=prec)
    state = initialize_model_parallel()
    reference = _reference(build_model(tiny_config(**GQA), state), **settings)
    model = build_model(tiny_config(**GQA), state)
    optimizer = get_optimizer(OptimizerConfig(
        optimizer="muon", lr=1e-2, weight_decay=0.1, clip_grad=0.0, muon_momentum=0.8, muon_use_nesterov=nesterov,
        muon_scale_mode=scale_mode, muon_split_qkv=split_qkv, muon_fp32_matmul_prec=prec), model)
    matrices = {id(piece.param) for piece in optimizer.pieces if piece.master in optimizer.optimizer.matrices}
    assert {n for n, p in model.named_parameters() if id(p) in matrices} == _muon_names(model)
    for step in range(STEPS):
        optimizer.zero_grad()
        _loss(model, step).backward()
        assert optimizer.step()[0]
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), reference[name], rtol=0, atol=1e-7, msg=name)
    states = optimizer.optimizer.state
    assert all(set(states[m]) == {"momentum_buffer"} for m in optimizer.optimizer.matrices)


@pytest.mark.parametrize("overrides,message", [
    (dict(muon_tp_mode="rowwise"), "muon_tp_mode 'rowwise' is not one of"),
    (dict(muon_coefficient_type="cubic"), "muon_coefficient_type 'cubic' is not one of"),
    (dict(muon_num_ns_steps=0), "muon_num_ns_steps 0 must be >= 1"),
    (dict(muon_momentum=1.0), "muon_momentum 1.0 must be in [0, 1)"),
    (dict(optimizer_cpu_offload=True), "optimizer='muon' with optimizer_cpu_offload")])
def test_bad_muon_settings_name_the_value(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        OptimizerConfig(optimizer="muon", **overrides)


def test_dist_muon_flag_shards_the_states():
    from megatron_core.training.arguments import parse_args
    args = parse_args(["--optimizer", "dist_muon", "--muon-tp-mode", "distributed", "--muon-nesterov"])
    assert args.optimizer == "muon" and args.zero_stage == 1 and args.muon_tp_mode == "distributed"
    assert args.muon_nesterov and args.muon_split_qkv and args.muon_momentum == 0.9
