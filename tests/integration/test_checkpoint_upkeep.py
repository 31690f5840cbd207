"""--save-retain-interval keeps every N-th checkpoint and the newest (the others are removed after each save);
--check-weight-hash-across-dp-replicas-interval passes on healthy replicas and names the ranks whose weights
drifted apart."""
import pytest
import torch

from tests.integration.test_reliability import TINY, run_main


def test_save_retain_interval_keeps_every_nth_and_the_newest(distributed, tmp_path):
    argv = [*TINY, "--train-iters", "7", "--save", str(tmp_path), "--save-interval", "1", "--save-retain-interval",
            "3", "--check-weight-hash-across-dp-replicas-interval", "2"]
    status, err = distributed(2, run_main, argv)[0]
    assert status == 0, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000003", "iter_0000006", "iter_0000007"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "7"


def _check_after_drift(drift: bool):
    import torch.distributed as dist

    from megatron_core import initialize_model_parallel
    from megatron_core.training.checkpoint_upkeep import check_replica_weights
    state = initialize_model_parallel(1, 1)  # 2 ranks: dp 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if drift and dist.get_rank() == 1:
        with torch.no_grad():
            model[1].bias[0] += 1e-6
    try:
        check_replica_weights([model], state, iteration=5)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("drift", [False, True])
def test_weight_hash_check_names_the_ranks_that_drifted(distributed, drift):
    errors = distributed(2, _check_after_drift, drift)
    if not drift:
        assert errors == [None, None]
        return
    for error in errors:
        assert error is not None and "at iteration 5 the parameters differ across their replicas" in error
        assert "ranks [0]" in error and "ranks [1]" in error, error
