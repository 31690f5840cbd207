"""Datasets and micro-batch iterators of the training loop (every rank of a data-parallel replica reads the
same samples; each replica its own share, resuming from ``consumed_samples``)."""
from __future__ import annotations

import argparse
from typing import Iterator, Optional

import torch

from megatron_core.context_parallel import split_batch
from megatron_core.data import (GPTDataConfig, MegatronPretrainingSampler, MockGPTDataset, build_gpt_datasets,
                                build_tokenizer)
from megatron_core.parallel_state import ParallelState


def build_run_tokenizer(args: argparse.Namespace):
    """The tokenizer the flags name (default: the byte tokenizer, which needs no file)."""
    return build_tokenizer(args.tokenizer_type or "ByteTokenizer", tokenizer_model=args.tokenizer_model,
                           vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
                           tiktoken_pattern=args.tiktoken_pattern,
                           tiktoken_num_special_tokens=args.tiktoken_num_special_tokens)


def build_datasets(args: argparse.Namespace, tokenizer, global_batch: int):
    """(train, valid, test) sized for the run: train_iters global batches, and the evaluations. With
    ``--mock-data``, synthetic documents over the tokenizer's vocabulary (no files; valid and test drawn from
    other seeds)."""
    evaluations = args.train_iters // args.eval_interval + 1
    eval_samples = evaluations * args.eval_iters * global_batch
    counts = (args.train_iters * global_batch, eval_samples, args.eval_iters * global_batch)
    if args.mock_data:
        return tuple(MockGPTDataset(count, args.seq_length, seed=args.seed + offset, vocab_size=tokenizer.vocab_size)
                     if count else None for offset, count in enumerate(counts))
    return build_gpt_datasets(GPTDataConfig(
        seq_length=args.seq_length, data_path=args.data_path or None, split=args.split, seed=args.seed,
        tokenizer=tokenizer, train_samples=counts[0], valid_samples=counts[1], test_samples=counts[2],
        eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
        index_cache_dir=args.data_cache_path))


def micro_batches(dataset, *, consumed_samples: int, micro_batch_size: int, state: ParallelState,
                  device: torch.device) -> Iterator[dict]:
    """Endless micro-batches ``{tokens, labels, loss_mask, position_ids}`` of this dp rank: ``[b, s]``, or with
    context parallelism this cp rank's ``[b, s/cp]`` of them (the load-balanced split; every cp rank of a
    replica reads the same samples, position ids keep their global values)."""
    while True:
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples % len(dataset), micro_batch_size,
                                             state.dp_rank, state.dp_size)
        for indices in sampler:
            samples = [dataset[i] for i in indices]
            batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                     for key in ("tokens", "labels", "loss_mask", "position_ids")}
            batch = split_batch(batch, cp_size=state.cp_size, cp_rank=state.cp_rank)
            yield {key: (value.float() if key == "loss_mask" else value.long()).to(device)
                   for key, value in batch.items()}
        consumed_samples = 0


def take(iterator: Optional[Iterator[dict]], count: int) -> list[dict]:
    return [next(iterator) for _ in range(count)] if iterator is not None else []
