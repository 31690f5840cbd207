"""Multi-node under torchrun, on loopback: two agents (two "nodes", 2 ranks each) of one c10d rendezvous train
tp 2 x dp 2 with the losses of the single-process run, and the dataset index cache is built by one rank of
the job (global rank 0) while the others load it."""
import json
import os

from megatron_core.utils.affinity import cores_for_rank
from tests.integration.agents import TINY, Agents

ARGV = [*TINY, "--global-batch-size", "8", "--train-iters", "4"]


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(list(argv)))


def _losses(path):
    return [json.loads(line)["lm_loss"] for line in path.read_text().splitlines() if '"split"' not in line]


def test_two_nodes_tp2_dp2_match_the_single_process_run_and_build_the_index_cache_once(tmp_path, distributed):
    cache = tmp_path / "index_cache"
    metrics = tmp_path / "metrics.jsonl"
    with Agents([*ARGV, "--tensor-model-parallel-size", "2", "--data-cache-path", str(cache), "--metrics-file",
                 str(metrics), "--bind-cores-to-rank"], nproc_per_node=2, nnodes="2", out_dir=tmp_path) as agents:
        assert agents.wait(120), "the two-node run did not finish in 120 s"
        logs = agents.log(0) + agents.log(1)
        assert [p.returncode for p in agents.procs] == [0, 0], logs[-4000:]
    assert "dataset indices built by 1 of 4 ranks" in logs, logs[-4000:]
    cores = sorted(os.sched_getaffinity(0))
    for local_rank in (0, 1):  # each node's two ranks on a core (share) of their own
        expected = f"(local rank {local_rank} of 2) bound to cores {cores_for_rank(local_rank, 2, cores)}"
        assert expected in logs, logs[-4000:]
    reference = distributed(1, _train, [*ARGV, "--data-cache-path", str(tmp_path / "ref_cache")])[0]
    losses = _losses(metrics)
    assert len(losses) == 4
    for got, want in zip(losses, reference):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, reference)
