"""Save work scales (issue 19, item 5): ranks that write no shard copy no tensor to the host, and a ZeRO-3
save gathers one bucket at a time: measured with LiveMemoryTracker on 2 gloo ranks during
``prepare_checkpoint`` (the host copies and gathers of a save)."""
import pytest

from tests.recipe import RECIPE

ARGV = [*RECIPE, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
        "--eval-interval", "100000", "--log-interval", "100000", "--seed", "3"]


def _measure_save(argv, save_dir, bucket_size=None):
    """On every rank: (bytes allocated by the save, peak gathered-parameter bytes during it, bytes of the
    largest bucket's full parameters, bytes of all parameters)."""
    from megatron_core import destroy_model_parallel
    from megatron_core.checkpointing.checkpoint import prepare_checkpoint
    from megatron_core.distributed.ddp_config import DistributedDataParallelConfig
    from megatron_core.optimizer.memory import memory_categories
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.data import micro_batches, take
    from megatron_core.training.loop import build_run, train_step
    from megatron_core.utils.live_memory import LiveMemoryTracker
    original = DistributedDataParallelConfig.resolved_bucket_size
    if bucket_size:
        DistributedDataParallelConfig.resolved_bucket_size = lambda self, dp, total_numel=None: bucket_size
    try:
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


def _save(argv, save_dir):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    pretrain(parse_args([*argv, "--save", save_dir]))


def _measure_load(argv, load_dir):
    """On every rank: (tensor bytes it read, the files it hashed, bytes of every tensor file)."""
    import os

    from megatron_core import destroy_model_parallel
    from megatron_core.checkpointing import load_model_weights, read_metadata
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import build_run
    run = build_run(parse_args(argv))
    try:
        folder, metadata = read_metadata(load_dir)
        reader = load_model_weights(folder, metadata, model_chunks=run.chunks, config=run.config,
                                    state=run.state, optimizer=run.optimizer, shared_verify=True)
        files = [f for f in os.listdir(folder) if f.startswith("model_")]
        return reader.bytes_read, reader.files_hashed, sum(os.path.getsize(os.path.join(folder, f))
                                                           for f in files)
    finally:
        destroy_model_parallel(run.state)


@pytest.mark.parametrize("save_tp,load_tp,most", [(2, 2, 0.6), (1, 2, 0.8)], ids=["tp2-to-tp2", "tp1-to-tp2"])
def test_each_rank_reads_only_its_slices_and_each_file_is_hashed_once(distributed, tmp_path, save_tp, load_tp,
                                                                    most):
    """Loading at tp 2: each rank reads only its tp shard (at the saved tp: its own file; from tp 1: slices
    of the one file; a fused QKV or vocab-padded tensor at another tp is still read whole), and the files'
    sha256 checks are split over the ranks (each file hashed by one rank). Before, every rank read and
    hashed every shard file in full."""
    layout = lambda tp: [*ARGV, "--tensor-model-parallel-size", str(tp), "--global-batch-size", str(4 // (2 // tp))]
    distributed(save_tp, _save, layout(save_tp), str(tmp_path))
    results = distributed(2, _measure_load, layout(load_tp), str(tmp_path))
    hashed = [file for _, files, _ in results for file in files]
    assert sorted(hashed) == sorted(set(hashed)) and len(hashed) == save_tp, hashed
    for bytes_read, _, file_bytes in results:
        assert bytes_read < most * file_bytes, (bytes_read, file_bytes)
