"""Partial distributed optimizer (Megatron-LM's ``--num-distributed-optimizer-instances N``): the dp x cp ranks cut
into N instances, each a full copy of the ZeRO-sharded optimizer state.

At dp 4 with N = 2 and N = 4 (stages 1 and 2, fp32), 5 AdamW steps with clipping and 2 accumulated micro-batches
equal single-process AdamW on the full batch (losses, grad norms, weights); bf16 and fp16 (loss scaler) stay close
to N = 1; each rank's live optimizer state is 1/(dp/N) of the total; pretrain_gpt at dp 4 with N = 2 matches the
single-process run (dense, and MoE at ep 2) and its checkpoint resumes at N = 1; bad N values are refused by name.
"""
import contextlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import initialize_model_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron_core.optimizer import OptimizerConfig, get_optimizer
from megatron_core.parallel_state import distributed_optimizer_groups, layout_groups
from tests.distributed.test_optimizer_parity import BATCH, MICRO, OPT, STEPS, Net, net_batch
from tests.integration import test_pretrain, test_pretrain_moe

NET_NUMEL = 8 * 32 + 32 + 2 * 32 + 32 * 32 + 32 + 32 * 4 + 4  # Net's parameters


def train_instances(instances: int, stage: int, *, dtype=torch.float32, lr=OPT["lr"]):
    """Runs on every rank (dp = world size): Net over DistributedDataParallel with ``instances`` optimizer
    instances. Returns (full parameters, losses, grad norms (None: a skipped fp16 step), optimizer state bytes,
    master weight bytes)."""
    state = initialize_model_parallel(num_distributed_optimizer_instances=instances)
    torch.manual_seed(0)
    model = Net().to(dtype)
    groups = dict(dp_group=state.dp_cp_group)
    if instances > 1:
        groups = dict(dp_group=state.intra_dp_cp_group, inter_dist_opt_group=state.inter_dist_opt_group)
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=stage, bucket_size=200),
                                  **groups)
    config = OptimizerConfig(**{**OPT, "lr": lr}, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                             initial_loss_scale=2.0 ** 12)  # (fp16: the dynamic scale starts there)
    optimizer = get_optimizer(config, ddp, parallel_state=state)
    losses, norms, rows = [], [], BATCH // state.dp_size
    for step in range(STEPS):
        x, y = (t[state.dp_rank * rows:(state.dp_rank + 1) * rows] for t in net_batch(step))
        optimizer.zero_grad()
        loss = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
            with ddp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                micro_loss = F.mse_loss(ddp(xm.to(dtype)).float(), ym) / MICRO
                optimizer.scale_loss(micro_loss).backward()
            loss += micro_loss.detach()
        finalize_model_grads([ddp], state)
        ok, norm, _ = optimizer.step()
        assert ok or dtype == torch.float16  # (fp16: a step with inf grads is skipped, the scale backs off)
        dist.all_reduce(loss)
        losses.append(loss.item() / state.dp_size)
        norms.append(norm)
    params = {k: v.float() for k, v in ddp.state_dict().items()}
    return params, losses, norms, optimizer.optimizer_state_bytes(), optimizer.master_weight_bytes()


@pytest.fixture(scope="module")
def reference():
    """Single-process AdamW on the full batch (Megatron's groups: no decay on 1-D parameters)."""
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPT["weight_decay"]},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=OPT["lr"])
    losses, norms = [], []
    for step in range(STEPS):
        x, y = net_batch(step)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, OPT["clip_grad"])))
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("instances,stage", [(2, 1), (2, 2), (4, 1)])
def test_fp32_matches_single_process_adamw_and_state_is_one_instance_share(distributed, reference, instances, stage):
    ref_params, ref_losses, ref_norms = reference
    results = distributed(4, train_instances, instances, stage)
    for params, losses, norms, _, _ in results:
        assert _max_diff(params, ref_params) <= 1e-6
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=1e-7)
    # live Adam states (exp_avg, exp_avg_sq: 8 bytes an element): one full copy per instance of 4 / N ranks
    state_bytes = [r[3] for r in results]
    size = 4 // instances
    for first in range(0, 4, size):
        assert sum(state_bytes[first:first + size]) == 8 * NET_NUMEL
    assert state_bytes[:size] * instances == state_bytes  # every instance holds the same shards
    bucket_padding = 8 * 4 * 10  # at most one partly filled element per rank and bucket
    assert all(abs(b - 8 * NET_NUMEL / size) <= bucket_padding for b in state_bytes), state_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_close_to_one_instance(distributed, dtype):
    one = distributed(4, train_instances, 1, 1, dtype=dtype, lr=1e-3)
    two = distributed(4, train_instances, 2, 1, dtype=dtype, lr=1e-3)
    for (params, losses, norms, _, masters), (one_params, one_losses, one_norms, _, one_masters) in zip(two, one):
        assert [n is None for n in norms] == [n is None for n in one_norms]  # the same steps skipped (fp16)
        assert norms[-1] is not None and abs(norms[-1] - one_norms[-1]) <= 1e-2 * one_norms[-1]
        assert _max_diff(params, one_params) <= 2e-2
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_losses), rtol=1e-2, atol=0)
        assert masters == 2 * one_masters or abs(masters - 2 * one_masters) <= 4 * 4 * 10  # fp32 masters, 1/2


def test_groups_of_the_docstring_example_and_bad_values():
    groups = distributed_optimizer_groups(layout_groups(8, tp=2, pp=1, ep=1), 2)
    assert groups["intra_dp_cp"] == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert groups["inter_dist_opt"] == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert groups["intra_expert_dp"] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # experts whole over tp: expert-dp 8
    with pytest.raises(ValueError, match=r"num_distributed_optimizer_instances 3 must be .* dividing dp x cp = 4.*"
                                         r"\[1, 2, 4\]"):
        distributed_optimizer_groups(layout_groups(8, tp=2, pp=1, ep=1), 3)
    with pytest.raises(ValueError, match="num_distributed_optimizer_instances 0 must be an integer >= 1"):
        distributed_optimizer_groups(layout_groups(4, tp=1, pp=1), 0)
    with pytest.raises(ValueError, match="does not divide the expert-data-parallel size 1"):
        distributed_optimizer_groups(layout_groups(4, tp=1, pp=1, ep=4), 2)
    with pytest.raises(ValueError, match="dividing dp x cp = 1"):
        initialize_model_parallel(num_distributed_optimizer_instances=2)  # one process


def _refusals() -> list[str]:
    messages = []
    for attempt in (lambda: initialize_model_parallel(num_distributed_optimizer_instances=3),
                    lambda: _ddp_at_stage(3), lambda: _ddp_at_stage(0)):
        try:
            attempt()
        except ValueError as error:
            messages.append(str(error))
    return messages


def _ddp_at_stage(stage: int) -> None:
    state = initialize_model_parallel(num_distributed_optimizer_instances=2)
    DistributedDataParallel(Net(), config=DistributedDataParallelConfig(zero_stage=stage),
                            dp_group=state.intra_dp_cp_group, inter_dist_opt_group=state.inter_dist_opt_group)


def test_bad_instances_and_stages_are_refused(distributed, capsys):
    first, stage3, stage0 = distributed(4, _refusals)[0]
    assert "num_distributed_optimizer_instances 3 must be an integer >= 1 dividing dp x cp = 4" in first
    assert "need zero_stage 1 or 2" in stage3 and "got zero_stage 3" in stage3 and "got zero_stage 0" in stage0
    from megatron_core.training.arguments import build_parser, parse_args
    assert parse_args([]).num_distributed_optimizer_instances == 1  # Megatron's default
    assert "--num-distributed-optimizer-instances" in build_parser().format_help()
    with pytest.raises(SystemExit):
        parse_args(["--num-distributed-optimizer-instances", "2"])
    assert "needs the distributed optimizer: add --use-distributed-optimizer" in capsys.readouterr().err


def test_pretrain_dense_and_moe_match_one_process_and_resume_at_one_instance(distributed, tmp_path):
    """dp 4, N 2: the losses of the single-process run (fp32); the checkpoint at iteration 5 continues at N 1
    exactly as the uninterrupted N 2 run does (bit for bit here: the grads reduced over 2 x 2 ranks and over 4
    happen to sum the same)."""
    reference = distributed(1, test_pretrain._train, ["--train-iters", "8"])[0]
    partial = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    straight = distributed(4, test_pretrain._train, [*partial, "--train-iters", "8"])[0]
    torch.testing.assert_close(torch.tensor(straight), torch.tensor(reference), rtol=1e-5, atol=0)
    saved = distributed(4, test_pretrain._train, [*partial, "--train-iters", "8", "--save", str(tmp_path),
                                                  "--exit-interval", "5"])[0]
    assert saved == straight[:5]
    tensors = json.loads((tmp_path / "iter_0000005" / "metadata.json").read_text())["tensors"]
    assert any(name.startswith("optim/exp_avg_sq/") for name in tensors)  # saved once, by the first instance
    resumed = distributed(4, test_pretrain._train, ["--use-distributed-optimizer", "--load", str(tmp_path),
                                                    "--train-iters", "8"])[0]
    assert resumed == straight[5:]
    moe_reference = distributed(1, test_pretrain_moe._train, ["--train-iters", "4"])[0]
    for ep in ("1", "2"):  # expert states sharded over 2 expert-dp ranks per instance (ep 1) or 1 (ep 2)
        moe = distributed(4, test_pretrain_moe._train, [*partial, "--expert-model-parallel-size", ep,
                                                        "--train-iters", "4"])[0]
        torch.testing.assert_close(torch.tensor(moe), torch.tensor(moe_reference), rtol=1e-5, atol=0)
