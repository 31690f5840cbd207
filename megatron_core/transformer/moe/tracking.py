"""Step-level MoE bookkeeping for a training loop: the aux-loss gradient scale, the logged MoE losses, and the
aux-loss-free expert-bias update. Each function takes the model chunks (plain or wrapped) of this rank."""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.parallel_state import ParallelState
from megatron_core.transformer.moe.router import TopKRouter, token_split_group

LOSS_NAMES = ("load_balancing_loss", "z_loss")


def routers(chunks: Sequence[nn.Module]) -> Iterator[TopKRouter]:
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                yield module


def set_aux_loss_scale(chunks: Sequence[nn.Module], scale: float) -> None:
    """The gradient the aux and z losses get in backward: the schedule's scale of the language-model loss
    (``1 / num_microbatches``, times the fp16 loss scale)."""
    for router in routers(chunks):
        router.aux_loss_scale = float(scale)


def _all_reduce(value: torch.Tensor, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)


def moe_loss_report(chunks: Sequence[nn.Module], state: ParallelState, *, num_layers: int,
                    sequence_parallel: bool, per_layer: bool = False) -> dict:
    """The step's MoE losses (without their coefficients), averaged over micro-batches, dp replicas and MoE
    layers: ``{"load_balancing_loss": x, "z_loss": y}`` (plus ``"<name>_layer_<n>"`` with ``per_layer``);
    empty without MoE layers. Resets the routers' sums. Every rank must call it. Collective: all-reduces
    over the ranks splitting the sequence (tp x cp with sequence parallelism, cp without: each holds a
    partial sum), pp and dp.
    """
    table = torch.zeros(len(LOSS_NAMES) + 1, num_layers, dtype=torch.float64, device=state.device)
    for router in routers(chunks):
        column = router.layer_number - 1
        table[-1, column] = 1.0  # an MoE layer
        for i, name in enumerate(LOSS_NAMES):
            if name in router.loss_sums and router.loss_count:
                table[i, column] = float(router.loss_sums[name]) / router.loss_count
        router.reset_loss_sums()
    _all_reduce(table[:-1], token_split_group(state, sequence_parallel=sequence_parallel))
    _all_reduce(table, state.pp_group)
    _all_reduce(table[:-1], state.dp_group)
    table[:-1] /= state.dp_size
    layers = [n for n, is_moe in enumerate(table[-1].tolist()) if is_moe]  # not nonzero(): no size in a dry run
    if not layers:
        return {}
    report = {name: float(table[i, layers].mean()) for i, name in enumerate(LOSS_NAMES)}
    if per_layer:
        for i, name in enumerate(LOSS_NAMES):
            report.update({f"{name}_layer_{n + 1}": float(table[i, n]) for n in layers})
    return report


@torch.no_grad()
def reset_global_counts(chunks: Sequence[nn.Module]) -> None:
    """Starts the next optimizer step's ``global_aux_loss`` counts (no collective)."""
    for router in routers(chunks):
        router.global_counts.reset()


def update_expert_bias(chunks: Sequence[nn.Module], state: ParallelState) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): ``bias += rate * sign(mean_count - count)`` per expert from the
    step's token counts over every rank of the stage; the counts are then zeroed. Collective: all-reduces of
    the counts over tp and dp (every rank of a stage must call it)."""
    for router in routers(chunks):
        if router.expert_bias is None:
            continue
        counts = router.local_tokens_per_expert.clone()
        _all_reduce(counts, state.tp_group)
        _all_reduce(counts, state.dp_cp_group)
        offset = counts.mean() - counts
        router.expert_bias += torch.sign(offset) * router.moe.moe_router_bias_update_rate
        router.local_tokens_per_expert.zero_()
