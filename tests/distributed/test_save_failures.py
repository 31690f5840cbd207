"""A save that fails on one rank fails on every rank, at once: 2 gloo ranks, rank 1's shard write of the
second checkpoint raises ENOSPC (in the step loop, or in the background writer with --async-save). Both
ranks end with exit status 1 and the message naming rank 1 and the errno (before: rank 0 waited on a barrier
that rank 1 never reached, until the collective timeout); iteration 2 stays the newest checkpoint and no
``.partial`` folder is left."""
import os

import pytest

from tests.integration.test_reliability import TINY, run_main


def _train_with_a_failing_writer(argv, failing_rank, failing_folder):
    import errno

    import torch.distributed as dist

    from megatron_core.checkpointing import checkpoint
    real = checkpoint.save_file_durably

    def full_disk(tensors, path):
        if dist.get_rank() == failing_rank and failing_folder in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(tensors, path)

    checkpoint.save_file_durably = full_disk
    try:
        return run_main(argv)
    finally:
        checkpoint.save_file_durably = real


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_write_failure_on_one_rank_ends_every_rank_with_the_named_error(distributed, tmp_path, mode):
    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, "--tensor-model-parallel-size", "2", "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
            "--distributed-timeout-minutes", "2", *(["--async-save"] if mode == "async" else [])]
    results = distributed(2, _train_with_a_failing_writer, argv, 1, "iter_0000004.partial")
    for status, err in results:
        assert status == 1, err
        assert "could not write checkpoint 4" in err and "rank 1:" in err and "ENOSPC" in err, err
        assert "iter_0000004.partial/model_tp01_pp000.safetensors" in err, err
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "2"
