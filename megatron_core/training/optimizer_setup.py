"""Data-parallel wrapping (ZeRO stage from the flags) and the optimizer of a training run."""
from __future__ import annotations

import argparse

import torch.distributed as dist
from torch import nn

from megatron_core.checkpointing.layout import unwrap
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_optimizer
from megatron_core.optimizer.offload import offload_parameters
from megatron_core.parallel_state import ParallelState
from megatron_core.training.arguments_muon import muon_config_kwargs


def ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The data-parallel config of the flags: ZeRO stage (--zero-stage, --data-parallel-sharding-strategy,
    --use-megatron-fsdp, --use-distributed-optimizer), --overlap-grad-reduce, and the grad dtype
    (--grad-reduce-in-bf16: reduce in the parameters' dtype; default and --accumulate-allreduce-grads-in-fp32:
    fp32), --overlap-param-gather (ZeRO 1-2; ZeRO-3 always prefetches its gathers)."""
    return DistributedDataParallelConfig(
        zero_stage=args.zero_stage, overlap_grad_reduce=args.overlap_grad_reduce,
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        overlap_param_gather=args.overlap_param_gather and args.zero_stage in (1, 2))


def wrap_data_parallel(args: argparse.Namespace, chunks: list[nn.Module], state: ParallelState) -> list[nn.Module]:
    """Each model chunk in DistributedDataParallel over the data(-and-context)-parallel group (expert
    parameters over the expert-data-parallel group); with --num-distributed-optimizer-instances N > 1, over this
    rank's instance of those groups, the grad shards all-reduced across the instances."""
    config = ddp_config(args)
    groups = dict(dp_group=state.dp_cp_group, expert_dp_group=state.expert_dp_group)
    if state.num_distributed_optimizer_instances > 1:
        groups = dict(dp_group=state.intra_dp_cp_group, expert_dp_group=state.intra_expert_dp_group,
                      inter_dist_opt_group=state.inter_dist_opt_group)
    wrapped = [DistributedDataParallel(chunk, config=config, **groups) for chunk in chunks]
    rank = dist.get_rank() if dist.is_initialized() else 0
    for chunk in wrapped:  # --param-offload (ZeRO-3): before the optimizer, which keeps views of the shards
        offload_parameters(chunk, args.param_offload, directory=args.param_nvme_offload_dir, rank=rank)
    return wrapped


def build_optimizer(args: argparse.Namespace, chunks: list[nn.Module], state: ParallelState):
    config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16,
        fp16=args.fp16, initial_loss_scale=args.initial_loss_scale, loss_scale=args.loss_scale,
        optimizer_cpu_offload=args.optimizer_cpu_offload, log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        optimizer_nvme_offload_dir=args.optimizer_nvme_offload_dir,
        optimizer_nvme_chunk_elements=args.optimizer_nvme_chunk_elements, optimizer_host_adam=args.optimizer_host_adam,
        fused_adam=args.fused_adam, **muon_config_kwargs(args))
    optimizer = get_optimizer(config, chunks, parallel_state=state)
    if args.decoupled_lr is not None:
        split_decoupled_groups(optimizer, chunks)
    return optimizer


def embedding_and_output_parameters(chunks: list[nn.Module]) -> set[int]:
    """``id`` of the input word-embedding and output-layer weights of ``chunks`` (Megatron's
    ``is_embedding_or_output_parameter``: the parameters ``--decoupled-lr`` applies to)."""
    found = set()
    for chunk in chunks:
        model = unwrap(chunk)
        embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
        output = getattr(model, "output_layer", None)
        for module in (embedding, output):
            weight = getattr(module, "weight", None)
            if isinstance(weight, nn.Parameter):
                found.add(id(weight))
    return found


def split_decoupled_groups(optimizer, chunks: list[nn.Module]) -> None:
    """Moves the fp32 masters of the embedding and output weights into their own param groups, marked
    ``decoupled_lr`` (the scheduler gives them ``--decoupled-lr`` / ``--decoupled-min-lr``), before any step.

    Optimizer states are keyed by master tensor, not by group, so checkpoints are unaffected."""
    inner = getattr(optimizer, "optimizer", None)
    if inner is None:
        return
    if optimizer.config.optimizer_nvme_offload_dir is not None:
        raise ValueError("--decoupled-lr is not supported with --optimizer-nvme-offload-dir yet: drop one of them")
    if inner.state:
        raise ValueError("--decoupled-lr groups must be split before the first optimizer step")
    targets = embedding_and_output_parameters(chunks)
    decoupled = {id(piece.master) for piece in optimizer.pieces if id(piece.param) in targets}
    groups = []
    for group in inner.param_groups:
        kept = [p for p in group["params"] if id(p) not in decoupled]
        moved = [p for p in group["params"] if id(p) in decoupled]
        for params, marked in ((kept, False), (moved, True)):
            if params:
                groups.append({**group, "params": params, "decoupled_lr": marked})
    inner.param_groups = groups
