"""What a training run holds, and the per-iteration record (loss averaged over micro-batches and replicas)."""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.checkpointing.layout import unwrap
from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.training.metrics import gpt_flops_per_iteration, memory_bytes, peak_tflops_per_device


@dataclasses.dataclass
class Run:
    args: argparse.Namespace
    config: TransformerConfig
    state: ParallelState
    chunks: list[nn.Module]
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    train_dataset: Any
    valid_dataset: Any
    global_batch: int
    num_microbatches: int
    consumed_samples: int = 0
    valid_consumed: int = 0
    consecutive_skips: int = 0
    start_time: float = dataclasses.field(default_factory=time.monotonic)
    async_writer: Any = None  # --async-save: the AsyncCheckpointWriter of the run
    save_stalls: list = dataclasses.field(default_factory=list)  # seconds the step loop waited per save
    local_parameters: int = 0  # elements of this rank's model chunks (full shapes, before ZeRO-3 sharding)
    measured_peak_bytes: Optional[int] = None  # live tensor bytes of the probed step (banner.memory_probe)

    def set_global_batch(self, consumed_samples: int) -> None:
        """The global batch (and micro-batches per step) of the next step: ``--step-batch-size-schedule`` at
        ``consumed_samples``; unchanged without a schedule."""
        schedule = getattr(self.args, "batch_schedule", None)
        if schedule is None:
            return
        micro_per_step = self.args.micro_batch_size * self.state.dp_size
        self.global_batch = schedule.global_batch(consumed_samples)
        self.num_microbatches = self.global_batch // micro_per_step

    @property
    def is_logging_rank(self) -> bool:
        return self.state.rank == 0

    def args_dict(self) -> dict:
        return {k: v for k, v in vars(self.args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}

    @property
    def padded_vocab_size(self) -> int:
        return unwrap(self.chunks[0]).padded_vocab_size


def reduce_losses(losses: list, state: ParallelState) -> float:
    """Mean "lm loss" over this step's micro-batches (last stage) and over data-parallel replicas, on every rank."""
    local = torch.stack([entry["lm loss"].float() for entry in losses]).mean() if losses else torch.zeros(())
    value = local.reshape(1).to(state.device)
    if dist.is_initialized():
        if state.pp_group is not None and state.pp_size > 1:  # only the last stage holds the loss
            dist.all_reduce(value, group=state.pp_group)
        if state.dp_group is not None and state.dp_size > 1:
            dist.all_reduce(value, group=state.dp_group)
            value /= state.dp_size
    return float(value.item())


def step_record(run: Run, iteration: int, result: dict, seconds: float) -> dict:
    """One metrics-file line: loss, grad norm, lr, loss scale, throughput, TFLOP/s per rank, MFU, memory."""
    tokens = run.global_batch * run.args.seq_length
    flops = gpt_flops_per_iteration(run.config, batch_size=run.global_batch, seq_length=run.args.seq_length,
                                    padded_vocab_size=run.padded_vocab_size)
    tflops_per_rank = flops / seconds / run.state.world_size / 1e12
    peak = peak_tflops_per_device(run.state.device, getattr(run.args, "peak_tflops", None),
                                  fp8=run.config.fp8 is not None)
    scale = run.optimizer.get_loss_scale() if hasattr(run.optimizer, "get_loss_scale") else 1.0
    grad_norm = result["grad_norm"]
    optional = {"num_zeros": result.get("num_zeros")}
    if getattr(run.args, "log_params_norm", False):
        optional["params_norm"] = params_norm(run.optimizer, run.state)
    if getattr(run.args, "log_world_size_to_tensorboard", False):
        optional["world_size"] = run.state.world_size
    record = {"iteration": iteration, "lm_loss": result["lm_loss"],
              "grad_norm": None if grad_norm is None else float(grad_norm), "lr": result["lr"],
              "loss_scale": float(scale), "skipped": int(result["skipped"]), "ms_per_iter": seconds * 1e3,
              "tokens_per_sec": tokens / seconds, "tflops_per_rank": tflops_per_rank,
              "mfu": None if peak is None else tflops_per_rank / peak, "mem_bytes": memory_bytes(run.state.device)}
    record.update({k: v for k, v in optional.items() if v is not None})
    record.update(result.get("moe") or {})  # load_balancing_loss, z_loss (per layer with --moe-per-layer-logging)
    record.update(result.get("mtp") or {})  # mtp_1_loss, ... (multi-token prediction)
    return record


def params_norm(optimizer: Any, state: ParallelState) -> float:
    """Global L2 norm of the parameters (``--log-params-norm``), from the optimizer's fp32 masters: each
    parameter counted once over tp replicas and tied copies, ZeRO shards summed over dp. Collective over the
    data-parallel and model-parallel groups, as the grad norm."""
    return optimizer.params_norm()


__all__ = ["Run", "reduce_losses", "step_record", "params_norm"]
