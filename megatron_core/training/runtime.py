"""Per-run side switches of Megatron-LM's training loop: logging level, manual garbage collection, the
torch.profiler trace (``--profile``), releasing cached device memory, CUDA memory history, and the Weights &
Biases sink. Each acts only when its flag is given; the CUDA-only ones are no-ops on other devices.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
from typing import Any, Optional

import torch

from megatron_core.parallel_state import ParallelState
from megatron_core.utils import accelerator

logger = logging.getLogger(__name__)


def profile_trace_path(args: argparse.Namespace, rank: int) -> str:
    """Megatron's place for the torch.profiler trace: ``<tensorboard-dir>/../torch_profile/rank-N.json.gz``
    (``./torch_profile`` without a TensorBoard directory)."""
    base = (os.path.join(os.path.dirname(os.path.abspath(args.tensorboard_dir)), "torch_profile")
            if args.tensorboard_dir else "torch_profile")
    return os.path.join(base, f"rank-{rank}.json.gz")


class RuntimeHooks:
    """Called by the loop around each training step and each evaluation.

    Args:
        args: the parsed flags (``--logging-level``, ``--manual-gc*``, ``--profile*``,
            ``--empty-unused-memory-level``, ``--record-memory-history``,
            ``--disable-bf16-reduced-precision-matmul``).
        state: the layout (rank, device).
    """

    def __init__(self, args: argparse.Namespace, state: ParallelState) -> None:
        self.args, self.state = args, state
        self.on_cuda = state.device.type == "cuda"
        self.profiler: Optional[torch.profiler.profile] = None
        if args.logging_level is not None:
            logging.getLogger().setLevel(args.logging_level)
        if args.manual_gc:
            gc.disable()
            gc.collect()
        if self.on_cuda and args.disable_bf16_reduced_precision_matmul:  # CUDA-only path
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        if self.on_cuda and args.record_memory_history:
            accelerator.record_memory_history()
        elif args.record_memory_history and state.rank == 0:
            logger.warning("--record-memory-history records CUDA allocations; ignored on %s", state.device.type)

    def _profiles_this_rank(self) -> bool:
        ranks = self.args.profile_ranks
        return self.args.profile and (not ranks or self.state.rank in ranks)

    def before_step(self, completed: int) -> None:
        """Before the step that follows ``completed`` iterations: starts the trace at --profile-step-start."""
        if self._profiles_this_rank() and completed == self.args.profile_step_start and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.on_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()

    def after_step(self, iteration: int) -> None:
        """After iteration ``iteration`` (1-based): stops the trace at --profile-step-end, collects garbage
        every --manual-gc-interval steps, releases cached CUDA blocks at --empty-unused-memory-level >= 1."""
        if self.profiler is not None and iteration >= self.args.profile_step_end:
            self._write_trace()
        if self.args.manual_gc and self.args.manual_gc_interval and iteration % self.args.manual_gc_interval == 0:
            gc.collect()
        if self.on_cuda and self.args.empty_unused_memory_level >= 1:
            accelerator.empty_cache()

    def around_evaluation(self) -> None:
        """Before and after an evaluation: manual collection (unless --no-manual-gc-eval), cache release (level 2)."""
        if self.args.manual_gc and self.args.manual_gc_eval:
            gc.collect()
        if self.on_cuda and self.args.empty_unused_memory_level >= 2:
            accelerator.empty_cache()

    def _write_trace(self) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        path = profile_trace_path(self.args, self.state.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        profiler.export_chrome_trace(path)
        logger.info("wrote the torch.profiler trace of iterations %d-%d to %s", self.args.profile_step_start + 1,
                       self.args.profile_step_end, path)

    def close(self) -> None:
        """End of the run: writes an unfinished trace, the CUDA memory snapshot, re-enables automatic gc."""
        if self.profiler is not None:
            self._write_trace()
        if self.on_cuda and self.args.record_memory_history:
            accelerator.dump_memory_snapshot(self.args.memory_snapshot_path)
        if self.args.manual_gc:
            gc.enable()


class WandbSink:
    """Writes metric records to Weights & Biases (``--wandb-project``); a warning and no-op without wandb."""

    def __init__(self, args: argparse.Namespace, *, enabled: bool) -> None:
        self.run: Any = None
        if not (enabled and args.wandb_project):
            return
        try:
            import wandb
        except ImportError:
            logger.warning("--wandb-project %s: the wandb package is not installed (pip install wandb); not "
                           "logging to Weights & Biases", args.wandb_project)
            return
        save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
        self.run = wandb.init(project=args.wandb_project, name=args.wandb_exp_name, dir=save_dir,
                              entity=args.wandb_entity, config={k: v for k, v in vars(args).items()
                                                                if isinstance(v, (int, float, str, bool, type(None)))})

    def write(self, record: dict) -> None:
        if self.run is not None:
            prefix = record.get("split", "train")
            self.run.log({f"{prefix}/{k}": v for k, v in record.items() if isinstance(v, (int, float))
                          and k != "iteration"}, step=record["iteration"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
