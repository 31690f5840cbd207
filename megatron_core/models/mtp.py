"""Multi-token prediction (DeepSeek-V3; Megatron-LM's ``--mtp-num-layers N --mtp-loss-scaling-factor F``).

On the last pipeline stage, after the main decoder, N sequential modules each predict one token further ahead.
Module k (1..N) takes ``h^{k-1}`` (``h^0``: the decoder's output after its final norm, as Megatron-LM feeds it)
and the embedding of the token k positions ahead, and computes

    h^k = final_layernorm(transformer_layer(eh_proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)])))

(embedding first in the concatenation, as Megatron's ``_concat_embeddings`` and the hub's ``eh_proj`` weights),
then the shared output head and the vocab-parallel cross entropy against the labels shifted by k (position i
predicts token ``i + k + 1``). The last k positions of each sequence have no target: their loss mask is zero.
The transformer layer is the model's own layer spec (MLA / MoE when the spec has them), numbered
``num_layers + k`` and seeded like a decoder layer of that number, so its initialization is layout-independent.
The embedding of the tokens ahead uses their own positions (Megatron-LM shifts position_ids with the ids); the
layer's rotary angles are the main model's (position i). MTP runs only in training mode with labels: evaluation
(Megatron-LM computes it there but does not log it), logits and generation see the main model alone.

Loss: depth k's per-token loss is averaged with its shifted loss mask exactly as ``training.loop.forward_step``
averages the main loss (with context parallelism: the token count summed over cp, times cp). The sum over the
depths times ``F / N`` enters backward through ``attach_loss`` with the schedule's scale of the main loss
(``set_mtp_loss_scale``: ``1 / num_microbatches`` times the fp16 loss scale); the main per-token loss the model
returns is unchanged. Each depth's loss is recorded for the log (``mtp_loss_report``: ``mtp_<k>_loss``).

Parameter names (Megatron-LM's): ``mtp.layers.<k-1>.enorm.weight``, ``.hnorm.weight``, ``.eh_proj.weight``,
``.transformer_layer.*``, ``.final_layernorm.weight``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.context_parallel import split_sequence, to_natural_order
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    checkpoint,
    gather_from_tensor_model_parallel_region,
    init_method_normal,
    scatter_to_sequence_parallel_region,
)
from megatron_core.transformer.block import LAYER_SEED_OFFSET, seeded_init
from megatron_core.transformer.compile import compile_layer
from megatron_core.transformer.spec import TransformerLayerSpec

MTP_PROJ_SEED_OFFSET = 500
"""eh_proj of depth k draws its weight from ``base_seed + 500 + k`` (layers use 1000 + n, embeddings < 3)."""


class ShiftedSequences:
    """Token ids, positions, labels and loss mask ``[b, s_local]`` shifted left by k along the *global* sequence:
    position i takes the values of position ``i + k``; the last k positions of each sequence get zeros (so their
    loss mask is 0). With context parallelism (this rank holding the load-balanced chunks of the sequence) the
    four tensors are all-gathered over cp once (no gradient), shifted in natural order and cut back to this
    rank's chunks; without it nothing is communicated."""

    def __init__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                 loss_mask: torch.Tensor, state: ParallelState) -> None:
        self.cp_size, self.cp_rank = state.cp_size, state.cp_rank
        stacked = torch.stack([input_ids.double(), position_ids.double(), labels.double(), loss_mask.double()])
        if self.cp_size > 1:  # [4, b, s/cp] -> [4, b, s], natural order
            pieces = [torch.empty_like(stacked) for _ in range(self.cp_size)]
            dist.all_gather(pieces, stacked.contiguous(), group=state.cp_group)
            stacked = to_natural_order(torch.cat(pieces, dim=-1), dim=-1, cp_size=self.cp_size)
        self.full = stacked  # [4, b, s], float64 (ids are exact below 2**53)
        self.loss_mask_dtype = loss_mask.dtype

    def at(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, position_ids, labels, loss_mask)`` of this rank, shifted by k (ids as int64)."""
        shifted = torch.zeros_like(self.full)
        if k < self.full.shape[-1]:
            shifted[..., : self.full.shape[-1] - k] = self.full[..., k:]
        local = split_sequence(shifted, dim=-1, cp_size=self.cp_size, cp_rank=self.cp_rank)
        ids, positions, labels, mask = local.unbind(0)
        return ids.long(), positions.long(), labels.long(), mask.to(self.loss_mask_dtype)


def _mtp_layer_spec(config: TransformerConfig, spec: TransformerLayerSpec) -> TransformerLayerSpec:
    """The decoder's spec, except that the MLP is of the kind of the *last* decoder layer (Megatron builds the
    MTP layer from the last layer's spec): ``moe_layer_freq`` has no entry for layer ``num_layers + k``."""
    from megatron_core.transformer.mlp import MLP
    from megatron_core.transformer.moe.moe_layer import MoELayer, moe_or_dense_mlp
    if spec.mlp is not moe_or_dense_mlp:
        return spec
    moe_like_last = config.moe is not None and config.moe.is_moe_layer(config.num_layers, config.num_layers)
    return dataclasses.replace(spec, mlp=MoELayer if moe_like_last else MLP)


def _check_config(config: TransformerConfig) -> None:
    if isinstance(getattr(config, "window_attn_skip_freq", None), (list, tuple)) and config.window_size:
        raise ValueError(f"mtp_num_layers {config.mtp_num_layers} with a per-layer window_attn_skip_freq list "
                         "is not supported (the list has no entry for the MTP layers): use an integer "
                         "window_attn_skip_freq or drop multi-token prediction")


class MultiTokenPredictionLayer(nn.Module):
    """Depth k of multi-token prediction.

    forward: ``hidden`` ``h^{k-1}`` and ``embedded`` (the embedding of the tokens k ahead), both ``[s, b, h]``
    (``[s/tp, b, h]`` with sequence parallelism) -> ``h^k`` of the same shape.

    eh_proj ``[2h -> h]`` is column-parallel (its weight ``[h/tp, 2h]`` per rank, as Megatron-LM splits it).
    Communication, with sequence parallelism: forward all-gathers the ``[s/tp, b, 2h]`` input along s, all-gathers
    the ``[s, b, h/tp]`` output along h and keeps this rank's ``[s/tp, b, h]`` (a split); backward all-gathers
    that gradient along s, splits it along h and reduce-scatters the input gradient along s. Without sequence
    parallelism: forward all-gathers the output along h, backward all-reduces the input gradient. Then the
    transformer layer's own collectives.
    """

    def __init__(self, config: TransformerConfig, *, depth: int, parallel_state: ParallelState,
                 spec: TransformerLayerSpec, base_seed: int) -> None:
        super().__init__()
        self.config, self.depth = config, depth
        self.tp_group, self.rng_tracker = parallel_state.tp_group, parallel_state.rng_tracker
        device, backend = parallel_state.device, parallel_state.kernel_backend
        self.enorm = spec.final_norm(config, config.hidden_size, device=device, kernel_backend=backend)
        self.hnorm = spec.final_norm(config, config.hidden_size, device=device, kernel_backend=backend)
        with seeded_init(base_seed, MTP_PROJ_SEED_OFFSET + depth):
            self.eh_proj = ColumnParallelLinear(
                2 * config.hidden_size, config.hidden_size, tp_group=parallel_state.tp_group, bias=False,
                sequence_parallel=config.sequence_parallel, tp_comm_overlap=config.tp_comm_overlap,
                params_dtype=config.params_dtype, device=device,
                init_method=init_method_normal(config.init_method_std),
                weight_grad_store=parallel_state.weight_grad_store)
        number = config.num_layers + depth  # global, 1-based; no decoder layer has it
        with seeded_init(base_seed, LAYER_SEED_OFFSET + number):
            self.transformer_layer = spec.layer(config, layer_number=number, parallel_state=parallel_state,
                                                spec=spec)
        if config.compile:
            compile_layer(self.transformer_layer)
        self.final_layernorm = spec.final_norm(config, config.hidden_size, device=device, kernel_backend=backend)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.training and self.config.recompute_granularity == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, hidden, embedded, attention_mask, rotary_pos_emb,
                              rng_tracker=self.rng_tracker)
        return self._forward(hidden, embedded, attention_mask, rotary_pos_emb)

    def _forward(self, hidden, embedded, attention_mask, rotary_pos_emb) -> torch.Tensor:
        combined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)  # [s(/tp), b, 2h]
        projected, _ = self.eh_proj(combined)  # [s, b, h/tp]
        projected = gather_from_tensor_model_parallel_region(projected, self.tp_group)  # [s, b, h]
        if self.config.sequence_parallel:
            projected = scatter_to_sequence_parallel_region(projected, self.tp_group)  # [s/tp, b, h]
        hidden = self.transformer_layer(projected, attention_mask, rotary_pos_emb)
        return self.final_layernorm(hidden)


class MultiTokenPrediction(nn.Module):
    """The N depths of multi-token prediction (``config.mtp_num_layers``), on the last pipeline stage.

    ``loss_scale`` (default 1: a plain ``backward()`` of the main loss's mean) is the gradient the MTP loss gets
    in backward, set per step by ``set_mtp_loss_scale``; ``tokens_scale`` (``--calculate-per-token-loss``)
    replaces the loss-mask average by the token sum times it, as ``forward_step`` does for the main loss.
    """

    def __init__(self, config: TransformerConfig, *, parallel_state: ParallelState, spec: TransformerLayerSpec,
                 base_seed: int) -> None:
        super().__init__()
        _check_config(config)
        self.config, self.state = config, parallel_state  # its groups (the device may be meta at build time)
        mtp_spec = _mtp_layer_spec(config, spec)
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(config, depth=k, parallel_state=parallel_state, spec=mtp_spec,
                                      base_seed=base_seed) for k in range(1, config.mtp_num_layers + 1))
        self.loss_scale: float = 1.0
        self.tokens_scale: Optional[float] = None
        self.loss_sums: Optional[torch.Tensor] = None  # [N] float64, summed over the step's micro-batches
        self.loss_count = 0

    def forward(self, hidden: torch.Tensor, *, input_ids: torch.Tensor, position_ids: torch.Tensor,
                labels: torch.Tensor, loss_mask: torch.Tensor, embedding: nn.Module,
                per_token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden`` ``[s(/tp), b, h]``: the decoder's output; ids, positions, labels and loss mask ``[b, s]``
        (this cp rank's); ``embedding(ids, positions)`` the model's embedding; ``per_token_loss(hidden,
        labels)`` the shared output head and cross entropy ``-> [b, s]``. Returns the scalar
        ``F / N * sum_k loss_k`` (each depth's loss-mask average) and records each loss_k for the log.
        Collective with cp > 1: an all-gather over cp of the ids (``ShiftedSequences``) and an all-reduce of
        each depth's token count, besides the modules' own tp / cp collectives."""
        shifted = ShiftedSequences(input_ids, position_ids, labels, loss_mask, self.state)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        values = []
        for k, layer in enumerate(self.layers, start=1):
            ids, positions, labels_k, mask_k = shifted.at(k)
            hidden = layer(hidden, embedding(ids, positions), attention_mask, rotary_pos_emb)
            value = self._average(per_token_loss(hidden, labels_k), mask_k)
            values.append(value.detach())
            total = total + value
        if self.training:
            step = torch.stack(values).double()
            self.loss_sums = step if self.loss_sums is None else self.loss_sums + step
            self.loss_count += 1
        return total * (self.config.mtp_loss_scaling_factor / self.config.mtp_num_layers)

    def _average(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``sum(loss * mask) / sum(mask)`` as the main loss: with cp the count is summed over the cp ranks
        (all-reduce, no gradient) and the result multiplied by cp. With ``tokens_scale`` (the main loss's
        factor of ``--calculate-per-token-loss``) the sum times it: each depth's token sum over the global batch
        divided by the main loss's token count (k tokens per sequence more than the depth's own count)."""
        total = (per_token.float() * mask).sum()
        if self.tokens_scale is not None:
            return total * self.tokens_scale
        count, cp = mask.sum(), self.state.cp_size
        if cp > 1:
            count = count.detach().clone()
            dist.all_reduce(count, group=self.state.cp_group)
        return total * cp / count.clamp(min=1)


def mtp_modules(chunks: Sequence[nn.Module]) -> list[MultiTokenPrediction]:
    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, MultiTokenPrediction)]


def set_mtp_loss_scale(chunks: Sequence[nn.Module], scale: float, tokens_scale: Optional[float] = None) -> None:
    """The gradient the MTP loss gets in backward: the schedule's scale of the main loss (``1 /
    num_microbatches`` times the fp16 loss scale); ``tokens_scale``: ``--calculate-per-token-loss``'s factor."""
    for module in mtp_modules(chunks):
        module.loss_scale = float(scale)
        module.tokens_scale = tokens_scale


def _all_reduce(value: torch.Tensor, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)


def mtp_loss_report(chunks: Sequence[nn.Module], state: ParallelState, num_depths: int) -> dict:
    """``{"mtp_1_loss": x, ...}``: each depth's loss averaged over the step's micro-batches (last stage), over
    the cp ranks (each holds its share of the sequence's average) and over dp, as the lm loss; resets the sums.
    Every rank must call it. Collective: all-reduces of ``[num_depths]`` over cp, pp and dp."""
    table = torch.zeros(num_depths, dtype=torch.float64, device=state.device)
    for module in mtp_modules(chunks):
        if module.loss_count:
            table += module.loss_sums.to(table) / module.loss_count
        module.loss_sums, module.loss_count = None, 0
    _all_reduce(table, state.cp_group)
    _all_reduce(table, state.pp_group)  # only the last stage holds MTP
    _all_reduce(table, state.dp_group)
    table /= state.cp_size * state.dp_size
    return {f"mtp_{k}_loss": float(table[k - 1]) for k in range(1, num_depths + 1)}


def mtp_log_fields(record: dict) -> str:
    """The log line's `` mtp_1 loss: x | ...`` part (empty without MTP)."""
    fields, k = [], 1
    while f"mtp_{k}_loss" in record:
        fields.append(f" mtp_{k} loss: {record[f'mtp_{k}_loss']:.6E} |")
        k += 1
    return "".join(fields)


__all__ = ["MultiTokenPrediction", "MultiTokenPredictionLayer", "ShiftedSequences", "set_mtp_loss_scale",
           "mtp_loss_report", "mtp_log_fields", "mtp_modules"]
