"""How long a run trains and with which global batch: iteration- or sample-based training (Megatron's
``--train-iters`` / ``--train-samples`` and their ``--lr-*-iters`` / ``--lr-*-samples`` counterparts,
``--lr-warmup-fraction``), and the step-wise batch-size schedule ``--step-batch-size-schedule``.

With sample-based flags the learning-rate scheduler counts samples (it advances by the global batch each
step), as Megatron's ``OptimizerParamScheduler`` does; with iteration-based flags it counts iterations.
"""
from __future__ import annotations

import argparse
import dataclasses
from types import MappingProxyType
from typing import Optional

from megatron_core.training.lr_scheduler import LRScheduler

_SUFFIXES = MappingProxyType({"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12})
DEFAULT_TRAIN_ITERS = 100


def _count(text: str, flag: str) -> int:
    """``"2.4B"`` -> 2_400_000_000 (suffixes K, M, B, T)."""
    text = text.strip()
    scale = _SUFFIXES.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale
    except ValueError as err:
        raise ValueError(f"{flag}: {text!r} is not a count; write e.g. 0:16 2.4B:320 (suffixes K, M, B, T)") from err
    if value < 0:
        raise ValueError(f"{flag}: {text!r} must be >= 0")
    return int(round(value))


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """``(threshold in consumed samples, global batch)`` entries, thresholds strictly increasing from 0.

    ``global_batch(consumed)`` is the batch of the entry with the largest threshold <= ``consumed``
    (Megatron's ``StepBatchsizeNumMicroBatchesCalculator``).
    """

    entries: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, text: str, *, seq_length: Optional[int]) -> "BatchSchedule":
        """Parses ``"THRESHOLD:BATCH ..."``; thresholds are tokens when ``seq_length`` is given (converted to
        samples by floor division), else samples."""
        flag = "--step-batch-size-schedule"
        entries = []
        for item in text.split():
            if ":" not in item:
                raise ValueError(f"{flag} entry {item!r} is not THRESHOLD:BATCH; write e.g. \"0:16 2.4B:320\"")
            threshold, batch = item.split(":", 1)
            samples = _count(threshold, flag)
            entries.append((samples // seq_length if seq_length else samples, _count(batch, flag)))
        entries.sort()
        if not entries or entries[0][0] != 0:
            raise ValueError(f"{flag} {text!r} must start with a threshold of 0, e.g. \"0:16 ...\"")
        for (previous, _), (threshold, _) in zip(entries, entries[1:]):
            if threshold <= previous:
                raise ValueError(f"{flag} {text!r}: thresholds must be strictly increasing (in samples of "
                                 f"--seq-length {seq_length}), got {previous} then {threshold}")
        if any(batch < 1 for _, batch in entries):
            raise ValueError(f"{flag} {text!r}: every batch size must be >= 1")
        return cls(tuple(entries))

    def global_batch(self, consumed_samples: int) -> int:
        batch = self.entries[0][1]
        for threshold, size in self.entries:
            if consumed_samples >= threshold:
                batch = size
        return batch

    @property
    def largest(self) -> int:
        return max(batch for _, batch in self.entries)


def validate_schedule_flags(args: argparse.Namespace) -> None:
    """Checks the length, batch and lr-schedule flags as Megatron does: a global batch of at least one sample,
    iteration-based and sample-based flags not mixed, one warmup flag at most. Fills ``--train-iters`` (100
    without either length flag), ``--lr-decay-iters`` / ``--lr-decay-samples`` (the training length) and
    ``args.batch_schedule``."""
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError(f"--train-iters {args.train_iters} and --train-samples {args.train_samples} disagree: "
                         "train by iterations or by samples, give one of them")
    if args.train_iters is None and args.train_samples is None:
        args.train_iters = DEFAULT_TRAIN_ITERS
    sample_based = args.train_samples is not None
    unit = "samples" if sample_based else "iters"
    length = args.train_samples if sample_based else args.train_iters
    if length < 1:
        raise ValueError(f"--train-{unit} must be >= 1, got {length}")
    wrong = ([("--lr-decay-iters", args.lr_decay_iters), ("--lr-warmup-iters", args.lr_warmup_iters or None)]
             if sample_based else
             [("--lr-decay-samples", args.lr_decay_samples), ("--lr-warmup-samples", args.lr_warmup_samples or None)])
    for flag, value in wrong:
        if value is not None:
            other = "--train-samples" if sample_based else "--train-iters"
            raise ValueError(f"{flag} {value} does not go with {other}: use the --lr-*-{unit} flags with {other}")
    if sample_based and args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
    if not sample_based and args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    warmup_flag = f"--lr-warmup-{unit}"
    warmup = args.lr_warmup_samples if sample_based else args.lr_warmup_iters
    decay = args.lr_decay_samples if sample_based else args.lr_decay_iters
    if args.lr_warmup_fraction is not None:
        if warmup:
            raise ValueError(f"--lr-warmup-fraction {args.lr_warmup_fraction} and {warmup_flag} {warmup} "
                             "disagree; give one of them")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ValueError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must lie in [0, 1]")
    elif warmup > decay:
        raise ValueError(f"{warmup_flag} {warmup} is larger than --lr-decay-{unit} {decay} (default: "
                         f"--train-{unit}); shorten the warmup")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError(f"--decoupled-min-lr {args.decoupled_min_lr} needs --decoupled-lr")
    if args.decoupled_lr is not None and (args.decoupled_min_lr or args.min_lr) > args.decoupled_lr:
        raise ValueError(f"--decoupled-min-lr {args.decoupled_min_lr or args.min_lr} is larger than --decoupled-lr "
                         f"{args.decoupled_lr}")
    args.batch_schedule = None
    if args.step_batch_size_schedule is not None:
        schedule = BatchSchedule.parse(args.step_batch_size_schedule, seq_length=args.seq_length)
        if args.global_batch_size is not None and args.global_batch_size != schedule.entries[-1][1]:
            raise ValueError(f"--global-batch-size {args.global_batch_size} differs from the last batch size "
                             f"{schedule.entries[-1][1]} of --step-batch-size-schedule; drop one or make them agree")
        args.batch_schedule = schedule


def check_batch_schedule(schedule: Optional[BatchSchedule], micro_per_step: int, *, micro_batch_size: int,
                         dp_size: int) -> None:
    """Every scheduled global batch must be a whole number of micro-batches on every dp rank."""
    if schedule is None:
        return
    for threshold, batch in schedule.entries:
        if batch % micro_per_step:
            raise ValueError(f"--step-batch-size-schedule batch {batch} (from {threshold} samples) is not divisible "
                             f"by --micro-batch-size {micro_batch_size} x data-parallel size {dp_size}")


def resolve_train_iters(args: argparse.Namespace, global_batch: int) -> int:
    """Iterations of the run: ``--train-iters``, or with ``--train-samples`` the steps until the next global
    batch would pass it (walking the batch schedule)."""
    if args.train_samples is None:
        return args.train_iters
    schedule: Optional[BatchSchedule] = args.batch_schedule
    if schedule is None:
        return max(args.train_samples // global_batch, 1)
    consumed, iterations = 0, 0
    while consumed + schedule.global_batch(consumed) <= args.train_samples:
        consumed += schedule.global_batch(consumed)
        iterations += 1
    return max(iterations, 1)


def build_lr_scheduler(args: argparse.Namespace) -> LRScheduler:
    """The scheduler the flags describe, counting iterations or (sample-based) samples."""
    sample_based = args.train_samples is not None
    decay = args.lr_decay_samples if sample_based else args.lr_decay_iters
    warmup = args.lr_warmup_samples if sample_based else args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    return LRScheduler(max_lr=args.lr, min_lr=args.min_lr, warmup_iters=warmup, decay_iters=decay,
                       decay_style=args.lr_decay_style, init_lr=args.lr_warmup_init,
                       decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
                       counts_samples=sample_based)
