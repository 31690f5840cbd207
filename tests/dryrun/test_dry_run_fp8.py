"""FP8 through the dry run's fake CUDA (sm_90): the GPU code path (``torch._scaled_mm``, FP8 bytes in NCCL-style
collectives) runs on a machine without a GPU. Under ``--tp-comm-overlap`` the sequence-parallel gathers go out in
chunks of FP8 bytes (``fp8.comm_overlap``); an earlier version built an index tensor on the device inside the
backward, which the autograd device thread could not create (this test failed there)."""
from tests.dryrun.test_dry_run import SMALL, _ok, dry_run

FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]


def test_fp8_tp_comm_overlap_gathers_fp8_bytes_in_chunks(tmp_path):
    """tp 4, SP, --tp-comm-overlap, 4 layers of hidden 128, sequence 128 (32 rows per rank, 2 chunks of 16): each
    layer all-gathers QKV's and fc1's inputs (forward) and the attention projection's and fc2's output grads
    (backward) as 2 chunks of FP8 bytes: 32 all-gathers of 4 x 16 x 128 = 8192 bytes (bf16 would be 16384)."""
    flags = SMALL + FP8 + ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--tp-comm-overlap",
                           "--global-batch-size", "1"]
    done, report = dry_run(tmp_path, 4, flags, ranks="0")
    (result,) = _ok(done, report)
    assert done.returncode == 0 and result["device"]["type"] == "cuda"
    gathers = [c for c in result["collectives_per_step"] if c["op"] == "_allgather_base_" and c["group_size"] == 4]
    assert {"op": "_allgather_base_", "group_size": 4, "bytes": 8192, "count": 32} in gathers, gathers
    assert abs(result["peak_bytes"] / result["predicted_bytes"] - 1) < 0.10, result
