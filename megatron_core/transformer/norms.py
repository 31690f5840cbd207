"""LayerNorm and RMSNorm over the hidden dim, running the fused kernels of ``kernels`` (fp32 statistics).

Each norm runs its op through the ``kernels.KernelBackend`` it was built with (the layout's
``ParallelState.kernel_backend``; a fresh "auto" one when none is given). Their parameters are replicated over tp. Under
sequence parallelism each tp rank normalizes its own chunk of
the sequence, so the weight grads are partial sums: the parameters carry ``sequence_parallel = True`` and
``finalize_model_grads`` all-reduces them over tp.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import kernels
from megatron_core.config import TransformerConfig
from megatron_core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron_core.tensor_parallel.initialization import InitRecipe, init_method_constant


def _replicated(tensor: torch.Tensor, config: TransformerConfig, value: float) -> nn.Parameter:
    param = nn.Parameter(tensor)
    param.init_recipe = InitRecipe(0, init_method_constant(value), tuple(tensor.shape))
    set_tensor_model_parallel_attributes(param, is_parallel=False, dim=-1, stride=1)
    param.sequence_parallel = config.sequence_parallel
    return param


def _gamma(config: TransformerConfig, hidden_size: int, device) -> nn.Parameter:
    """The scale: ones, or zeros applied as ``1 + weight`` with ``layernorm_zero_centered_gamma``."""
    value = 0.0 if config.layernorm_zero_centered_gamma else 1.0
    return _replicated(torch.full((hidden_size,), value, dtype=config.params_dtype, device=device), config, value)


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim; ``[..., h] -> [..., h]``.
    With ``layernorm_zero_centered_gamma`` the scale is ``1 + weight`` (Megatron's ``--apply-layernorm-1p``)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, *, device=None,
                 kernel_backend: Optional[kernels.KernelBackend] = None) -> None:
        super().__init__()
        self.eps, self.zero_centered = config.layernorm_epsilon, config.layernorm_zero_centered_gamma
        self.kernel_backend = kernel_backend
        self.weight = _gamma(config, hidden_size, device)
        self.bias = _replicated(torch.zeros(hidden_size, dtype=config.params_dtype, device=device), config, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        return kernels.layer_norm(x, weight, self.bias, self.eps, backend=self.kernel_backend)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim; ``[..., h] -> [..., h]`` (scale ``1 + weight``
    with ``layernorm_zero_centered_gamma``)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, *, device=None,
                 kernel_backend: Optional[kernels.KernelBackend] = None) -> None:
        super().__init__()
        self.eps, self.zero_centered = config.layernorm_epsilon, config.layernorm_zero_centered_gamma
        self.kernel_backend = kernel_backend
        self.weight = _gamma(config, hidden_size, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        return kernels.rms_norm(x, weight, self.eps, backend=self.kernel_backend)


def Norm(config: TransformerConfig, hidden_size: int, *, device=None,  # noqa: N802 - a class factory
         kernel_backend: Optional[kernels.KernelBackend] = None) -> nn.Module:
    """The norm named by ``config.normalization`` (the default norm of a layer spec)."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(config, hidden_size, device=device, kernel_backend=kernel_backend)
