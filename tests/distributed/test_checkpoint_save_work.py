"""Save work scales (issue 19, item 5): ranks that write no shard copy no tensor to the host, and a ZeRO-3
save gathers one bucket at a time: measured with LiveMemoryTracker on 2 gloo ranks during
``prepare_checkpoint`` (the host copies and gathers of a save)."""
import pytest

ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
        "--eval-interval", "100000", "--log-interval", "100000", "--seed", "3"]


def _measure_save(argv, save_dir, bucket_size=None):
    """On every rank: (bytes allocated by the save, peak gathered-parameter bytes during it, bytes of the
    largest bucket's full parameters, bytes of all parameters)."""
    import kernels
    from megatron_core import destroy_model_parallel
    from megatron_core.checkpointing.checkpoint import prepare_checkpoint
    from megatron_core.distributed.ddp_config import DistributedDataParallelConfig
    from megatron_core.optimizer.memory import memory_categories
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import build_run, train_step
    from megatron_core.training.data import take, micro_batches
    from megatron_core.utils.live_memory import LiveMemoryTracker
    original = DistributedDataParallelConfig.resolved_bucket_size
    if bucket_size:
        DistributedDataParallelConfig.resolved_bucket_size = lambda self, dp, total_numel=None: bucket_size
    try:
        with kernels.use_backend("torch"):
            run = build_run(parse_args([*argv, "--save", save_dir]))
            try:
                batches = micro_batches(run.train_dataset, consumed_samples=0, state=run.state,
                                        micro_batch_size=2, device=run.state.device)
                train_step(run, take(batches, run.num_microbatches))  # optimizer states exist
                with LiveMemoryTracker(categories=lambda: memory_categories(run.chunks, run.optimizer)) as live:
                    prepare_checkpoint(save_dir, iteration=1, model_chunks=run.chunks, config=run.config,
                                       state=run.state, true_vocab_size=run.tokenizer.vocab_size,
                                       consumed_samples=4, optimizer=run.optimizer)
                buckets = [b for chunk in run.chunks for b in getattr(chunk, "buckets", [])]
                largest = max(b.numel * b.kind.param_dtype.itemsize for b in buckets)
                total = sum(p.numel() for chunk in run.chunks for p in chunk.parameters()) * 4
                if run.config and buckets and buckets[0].shard_params:
                    total = sum(b.numel * 4 for b in buckets)
                return (sum(n for n, _ in live.allocations), live.peak_by_category["gathered_parameters"],
                        largest, total, len(buckets))
            finally:
                destroy_model_parallel(run.state)
    finally:
        DistributedDataParallelConfig.resolved_bucket_size = original


def test_only_the_writing_rank_copies_tensors_to_the_host(distributed, tmp_path):
    """dp 2 without ZeRO: dp rank 0 writes the shard file (weights + fp32 Adam states, about 3 x the weights),
    dp rank 1 only its RNG file; before, rank 1 copied every weight and optimizer state too."""
    (written, _, _, weights, _), (other, _, _, _, _) = distributed(2, _measure_save, [*ARGV, "--zero-stage", "0"],
                                                                   str(tmp_path))
    assert written >= 3 * weights, (written, weights)
    assert other < 0.1 * weights, (other, weights)  # RNG states and the pickled tensor records


def test_a_zero3_save_gathers_one_bucket_at_a_time(distributed, tmp_path):
    """dp 2, ZeRO-3 with buckets of 8192 elements: the gathered parameters live during the save never exceed
    the largest bucket (before: the whole model was gathered at once)."""
    results = distributed(2, _measure_save, [*ARGV, "--zero-stage", "3"], str(tmp_path), 8192)
    for _, peak_gathered, largest, total, count in results:
        assert count >= 4, count
        assert 0 < peak_gathered <= largest < total / 2, (peak_gathered, largest, total)
