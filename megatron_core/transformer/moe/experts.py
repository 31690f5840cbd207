"""The routed experts of one MoE layer that live on this rank: ``num_moe_experts / ep`` MLPs.

Each expert is ``fc2(act(fc1(x)))`` with fc1 ``[h -> f]`` (``[h -> 2f]`` for the gated SwiGLU and quick GeGLU,
``[gate; up]``, its bias ``[gate_bias; up_bias]`` alike) and fc2 ``[f -> h]``, f = ``moe_ffn_hidden_size``; the
activation is ``mlp.mlp_activation`` with the config's clamp and linear offset (gpt-oss). With expert tensor
parallelism (etp > 1, over ``ParallelState.etp_group``, which need not be the tp group) each rank holds the
``[f'/etp, h]`` rows of fc1 (column-parallel, stride 2 when gated: the gate and up halves, and their biases,
each split) and the ``[h, f/etp]`` columns of fc2 (row-parallel): its output is a partial sum over the etp
group. The fc2 bias ``[h]`` is replicated over etp and added on etp rank 0 only (in value: the other ranks add
``bias - bias.detach()``, zero, whose gradient is still the identity). Every etp rank runs the same tokens (the
MoE layer gathers them over etp), so each computes the bias's complete gradient over them: no reduction over
etp (nor tp) is needed, and the grad is then reduced over expert-dp like the others.
Parameters are named by *global* expert id (``local_experts.<id>.linear_fc1.weight``), so checkpoints hold
every expert under one name at any expert-parallel size, and carry ``is_expert = True`` / ``allreduce =
False``: their gradients are reduced over the expert-data-parallel group, not dp.

Initialization is layout-independent: expert e is drawn from ``expert_seeds[e]``, and the layer draws the
seeds of all experts on every rank.

FP8 (``megatron_core.fp8``): with an ``Fp8Config`` the experts' fc1 / fc2 GEMMs (loop and grouped) run in FP8
with per-expert scales; under the delayed recipe ``fp8_state`` holds the table of every global expert
(``[num_moe_experts, 2 (fc1, fc2), 3 roles]``), each rank filling its own experts' rows, made whole and
identical on every rank by ``update_fp8_scales``. With ``fp8_param_gather`` each expert's fc1 / fc2 weight is
tagged for the FP8 ZeRO gather (``fp8.param_gather.tag_weight``: its own scale, its row of the delayed table,
the etp group as amax group when split; blockwise: its block scales); the GEMMs quantize it with the gathered
scale(s) (the grouped GEMM: the stacked per-expert scales, ``fp8.param_gather.gathered_experts``).
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from megatron_core.config import TransformerConfig
from megatron_core.fp8.config import Fp8Config, layer_fp8
from megatron_core.fp8.linear import fp8_linear, layer_plan, scaling_state
from megatron_core.fp8.param_gather import gathered_experts, tag_weight
from megatron_core.tensor_parallel import (
    init_method_normal,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
)
from megatron_core.tensor_parallel.initialization import InitMethod, InitRecipe, init_method_constant, init_param_
from megatron_core.tensor_parallel.utils import group_size
from megatron_core.transformer.mlp import GATED_ACTIVATIONS, activation_options, mlp_activation


def tag_expert(param: nn.Parameter, *, partition_dim: int = -1, stride: int = 1) -> nn.Parameter:
    """Marks an expert parameter: replicated only over the expert-data-parallel group (and, when not split
    over etp along ``partition_dim``, over the etp group)."""
    set_tensor_model_parallel_attributes(param, is_parallel=partition_dim >= 0, dim=partition_dim, stride=stride)
    param.is_expert, param.allreduce = True, False
    return param


class ExpertLinear(nn.Module):
    """``y = x W^T + b`` for one expert; W ``[out, in]`` full, or split over etp along ``partition_dim`` (0:
    rows, the bias split alike; 1: columns, the bias replicated over etp)."""

    def __init__(self, in_size: int, out_size: int, *, bias: bool, init_method: InitMethod,
                 dtype: torch.dtype, device, partition_dim: int = -1, stride: int = 1, etp_rank: int = 0,
                 etp_size: int = 1) -> None:
        super().__init__()
        split = partition_dim if etp_size > 1 else -1
        local = [out_size, in_size]
        if split >= 0:
            local[split] //= etp_size
        self.weight = nn.Parameter(torch.empty(*local, dtype=dtype, device=device))
        init_param_(self.weight, (out_size, in_size), init_method=init_method, partition_dim=split, stride=stride,
                    tp_rank=etp_rank, tp_size=etp_size)
        tag_expert(self.weight, partition_dim=split, stride=stride)
        self.bias = None
        if bias:
            bias_split = 0 if split == 0 else -1
            self.bias = nn.Parameter(torch.zeros(local[0], dtype=dtype, device=device))
            self.bias.init_recipe = InitRecipe(0, init_method_constant(0.0), (out_size,), bias_split, stride,
                                               etp_rank, etp_size)
            tag_expert(self.bias, partition_dim=bias_split, stride=stride)


class Expert(nn.Module):
    def __init__(self, config: TransformerConfig, ffn: int, *, device, etp_rank: int = 0, etp_size: int = 1) -> None:
        super().__init__()
        gated = config.activation in GATED_ACTIVATIONS
        common = dict(bias=config.add_bias_linear, dtype=config.params_dtype, device=device, etp_rank=etp_rank,
                      etp_size=etp_size)
        self.linear_fc1 = ExpertLinear(config.hidden_size, 2 * ffn if gated else ffn,
                                       init_method=init_method_normal(config.init_method_std), partition_dim=0,
                                       stride=2 if gated else 1, **common)
        self.linear_fc2 = ExpertLinear(ffn, config.hidden_size,
                                       init_method=scaled_init_method_normal(config.init_method_std,
                                                                             config.num_layers), partition_dim=1,
                                       **common)


def moe_layers_fp8(config: TransformerConfig) -> Optional[Fp8Config]:
    """The FP8 config of the routed experts when the caller names no layer: ``config.fp8`` when every MoE layer
    of the config runs in FP8 (always without ``first_last_layers_bf16``), None when none does; when only
    some do, None (high precision) with a warning: pass ``layer_number=`` (or ``fp8=``) to ``LocalExperts``."""
    fp8 = getattr(config, "fp8", None)
    if fp8 is None or not fp8.first_last_layers_bf16:
        return fp8
    numbers = [n for n in range(1, config.num_layers + 1) if config.moe.is_moe_layer(n, config.num_layers)]
    in_fp8 = {layer_fp8(config, n) is not None for n in numbers}
    if in_fp8 == {True}:
        return fp8
    if True in in_fp8:
        warnings.warn("LocalExperts built without layer_number while first_last_layers_bf16 keeps only some MoE "
                      "layers in FP8: these experts run in high precision; pass layer_number= to LocalExperts")
    return None


class LocalExperts(nn.Module):
    """This rank's experts ``expert_ids`` (consecutive global ids).

    Args:
        config: the model's config (``config.moe.moe_ffn_hidden_size``, default ``ffn_hidden_size``).
        expert_ids: the global ids held here.
        expert_seeds: one init seed per global expert (all of them).
        device: of the parameters.
        etp_rank, etp_size: this rank's part of each expert (expert tensor parallelism; 1 = whole experts).
        layer_number: the MoE layer's global number: FP8 is ``layer_fp8(config, layer_number)``; without it (and
            without ``fp8``) ``moe_layers_fp8(config)``.
        fp8: the FP8 config of these experts (overrides layer_number); None with a layer_number that
            ``layer_fp8`` keeps in high precision.
        etp_group: the expert tensor-parallel group (etp_size > 1): the tensorwise recipe all-reduces the amaxes
            of the split tensors (fc1's weight and output grad, fc2's input and weight) with MAX over it.

    forward: tokens ``[N, h]`` sorted by local expert, ``tokens_per_expert`` (one count per local expert,
    summing to N) -> ``[N, h]``. No collective. With ``moe_grouped_gemm`` the experts run as two batched
    matmuls over their token groups padded to the largest group (``torch.bmm``); otherwise a loop.

    The forward reads the experts' weights itself (the ``ExpertLinear`` modules never run), so under ZeRO-3
    this module is one unit gathering every local expert (``gathers_all_parameters``), over expert-dp.
    """

    gathers_all_parameters = True

    def __init__(self, config: TransformerConfig, *, expert_ids: Sequence[int], expert_seeds: Sequence[int],
                 device, etp_rank: int = 0, etp_size: int = 1, layer_number: Optional[int] = None,
                 fp8: Optional[Fp8Config] = None, etp_group=None) -> None:
        super().__init__()
        moe = config.moe
        ffn = moe.moe_ffn_hidden_size or config.ffn_hidden_size
        self.expert_ids, self.grouped = list(expert_ids), moe.moe_grouped_gemm
        self.gated, self.activation_name = config.activation in GATED_ACTIVATIONS, config.activation
        self.activation_options = activation_options(config)
        experts = {}
        for expert_id in self.expert_ids:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(expert_seeds[expert_id])
                experts[str(expert_id)] = Expert(config, ffn, device=device, etp_rank=etp_rank, etp_size=etp_size)
        self.local_experts = nn.ModuleDict(experts)
        self.add_fc2_bias = etp_rank == 0  # the replicated fc2 bias goes into the etp partial sum once
        if fp8 is None:
            fp8 = layer_fp8(config, layer_number) if layer_number is not None else moe_layers_fp8(config)
        self.fp8, self.etp_group = fp8, etp_group
        self.fp8_state = scaling_state(fp8, device=device, shape=(moe.num_moe_experts, 2))
        self._tag_weights()

    def _tag_weights(self) -> None:
        """``--fp8-param-gather``: tags every local expert's fc1 / fc2 weight (``[f'/etp, h]`` / ``[h, f/etp]``)
        with its own per-expert scale: row ``(global id, fc)`` of the delayed table, amax MAX over etp_group when
        split (etp > 1), as ``_linear``'s plan (blockwise: per-block scales, no etp reduction). A no-op without
        FP8, the flag, or for mxfp8 (``fp8.param_gather.GATHERED_RECIPES``)."""
        amax_group = self.etp_group if group_size(self.etp_group) > 1 else None
        for expert_id, expert in zip(self.expert_ids, self.local_experts.values()):
            for fc, layer in enumerate((expert.linear_fc1, expert.linear_fc2)):
                tag_weight(layer.weight, self.fp8, self.fp8_state, amax_group=amax_group, index=(expert_id, fc))

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias, *, expert, fc: int,
                weights: Optional[list[nn.Parameter]] = None) -> torch.Tensor:
        """fc1 (``fc`` 0, column-split over etp) or fc2 (1, row-split) of ``expert`` (a global id, or an index
        tensor of them for the grouped GEMM's ``[E, n, in]``, whose stacked ``weight`` is of the parameters
        ``weights``); FP8 when configured. No collective but the tensorwise recipe's amax MAX over etp_group."""
        if self.fp8 is None:
            return F.linear(x, weight, bias)
        split = ("weight", "grad_output") if fc == 0 else ("input", "weight")
        plan = layer_plan(self.fp8, self.fp8_state, training=self.training, tp_group=self.etp_group,
                          split_roles=split, index=(expert, fc))
        gathered = None
        if weights is not None and self.fp8.fp8_param_gather:
            gathered = gathered_experts(weights, plan, self.expert_ids, fc)
        return fp8_linear(x, weight, bias, plan, gathered=gathered)

    def _fc2_bias(self, bias):
        """The fc2 bias on etp rank 0; elsewhere ``bias - bias.detach()``: zero in value (the partial outputs sum
        over etp to one bias), the identity in backward (every etp rank gets the bias's complete gradient over
        the etp group's tokens, which each of them runs)."""
        return bias if bias is None or self.add_fc2_bias else bias - bias.detach()

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., f/etp]`` (``[..., 2f/etp]`` when gated: this rank's ``[gate; up]``) -> ``[..., f/etp]``."""
        return mlp_activation(x, self.activation_name, **self.activation_options)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
        counts = [int(c) for c in tokens_per_expert]
        if len(counts) != len(self.expert_ids) or sum(counts) != tokens.shape[0]:
            raise ValueError(f"tokens_per_expert {counts} must have one count per local expert "
                             f"({len(self.expert_ids)}) summing to the {tokens.shape[0]} tokens")
        if self.grouped:
            return self._grouped(tokens, counts)
        outputs = []
        for expert_id, expert, chunk in zip(self.expert_ids, self.local_experts.values(), tokens.split(counts)):
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            hidden = self.activation(self._linear(chunk, fc1.weight, fc1.bias, expert=expert_id, fc=0))
            outputs.append(self._linear(hidden, fc2.weight, self._fc2_bias(fc2.bias), expert=expert_id, fc=1))
        return torch.cat(outputs) if outputs else tokens[:0]

    def _stacked(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None, list[nn.Parameter]]:
        """``[E_local, out, in]`` weights and ``[E_local, 1, out]`` biases of fc1 or fc2, and the weight
        parameters stacked."""
        layers = [getattr(e, name) for e in self.local_experts.values()]
        weight = torch.stack([layer.weight for layer in layers])
        bias = torch.stack([layer.bias for layer in layers])[:, None] if layers[0].bias is not None else None
        return weight, bias, [layer.weight for layer in layers]

    def _grouped(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if tokens.shape[0] == 0:
            return tokens[:0]
        padded = pad_sequence(list(tokens.split(counts)), batch_first=True)   # [E_local, max_n, h]
        w1, b1, params1 = self._stacked("linear_fc1")
        w2, b2, params2 = self._stacked("linear_fc2")
        if self.fp8 is not None:  # per-expert scales; the bias added in the GEMM's fp32 epilogue
            if self.fp8_state is not None:
                self.fp8_state.follow(tokens.device)
            ids = torch.tensor(self.expert_ids, device=tokens.device)
            hidden = self.activation(self._linear(padded, w1, b1, expert=ids, fc=0, weights=params1))
            return self._unpad(self._linear(hidden, w2, None if b2 is None else self._fc2_bias(b2), expert=ids,
                                            fc=1, weights=params2), counts)
        hidden = torch.bmm(padded, w1.transpose(1, 2))                          # [E_local, max_n, f(*2)]
        hidden = self.activation(hidden if b1 is None else hidden + b1)
        out = torch.bmm(hidden, w2.transpose(1, 2))                             # [E_local, max_n, h]
        out = out if b2 is None else out + self._fc2_bias(b2)
        return self._unpad(out, counts)                                         # [N, h], expert-major

    @staticmethod
    def _unpad(padded: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``[E_local, max_n, h]`` -> ``[N, h]``: each group's first ``counts[e]`` rows, expert-major. Slices by
        the host-side counts (a boolean-mask index would sync the device and has no size in a dry run)."""
        if all(n == padded.shape[1] for n in counts):
            return padded.flatten(0, 1)
        return torch.cat([padded[e, :n] for e, n in enumerate(counts)])
