"""Data-parallel wrapping (ZeRO stage from the flags) and the optimizer of a training run."""
from __future__ import annotations

import argparse

from torch import nn

from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_optimizer
from megatron_core.parallel_state import ParallelState


def wrap_data_parallel(args: argparse.Namespace, chunks: list[nn.Module], state: ParallelState) -> list[nn.Module]:
    """Each model chunk in DistributedDataParallel over the data(-and-context)-parallel group."""
    config = DistributedDataParallelConfig(zero_stage=args.zero_stage, overlap_grad_reduce=args.overlap_grad_reduce)
    return [DistributedDataParallel(chunk, config=config, dp_group=state.dp_cp_group) for chunk in chunks]


def build_optimizer(args: argparse.Namespace, chunks: list[nn.Module], state: ParallelState):
    config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16,
        fp16=args.fp16, initial_loss_scale=args.initial_loss_scale, loss_scale=args.loss_scale,
        optimizer_cpu_offload=args.optimizer_cpu_offload)
    return get_optimizer(config, chunks, parallel_state=state)
