"""The in-memory Adam kernel (``OptimizerConfig.fused_adam``) and the grad-norm reduction: the fused kernel
stays within fp32 rounding of ``torch.optim.AdamW``, the per-op update equals it bit for bit, and the norm
(one fp32 dot per tensor, summed in fp64) matches the fp64 norm to ~1e-7."""
import math

import pytest
import torch
from torch import nn

from megatron_core.optimizer import OptimizerConfig, get_optimizer
from megatron_core.optimizer.clip_grads import global_norm_and_zeros

OPT = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.0)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _train(step_fn, model: nn.Module, zero) -> dict[str, torch.Tensor]:
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        zero()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        step_fn()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference() -> dict[str, torch.Tensor]:
    model = _net()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    adam = torch.optim.AdamW([{"params": decay, "weight_decay": OPT["weight_decay"]},
                              {"params": rest, "weight_decay": 0.0}], lr=OPT["lr"])
    return _train(adam.step, model, adam.zero_grad)


@pytest.mark.parametrize("fused", [True, False])
def test_in_memory_adam_kernel(fused):
    model = _net()
    optimizer = get_optimizer(OptimizerConfig(**OPT, fused_adam=fused), model, parallel_state=None)
    assert bool(optimizer.optimizer.defaults["fused"]) is fused
    params, reference = _train(optimizer.step, model, optimizer.zero_grad), _reference()
    for name, value in reference.items():
        if fused:  # the fused kernel orders its arithmetic differently
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6)
        else:
            assert torch.equal(params[name], value), name


def test_grad_norm_matches_fp64():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) for n in (300_000, 70_000, 33)] + [torch.zeros(5)]
    exact = math.sqrt(sum(float(t.double().square().sum()) for t in grads))
    norm, zeros = global_norm_and_zeros([(t, False) for t in grads], dp_group=None, mp_group=None,
                                        device=torch.device("cpu"), count_zeros=True)
    assert abs(norm - exact) / exact < 1e-6 and zeros == 5
