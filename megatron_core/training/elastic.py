"""Elastic and fault-tolerant runs under torchrun: the layout rule at a new world size, orphan workers that
exit with their agent, a straggler report, and the flags (``--async-save``, ``--elastic-layout``,
``--log-straggler``).

The elastic layout rule (``--elastic-layout``): tensor, pipeline and context parallel sizes are kept, the
data-parallel size is ``world_size / (tp x pp x cp)``; the global batch is kept (``--global-batch-size`` is
required), so a smaller dp runs more micro-batches per rank; the run resumes from the newest complete
checkpoint (``--load``) at ``consumed_samples``, so the sample stream continues where the checkpoint left it.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_core.parallel_state import ParallelState

logger = logging.getLogger(__name__)
STRAGGLER_RATIO = 1.5


def add_elastic_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault tolerance and elasticity")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoint files in a background thread while training continues; the pointer file "
                        "moves once every rank's files are fsynced")
    g.add_argument("--elastic-layout", action="store_true",
                   help="under torchrun --nnodes MIN:MAX: keep tp, pp and cp at a new world size, set dp = world / "
                        "(tp x pp x cp), keep --global-batch-size (more micro-batches per rank) and resume --load "
                        "at its consumed samples; refuses a world size that is not a multiple of tp x pp x cp")
    g.add_argument("--log-straggler", action="store_true",
                   help=f"every --log-interval, name the slowest rank when its step time is > {STRAGGLER_RATIO} x "
                        "the median over ranks")


def validate_elastic_flags(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flags when they cannot work together."""
    if args.async_save and not args.save:
        raise ValueError("--async-save needs --save DIR")
    if args.elastic_layout and (args.global_batch_size is None or not args.load):
        raise ValueError("--elastic-layout needs --global-batch-size (kept at every world size; the default, micro "
                         "batch x dp, would change with dp) and --load DIR (where a restart resumes; usually the "
                         "--save DIR)")


def check_elastic_world(args: argparse.Namespace, world_size: int) -> int:
    """The data-parallel size ``--elastic-layout`` gives ``world_size``; ValueError naming the values if none."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        raise ValueError(
            f"--elastic-layout: world size {world_size} cannot hold tensor-model-parallel-size {tp} x "
            f"pipeline-model-parallel-size {pp} x context-parallel-size {cp} = {model_parallel} (the elastic rule "
            f"keeps them and changes only dp): run on a multiple of {model_parallel} processes (nodes x "
            "--nproc-per-node), e.g. set torchrun's --nnodes MIN so that MIN x nproc-per-node is one")
    dp = world_size // model_parallel
    micro = args.micro_batch_size * dp
    if args.global_batch_size % micro != 0:
        raise ValueError(f"--elastic-layout: at world size {world_size} (dp {dp}) --global-batch-size "
                         f"{args.global_batch_size} is not divisible by --micro-batch-size {args.micro_batch_size} x "
                         f"dp {dp}; pick a global batch that every dp of the job divides")
    return dp


def warn_shared_agent_store(args: argparse.Namespace, rank: int) -> Optional[str]:
    """Under torchrun with ``--elastic-layout``: a warning (logged on rank 0, also returned) when the agents
    share their rendezvous TCPStore with the workers (torchrun's default). With it, torch <= 2.13 cannot scale
    up: the agent of rank 0 keeps the store address of its first round, never publishes it for a later round,
    and a node that joins then waits 60 s for ``MASTER_ADDR`` and fails. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in every agent's environment avoids it (each round then publishes a fresh store address)."""
    if not args.elastic_layout or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    message = ("--elastic-layout: torchrun shares its rendezvous store with the workers "
               "(TORCHELASTIC_USE_AGENT_STORE=True); with this torch a node that rejoins after a scale-down cannot "
               "start (it waits for MASTER_ADDR of the new round). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the "
               "environment of every torchrun agent so that the job can scale back up")
    if rank == 0:
        logger.warning(message)
    return message


def layout_change_notice(metadata: dict, state: ParallelState, num_microbatches: int) -> Optional[str]:
    """A line for the log when a checkpoint written at another dp is resumed (None when the dp is the same)."""
    saved = metadata.get("layout", {}).get("dp")
    if saved is None or saved == state.dp_size:
        return None
    return (f" elastic resume: checkpoint of iteration {metadata['iteration']} was written at dp {saved}, "
            f"continuing at dp {state.dp_size} (tp {state.tp_size}, pp {state.pp_size} kept) with "
            f"{num_microbatches} micro-batches per rank, from sample {metadata['consumed_samples']}")


def exit_with_parent(poll_seconds: float = 0.2) -> Optional[threading.Thread]:
    """Under torchrun, a daemon thread that ends this worker at once (``os._exit(1)``) when its agent (the
    parent process) is gone, so that no orphan keeps training or writing checkpoints. Watching the parent
    pid is used rather than ``PR_SET_PDEATHSIG``, which fires when the parent *thread* that started the
    worker exits, not the agent. Returns the thread (None when not under torchrun)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        logger.error("rank %s: the torchrun agent (pid %d) is gone; exiting", os.environ.get("RANK"), parent)
        os._exit(1)

    thread = threading.Thread(target=watch, name="exit-with-agent", daemon=True)
    thread.start()
    return thread


def straggler_report(step_seconds: float, state: ParallelState, iteration: int) -> Optional[str]:
    """Gathers every rank's mean step time (collective over the default group); on rank 0 returns a line
    naming the slowest rank when it is > ``STRAGGLER_RATIO`` x the median, else None."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    times = [torch.zeros(1, dtype=torch.float64, device=state.device) for _ in range(dist.get_world_size())]
    dist.all_gather(times, torch.tensor([step_seconds], dtype=torch.float64, device=state.device))
    values = [float(t.item()) for t in times]
    median = statistics.median(values)
    slowest = max(range(len(values)), key=values.__getitem__)
    if state.rank != 0 or values[slowest] <= STRAGGLER_RATIO * median:
        return None
    return (f" straggler at iteration {iteration}: rank {slowest} takes {values[slowest] * 1e3:.1f} ms per step, "
            f"{values[slowest] / median:.2f} x the median {median * 1e3:.1f} ms over {len(values)} ranks")
