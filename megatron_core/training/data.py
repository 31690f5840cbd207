"""Datasets and micro-batch iterators of the training loop (every rank of a data-parallel replica reads the
same samples; each replica its own share, resuming from ``consumed_samples``)."""
from __future__ import annotations

import argparse
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_core.context_parallel import split_batch
from megatron_core.data import (
    GPTDataConfig,
    MegatronPretrainingSampler,
    MockGPTDataset,
    build_gpt_datasets,
    build_tokenizer,
)
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
    evaluations = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
    eval_batch = getattr(args, "eval_global_batch_size", None) or global_batch
    eval_samples = evaluations * args.eval_iters * eval_batch
    counts = (args.train_iters * global_batch, eval_samples, args.eval_iters * eval_batch)
    if args.mock_data:
        return tuple(MockGPTDataset(count, args.seq_length, seed=args.seed + offset, vocab_size=tokenizer.vocab_size)
                     if count else None for offset, count in enumerate(counts))
    return build_gpt_datasets(GPTDataConfig(
        seq_length=args.seq_length, data_path=args.data_path or None, split=args.split, seed=args.seed,
        tokenizer=tokenizer, train_samples=counts[0], valid_samples=counts[1], test_samples=counts[2],
        eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
        index_cache_dir=args.data_cache_path))


def build_datasets_once_per_node(args: argparse.Namespace, tokenizer, global_batch: int) -> tuple[tuple, int]:
    """``build_datasets`` with the file work (default corpus, index caches) done once per job on a shared
    file system and once per node on node-local ones; returns ``(datasets, ranks that built indices)``.

    Three turns separated by barriers (collective over the default group): global rank 0 builds and writes
    the caches; then local rank 0 of every other node (``LOCAL_RANK`` from torchrun), which finds the files on
    a shared file system and builds them on a node-local one; then every other rank, which only loads them.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        datasets = build_datasets(args, tokenizer, global_batch)
        return datasets, int(_built_indices(datasets))
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    turn = 0 if rank == 0 else 1 if local_rank == 0 else 2
    datasets = None
    for current in range(3):
        if current == turn:
            datasets = build_datasets(args, tokenizer, global_batch)
        dist.barrier()
    built = torch.tensor([float(_built_indices(datasets))])
    dist.all_reduce(built)
    return datasets, int(built.item())


def _built_indices(datasets) -> bool:
    """Whether any (sub-)dataset of ``datasets`` computed its indices rather than loading them from the cache."""
    stack = [d for d in datasets if d is not None]
    while stack:
        dataset = stack.pop()
        if getattr(dataset, "built_indices", False):
            return True
        stack.extend(getattr(dataset, "datasets", []))
    return False


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
