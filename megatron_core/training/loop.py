"""The pretraining loop: build the layout, model chunks, optimizer and data from the flags, then train with
the pipeline schedule, evaluate, log, checkpoint and exit cleanly on request."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import logging
import math
import os
import signal
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.checkpointing import save_checkpoint
from megatron_core.checkpointing.async_save import AsyncCheckpointWriter
from megatron_core.checkpointing.checkpoint import prepare_checkpoint
from megatron_core.checkpointing.publication import check_save_folder
from megatron_core.fp8 import update_fp8_scales
from megatron_core.models import GPTModel
from megatron_core.models.mtp import mtp_log_fields, mtp_loss_report, set_mtp_loss_scale
from megatron_core.pipeline_parallel import PipelineError, get_forward_backward_func
from megatron_core.tensor_parallel import model_parallel_seed
from megatron_core.training.arguments import transformer_config
from megatron_core.training.banner import end_report, memory_probe, start_banner
from megatron_core.training.checkpoint_upkeep import check_replica_weights, prune_checkpoints
from megatron_core.training.data import build_datasets_once_per_node, build_run_tokenizer, micro_batches, take
from megatron_core.training.determinism import deterministic_mode
from megatron_core.training.elastic import (
    check_elastic_world,
    exit_with_parent,
    straggler_report,
    warn_shared_agent_store,
)
from megatron_core.training.metrics import MetricsWriter, format_log_line
from megatron_core.training.optimizer_setup import build_optimizer, wrap_data_parallel
from megatron_core.training.resume import load, tokenizer_identity
from megatron_core.training.runtime import RuntimeHooks, WandbSink
from megatron_core.training.schedule import build_lr_scheduler, check_batch_schedule, resolve_train_iters
from megatron_core.training.state import Run, reduce_losses, step_record
from megatron_core.transformer.moe.tracking import (
    moe_loss_report,
    reset_global_counts,
    set_aux_loss_scale,
    update_expert_bias,
)
from megatron_core.transformer.specs import layer_spec_for
from megatron_core.utils import accelerator
from megatron_core.utils.affinity import bind_cores_to_rank
from megatron_core.utils.progress import progress_bar

logger = logging.getLogger(__name__)


def kernel_report(kernel_backend, *, compiled_layers: bool = False) -> str:
    """``op=implementation`` for every fused op run so far through ``kernel_backend`` (the layout's
    ``ParallelState.kernel_backend``; ops inside compiled layers are not recorded: with ``compiled_layers`` the
    report says that inductor generated their kernels)."""
    report = ", ".join(f"{op}={backend}" for op, backend in sorted(kernel_backend.report().items())) or "none"
    if compiled_layers:
        report += "; transformer layers: torch.compile (inductor kernels; causal attention without a mask: sdpa)"
    return report


def initialize_distributed(args: argparse.Namespace) -> None:
    """Process group from torchrun's environment (or a single process); nccl with CUDA, gloo without."""
    if dist.is_initialized():
        return
    backend = args.distributed_backend or ("nccl" if accelerator.cuda_available() else "gloo")
    if backend == "nccl":  # CUDA-only path
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if "RANK" not in os.environ:  # one process, no launcher: an in-memory store, no port to collide on
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend, timeout=timeout)
    if args.bind_cores_to_rank:  # after the process group: its threads exist and are moved too
        local = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cores = bind_cores_to_rank(*local)
        print(f" rank {dist.get_rank()} (local rank {local[0]} of {local[1]}) bound to cores {cores}", flush=True)


def build_run(args: argparse.Namespace, *, announce: bool = True) -> Run:
    """Everything a training run holds, from the flags (collective: every rank calls it). ``announce=False``
    skips the start banner (its gathers of Python objects; ``tools/dry_run.py`` runs one rank of a fake world)."""
    initialize_distributed(args)
    if args.elastic_layout:
        check_elastic_world(args, dist.get_world_size())
        warn_shared_agent_store(args, dist.get_rank())
    config = transformer_config(args)
    state = initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                      config.virtual_pipeline_model_parallel_size, args.context_parallel_size,
                                      expert_model_parallel_size=args.expert_model_parallel_size,
                                      expert_tensor_parallel_size=args.expert_tensor_parallel_size or 1,
                                      hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
                                      num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
                                      timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
                                      kernel_backend=args.kernel_backend)
    config = config.bind_layout(state)
    micro_per_step = args.micro_batch_size * state.dp_size
    schedule = args.batch_schedule
    global_batch = args.global_batch_size or (schedule.largest if schedule else micro_per_step)
    if global_batch % micro_per_step != 0:
        raise ValueError(f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {state.dp_size}")
    check_batch_schedule(schedule, micro_per_step, micro_batch_size=args.micro_batch_size, dp_size=state.dp_size)
    args.train_iters = resolve_train_iters(args, global_batch)
    tokenizer = build_run_tokenizer(args)
    torch.manual_seed(args.seed)  # the same on every rank: layout-independent initialization
    # --init-model-with-meta-device (ZeRO-3): nothing is drawn now; DistributedDataParallel writes each rank's
    # shard from the parameters' init recipes, so the full model never exists on one rank (same weights)
    build_state = dataclasses.replace(state, device=torch.device("meta")) if args.init_model_with_meta_device else state
    chunks = [_build_chunk(args, config, build_state, tokenizer.vocab_size, vp) for vp in range(state.vpp_size or 1)]
    for chunk in chunks:
        chunk.parallel_state = state  # the layout the model runs at (build_state only placed its parameters)
    model_parallel_seed(args.seed + 100 * state.pp_rank, tp_rank=state.tp_rank, device=state.device,
                        tracker=state.rng_tracker)
    local_parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())  # before ZeRO-3 shards them
    chunks = wrap_data_parallel(args, chunks, state)
    optimizer = build_optimizer(args, chunks, state)
    (train, valid, _), builders = build_datasets_once_per_node(args, tokenizer, global_batch)
    if state.rank == 0 and builders:
        print(f" dataset indices built by {builders} of {state.world_size} ranks, loaded from the cache by the "
              "others", flush=True)
    run = Run(args=args, config=config, state=state, chunks=chunks, optimizer=optimizer,
              scheduler=build_lr_scheduler(args), tokenizer=tokenizer, train_dataset=train, valid_dataset=valid,
              global_batch=global_batch, num_microbatches=global_batch // micro_per_step,
              local_parameters=local_parameters)
    run.set_global_batch(0)
    eval_batch_size(run)  # a bad --eval-global-batch-size stops the run before the first step
    banner = start_banner(run) if announce else None
    if banner:
        print(banner, flush=True)
    return run


def _build_chunk(args, config, state, vocab_size: int, vp: int) -> GPTModel:
    vpp = state.vpp_size
    first = state.is_first_model_chunk(vp) if vpp else state.is_pipeline_first_stage
    last = state.is_last_model_chunk(vp) if vpp else state.is_pipeline_last_stage
    torch.manual_seed(args.seed)
    return GPTModel(config, parallel_state=state, vocab_size=vocab_size, max_sequence_length=args.seq_length,
                    pre_process=first, post_process=last, vp_stage=vp if vpp else None,
                    make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                    layer_spec=layer_spec_for(config))


def forward_step(data_iterator, model, *, tokens_scale: Optional[float] = None, cp_group=None):
    """Megatron's GPT forward step: per-token loss, then the loss-mask average of the micro-batch; with
    ``tokens_scale`` (``--calculate-per-token-loss``) the loss-mask sum times ``tokens_scale``.

    With context parallelism (``cp_group`` of size cp > 1) the batch holds this cp rank's tokens: the average
    divides by the loss-mask sum over every cp rank (all-reduced) and is multiplied by cp, because the
    gradient reduction averages over dp x cp while the cp ranks' losses are parts of one sum; the logged
    "lm loss" is the mean over the cp ranks, the micro-batch's loss over the whole sequence."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1

    def loss_func(per_token_loss: torch.Tensor):
        mask = batch["loss_mask"]
        total = (per_token_loss.float() * mask).sum()
        if tokens_scale is not None:
            loss = total * tokens_scale
        else:
            count = mask.sum()
            if cp_size > 1:
                count = count.detach().clone()
                dist.all_reduce(count, group=cp_group)
            loss = total * cp_size / count.clamp(min=1)
        logged = loss.detach().clone()
        if cp_size > 1:
            dist.all_reduce(logged, group=cp_group)
            logged /= cp_size
        return loss, {"lm loss": logged}

    return output, loss_func


def _per_token_scale(run: Run, batches: list[dict]) -> Optional[float]:
    """``--calculate-per-token-loss``: the schedule divides each micro-batch loss by their number and the
    data-parallel reduction averages over dp, so a micro-batch's token sum times ``num_microbatches * dp /
    tokens of the global batch`` yields the gradient (and the logged loss) of the sum over every token of the
    global batch divided by their count, as Megatron. Collective over the data-parallel group."""
    if not run.args.calculate_per_token_loss:
        return None
    state = run.state
    tokens = torch.stack([b["loss_mask"].sum() for b in batches]).sum().reshape(1).double() if batches \
        else torch.zeros(1, dtype=torch.float64, device=state.device)
    if state.dp_cp_group is not None and state.dp_cp_size > 1:
        dist.all_reduce(tokens, group=state.dp_cp_group)
    return len(batches) * state.dp_cp_size / max(float(tokens.item()), 1.0)


def run_schedule(run: Run, batches: list[dict], *, forward_only: bool) -> list:
    state = run.state
    schedule = get_forward_backward_func(state.pp_size, state.vpp_size,
                                         zero_bubble=run.args.enable_zero_bubble,
                                         zero_bubble_defer=run.args.zero_bubble_defer)
    iterators = [iter(batches) for _ in run.chunks] if state.vpp_size else iter(batches)
    scale = getattr(run.optimizer, "scale_loss", None) if run.config.fp16 else None
    tokens_scale = _per_token_scale(run, batches)
    step_func = functools.partial(forward_step, tokens_scale=tokens_scale,
                                  cp_group=state.cp_group if state.cp_size > 1 else None)
    loss_scale = float(run.optimizer.get_loss_scale()) if scale is not None else 1.0
    if run.config.moe is not None:  # the aux losses' gradient is scaled as the schedule scales the lm loss
        set_aux_loss_scale(run.chunks, loss_scale * state.cp_size / max(len(batches), 1))  # (times cp, as it)
    if run.config.mtp_num_layers is not None:  # the MTP loss is averaged as the lm loss (cp included)
        set_mtp_loss_scale(run.chunks, loss_scale / max(len(batches), 1), tokens_scale)
    return schedule(forward_step_func=step_func, data_iterator=iterators,
                    model=run.chunks if state.vpp_size else run.chunks[0], num_microbatches=len(batches),
                    seq_length=run.args.seq_length, micro_batch_size=run.args.micro_batch_size,
                    forward_only=forward_only, parallel_state=state, grad_scale_func=scale)


@contextlib.contextmanager
def _phase(run: Run, name: str) -> Iterator[None]:
    """Turns a failed collective or transfer into a TrainingError naming this rank, its groups and the phase."""
    try:
        yield
    except RuntimeError as error:
        if not _is_communication_failure(error):
            raise
        state = run.state
        raise TrainingError(
            f"rank {state.rank} failed during {name}: {error}. Its groups: tp ranks {state.tp_ranks}, pipeline "
            f"ranks {state.pp_ranks} (stage {state.pp_rank}), data-parallel ranks {state.dp_ranks}. A peer rank "
            f"died or stalled (--distributed-timeout-minutes {run.args.distributed_timeout_minutes})") from error


def _is_communication_failure(error: RuntimeError) -> bool:
    markers = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer")
    return isinstance(error, (dist.DistError, PipelineError)) or any(m in str(error).lower() for m in markers)


def train_step(run: Run, batches: list[dict]) -> dict:
    increment = run.scheduler.increment(run.global_batch)
    lr = run.scheduler.apply(run.optimizer.param_groups, increment)
    run.optimizer.zero_grad()
    with _phase(run, "the forward-backward schedule (p2p with the neighbouring pipeline stages, tp collectives)"):
        losses = run_schedule(run, batches, forward_only=False)
        lm_loss = reduce_losses(losses, run.state)  # over pp and dp: a stalled peer is named here too
        moe_losses = _moe_step(run)
        mtp_losses = (mtp_loss_report(run.chunks, run.state, run.config.mtp_num_layers)
                      if run.config.mtp_num_layers is not None else {})
    with _phase(run, "the optimizer step (grad reduction over data-parallel ranks, norm over model-parallel ranks)"):
        # FP8 delayed scaling: amaxes reduced over tp, dp x cp; new scales. Before the step (the same numbers: the
        # step reads no scale), so that --fp8-param-gather knows the next forward's weight scales at its gather
        update_fp8_scales(run.chunks, run.state)
        update_ok, grad_norm, num_zeros = run.optimizer.step()
    if update_ok:
        run.scheduler.step(increment)
    return {"lm_loss": lm_loss, "lr": lr, "grad_norm": grad_norm, "skipped": not update_ok, "num_zeros": num_zeros,
            "moe": moe_losses, "mtp": mtp_losses}


def _moe_step(run: Run) -> dict:
    """The step's MoE losses for the log (collective) and the aux-loss-free expert-bias update."""
    config = run.config
    if config.moe is None:
        return {}
    update_expert_bias(run.chunks, run.state)
    reset_global_counts(run.chunks)
    return moe_loss_report(run.chunks, run.state, num_layers=config.num_layers + (config.mtp_num_layers or 0),
                           sequence_parallel=config.sequence_parallel, per_layer=config.moe.moe_per_layer_logging)


def eval_batch_size(run: Run) -> tuple[int, int]:
    """(samples, micro-batches per rank) of one evaluation step: ``--eval-global-batch-size``, else the
    training global batch (Megatron-LM's rule); ValueError when micro-batch x data-parallel does not divide it."""
    per_step = run.global_batch // run.num_microbatches  # micro-batch x data-parallel size
    eval_batch = run.args.eval_global_batch_size or run.global_batch
    if eval_batch % per_step:
        raise ValueError(f"--eval-global-batch-size {eval_batch} is not divisible by --micro-batch-size "
                         f"{run.args.micro_batch_size} x data-parallel size {per_step // run.args.micro_batch_size}")
    return eval_batch, eval_batch // per_step


def evaluate(run: Run, iteration: int, writer: MetricsWriter) -> Optional[float]:
    if run.valid_dataset is None or run.args.eval_iters == 0:
        return None
    for chunk in run.chunks:
        chunk.eval()
    iterator = micro_batches(run.valid_dataset, consumed_samples=run.valid_consumed, state=run.state,
                             micro_batch_size=run.args.micro_batch_size, device=run.state.device)
    total, (eval_batch, eval_microbatches) = 0.0, eval_batch_size(run)
    with torch.no_grad():
        for _ in progress_bar(range(run.args.eval_iters), desc=f"evaluating at iteration {iteration}", leave=False,
                              enabled=run.is_logging_rank and not run.args.no_progress and run.args.eval_iters >= 10):
            total += reduce_losses(run_schedule(run, take(iterator, eval_microbatches), forward_only=True),
                                   run.state)
    run.valid_consumed += run.args.eval_iters * eval_batch
    for chunk in run.chunks:
        chunk.train()
    loss = total / run.args.eval_iters
    writer.write({"split": "valid", "iteration": iteration, "lm_loss": loss, "ppl": float(torch.tensor(loss).exp())})
    if run.is_logging_rank:
        print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: "
              f"{float(torch.tensor(loss).exp()):.6E} |", flush=True)
    return loss


def save(run: Run, iteration: int) -> None:
    """Saves checkpoint ``iteration`` (collective); with ``--async-save`` only the host copy happens here and
    a background thread writes the files (published by ``run.async_writer.poll()`` / ``finish()``)."""
    begin = time.perf_counter()
    kwargs = dict(iteration=iteration, model_chunks=run.chunks, config=run.config, state=run.state,
                  true_vocab_size=run.tokenizer.vocab_size, consumed_samples=run.consumed_samples,
                  optimizer=run.optimizer, scheduler=run.scheduler, run_config=_recorded_flags(run),
                  layout_extra={"zero_stage": run.args.zero_stage},
                  tokenizer=tokenizer_identity(run.args, run.tokenizer.vocab_size))
    with _phase(run, f"the save of checkpoint {iteration} (gathers and barriers over every rank)"):
        if run.async_writer is not None:
            run.async_writer.submit(lambda: prepare_checkpoint(run.args.save, **kwargs))
        else:
            save_checkpoint(run.args.save, **kwargs)
    run.save_stalls.append(time.perf_counter() - begin)
    if run.args.save_retain_interval and dist.get_rank() == 0:
        removed = prune_checkpoints(run.args.save, run.args.save_retain_interval)
        if removed:
            print(f" --save-retain-interval {run.args.save_retain_interval}: removed {', '.join(removed)}", flush=True)
    if run.is_logging_rank:
        how = "started saving (async)" if run.async_writer is not None else "saved"
        print(f" {how} checkpoint at iteration {iteration} to {run.args.save} (the step loop waited "
              f"{run.save_stalls[-1] * 1e3:.1f} ms)", flush=True)


def _recorded_flags(run: Run) -> dict:
    """The run flags metadata.json records; how the files were written (--async-save) is not among them, so
    a sync and an async save of the same state give identical checkpoints."""
    return {k: v for k, v in run.args_dict().items() if k != "async_save"}


def pretrain(args: argparse.Namespace) -> list[float]:
    """Trains as the flags say; returns the training losses (the same on every rank)."""
    exit_with_parent()
    with deterministic_mode(args.deterministic_mode, cuda=accelerator.cuda_available()):
        run = build_run(args)
        try:
            return _train(run)
        finally:
            destroy_model_parallel(run.state)


def _train(run: Run) -> list[float]:
    args = run.args
    if args.save:
        check_save_folder(args.save)  # a read-only or unwritable --save ends the run now, not at the first save
    start = load(run) if args.load else 0
    stop_requested = {"signal": False}
    if args.exit_signal_handler:
        signal.signal(signal.SIGTERM, lambda *_: stop_requested.update(signal=True))
    writer = MetricsWriter(args.metrics_file, args.tensorboard_dir, enabled=run.is_logging_rank,
                           sinks=[WandbSink(args, enabled=run.is_logging_rank)],
                           tensorboard_exclude=() if args.log_loss_scale_to_tensorboard else ("loss_scale",))
    hooks = RuntimeHooks(args, run.state)
    iterator = (micro_batches(run.train_dataset, consumed_samples=run.consumed_samples, state=run.state,
                              micro_batch_size=args.micro_batch_size, device=run.state.device)
                if run.train_dataset is not None else None)
    losses, lrs, valid, iteration = [], [], [], start
    run.async_writer = AsyncCheckpointWriter(run.state.device) if args.async_save else None
    busy = 0.0  # this rank's compute time (main-thread CPU seconds) since the last log line, for --log-straggler
    try:
        while not args.skip_train and iteration < args.train_iters:
            run.set_global_batch(run.consumed_samples)
            hooks.before_step(iteration)
            begin, begin_cpu = time.perf_counter(), time.thread_time()
            with memory_probe(run, iteration - start + 1):
                result = train_step(run, take(iterator, run.num_microbatches))
            busy += time.thread_time() - begin_cpu
            iteration += 1
            run.consumed_samples += run.global_batch
            hooks.after_step(iteration)
            losses.append(result["lm_loss"])
            lrs.append(result["lr"])
            _check_numerics(run, iteration, result)
            if len(losses) == 1 and run.is_logging_rank:  # which implementation ran each fused op, once
                report = kernel_report(run.state.kernel_backend, compiled_layers=run.config.compile)
                print(f" kernels used: {report}", flush=True)
            record = step_record(run, iteration, result, time.perf_counter() - begin)
            writer.write(record)
            if iteration % args.log_interval == 0 and run.is_logging_rank:
                print(format_log_line(record, train_iters=args.train_iters, consumed_samples=run.consumed_samples,
                                      global_batch=run.global_batch) + mtp_log_fields(record), flush=True)
            if args.log_straggler and iteration % args.log_interval == 0:
                line, busy = straggler_report(busy / args.log_interval, run.state, iteration), 0.0
                if line:
                    print(line, flush=True)
            if run.async_writer is not None:
                with _phase(run, "the publication of an async checkpoint (all-reduce over every rank)"):
                    run.async_writer.poll()
            if args.eval_interval and iteration % args.eval_interval == 0:
                hooks.around_evaluation()
                loss = evaluate(run, iteration, writer)
                if loss is not None:
                    valid.append((iteration, loss))
                hooks.around_evaluation()
            if _should_stop(run, iteration, stop_requested):
                break
        if args.save and iteration > start:
            save(run, iteration)
        if run.async_writer is not None:
            with _phase(run, "the publication of the last async checkpoint (barriers over every rank)"):
                run.async_writer.finish()
    finally:
        writer.close()
        hooks.close()
    report = end_report(run)
    if report:
        print(report, flush=True)
    if args.loss_curve_png and run.is_logging_rank and losses:
        from megatron_core.training.plots import write_loss_curve_png
        write_loss_curve_png(losses, args.loss_curve_png, first_iteration=start + 1, lrs=lrs, valid=valid,
                             title=f"{run.state.describe()}: {len(losses)} iterations, global batch {run.global_batch}")
    return losses


class TrainingError(RuntimeError):
    """The run cannot continue (non-finite loss or grads, too many skipped steps, a failed peer rank)."""

    exit_status = 1


def _check_numerics(run: Run, iteration: int, result: dict) -> None:
    args = run.args
    run.consecutive_skips = run.consecutive_skips + 1 if result["skipped"] else 0
    if run.consecutive_skips >= args.max_consecutive_skipped_iterations:
        raise TrainingError(f"{run.consecutive_skips} optimizer steps in a row were skipped (inf/nan grads) up to "
                            f"iteration {iteration} on rank {run.state.rank}; lower --lr or the initial loss scale, "
                            "or use --bf16")
    if args.check_for_nan_in_loss_and_grad:
        norm = result["grad_norm"]
        if not math.isfinite(result["lm_loss"]) or (norm is not None and not math.isfinite(float(norm))):
            raise TrainingError(f"non-finite value at iteration {iteration} on rank {run.state.rank}: "
                                f"lm loss {result['lm_loss']}, grad norm {norm} (--check-for-nan-in-loss-and-grad)")


def _should_stop(run: Run, iteration: int, stop_requested: dict) -> bool:
    """Periodic saves; and whether --exit-interval, --exit-duration-in-mins or a SIGTERM (with
    --exit-signal-handler) ends the run (every rank must agree, or the final save would hang)."""
    args = run.args
    stop = bool(args.exit_interval and iteration % args.exit_interval == 0)
    local = stop_requested["signal"] or bool(
        args.exit_duration_in_mins and time.monotonic() - run.start_time > 60 * args.exit_duration_in_mins)
    if args.exit_signal_handler or args.exit_duration_in_mins:
        flag = torch.tensor([1.0 if local else 0.0], device=run.state.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = stop or bool(flag.item())
    if args.check_weight_hash_across_dp_replicas_interval and \
            iteration % args.check_weight_hash_across_dp_replicas_interval == 0:
        check_replica_weights(run.chunks, run.state, iteration=iteration)
    if args.save and args.save_interval and iteration % args.save_interval == 0 and not stop \
            and iteration < args.train_iters:
        save(run, iteration)
    return stop


__all__ = ["pretrain", "build_run", "forward_step", "train_step", "evaluate"]
