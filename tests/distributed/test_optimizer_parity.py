"""Data parallelism + optimizer parity: for ZeRO stages 0-3 at dp 2 and 4 (and dp 2 x tp 2 with the tiny GPT),
5 AdamW steps with weight decay, clipping and 2 accumulated micro-batches equal single-process
``torch.optim.AdamW`` on the full batch; bf16 stays close to fp32 with fp32 masters; offload equals no
offload; the fp16 loss scaler skips, backs off and grows."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_core import initialize_model_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron_core.optimizer import OptimizerConfig, get_optimizer, memory_report
from tests.model_helpers import build_model, make_batch, tiny_config, unshard

STEPS, MICRO, BATCH = 5, 2, 8
OPT = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.3)
LARGEST_DIFF: dict[str, float] = {}  # printed at the end of the module (pytest -s)


class Net(nn.Module):
    """A few layers with 2-D weights (decayed) and 1-D biases / norm weights (not decayed)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2, self.head = (nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 32),
                                                    nn.Linear(32, 4))

    def forward(self, x):
        return self.head(F.gelu(self.fc2(F.gelu(self.norm(self.fc1(x))))))


def net_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def reference_adamw(model: nn.Module, loss_fn, steps: int = STEPS):
    """Single-process AdamW on the full batch with Megatron's param groups (no decay on 1-D params)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPT["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=OPT["lr"])
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(model, step).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, OPT["clip_grad"])))
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _net_loss(model, step):
    x, y = net_batch(step)
    return F.mse_loss(model(x), y)


def train_net(stage: int, *, dtype=torch.float32, offload=False, bucket_size=200, steps=STEPS, lr=OPT["lr"],
              fused_adam=True, native_collectives=False):
    """Runs on every rank: dp = world size; each rank takes its BATCH/dp rows in MICRO micro-batches."""
    state = initialize_model_parallel()
    torch.manual_seed(0)
    model = Net().to(dtype)
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(
        zero_stage=stage, bucket_size=bucket_size, grad_reduce_in_fp32=True,
        p2p_collectives=False if native_collectives else None), dp_group=state.dp_group)
    config = OptimizerConfig(**{**OPT, "lr": lr}, bf16=dtype == torch.bfloat16, optimizer_cpu_offload=offload,
                             fused_adam=fused_adam)
    optimizer = get_optimizer(config, ddp, parallel_state=state)
    norms = []
    for step in range(steps):
        x, y = net_batch(step)
        rows = BATCH // state.dp_size
        x, y = x[state.dp_rank * rows:(state.dp_rank + 1) * rows], y[state.dp_rank * rows:(state.dp_rank + 1) * rows]
        optimizer.zero_grad()
        for i, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
            with ddp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                (F.mse_loss(ddp(xm.to(dtype)).float(), ym) / MICRO).backward()
        finalize_model_grads([ddp], state)
        ok, norm, _ = optimizer.step()
        assert ok
        norms.append(norm)
    masters_fp32 = all(p.master.dtype == torch.float32 for p in optimizer.pieces)
    report = memory_report(ddp, optimizer)
    return {k: v.float() for k, v in ddp.state_dict().items()}, norms, masters_fp32, report


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


KEY_BIAS_TOLERANCE = 1e-4
"""The key rows of ``linear_qkv.bias`` against the reference. Adding a constant to every key changes every score
of a query by the same ``q . b_k``, which the softmax cancels: their exact gradient is zero, so what backward
computes for them is rounding noise (~1e-9 here) that depends on the order of each sum, and AdamW divides it by
its own root mean square (``m / (sqrt(v) + eps)``), turning noise into updates up to ``lr``. On a Zen 4 CPU the
same reference run with 1 thread instead of 2 moves them by 3.5e-6 while every other parameter moves under 4e-7;
a tp 2 x dp 2 Muon run moves them 1.1-2.2e-5 against under 1.6e-6 elsewhere. They are held to 1e-4 (1% of lr),
the rest to the tests' own tolerances."""


def gpt_parity_diffs(full: dict, reference: dict, config) -> tuple[float, float]:
    """(largest difference over every parameter but the key-bias rows, largest over those rows): ``full`` and
    ``reference`` are the unsharded state dicts of a GPT built from ``config`` (``linear_qkv`` rows in
    ``num_query_groups`` blocks of ``[q of the group's heads, k, v] x kv_channels``)."""
    assert full.keys() == reference.keys()
    key = config.num_heads_per_group  # the key's block follows the group's query heads
    rest = key_rows = 0.0
    for name in full:
        diff = (full[name].float() - reference[name].float()).abs()
        if name.endswith("linear_qkv.bias"):
            blocks = diff.view(config.num_query_groups, key + 2, config.kv_channels)
            key_rows = max(key_rows, blocks[:, key].max().item())
            blocks[:, key] = 0.0  # a view of diff: the rest is then diff's max
        rest = max(rest, diff.max().item())
    return rest, key_rows


@pytest.fixture(scope="module")
def net_reference():
    torch.manual_seed(0)
    return reference_adamw(Net(), _net_loss)


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage,native", [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True),
                                          (3, True)])
def test_fp32_stages_match_adamw(distributed, net_reference, dp, stage, native):
    """Default on gloo: reduce-scatters and all-gathers as isend/irecv batches; native: gloo's own (NCCL's
    path)."""
    ref_params, ref_norms = net_reference
    results = distributed(dp, train_net, stage, native_collectives=native)
    diff = max(_max_diff(params, ref_params) for params, *_ in results)
    LARGEST_DIFF[f"net dp={dp} stage={stage}"] = diff
    assert diff <= 1e-5, f"stage {stage} dp {dp}: largest parameter difference {diff:.3e}"
    for _, norms, _, _ in results:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)


def test_bf16_close_to_fp32_with_fp32_masters(distributed):
    # lr 1e-3: with Adam, an element whose grad is ~0 moves by +-lr per step whichever its sign, so at a large
    # lr bf16 rounding noise alone can move it 2 * lr * steps away from fp32.
    for stage in (0, 3):
        fp32 = distributed(2, train_net, stage, lr=1e-3)
        bf16 = distributed(2, train_net, stage, dtype=torch.bfloat16, lr=1e-3)
        for (params, _, masters_fp32, _), (ref_params, *_) in zip(bf16, fp32):
            assert masters_fp32 and all(v.dtype == torch.float32 for v in ref_params.values())
            diff = _max_diff(params, ref_params)
            LARGEST_DIFF[f"net bf16 vs fp32 dp=2 stage={stage}"] = diff
            assert diff <= 2e-2


def test_offload_equals_no_offload(distributed):
    for stage in (0, 2):
        offloaded = distributed(2, train_net, stage, dtype=torch.bfloat16, offload=True, steps=2)
        resident = distributed(2, train_net, stage, dtype=torch.bfloat16, offload=False, steps=2,
                               fused_adam=False)  # the per-op update, as the exact host Adam
        for (a, *_, report), (b, *_) in zip(offloaded, resident):
            assert report.offloaded and _max_diff(a, b) == 0.0


# ------------------------------------------------------------------------------------------------------------
# dp 2 x tp 2: the tiny GPT with sequence parallelism (SP-tagged norm weights) and tied embeddings
def _gpt_loss(model, step, rows=slice(None)):
    input_ids, positions, labels = make_batch(seed=step, batch=4)
    return model(input_ids[rows], positions[rows], labels=labels[rows]).mean()


def train_gpt(stage: int, tp: int):
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    model = build_model(tiny_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1), state)
    dims = {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None, p.partition_stride)
            for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=stage, bucket_size=500),
                                  dp_group=state.dp_group)
    optimizer = get_optimizer(OptimizerConfig(**OPT), ddp, parallel_state=state)
    train_gpt_steps(ddp, optimizer, state)
    return {n: (t, *dims[n]) for n, t in ddp.state_dict().items() if n in dims}


def train_gpt_steps(ddp, optimizer, state, steps: int = STEPS) -> None:
    """``steps`` steps on this dp rank's rows of each 4-row batch, in MICRO accumulated micro-batches."""
    rows = 4 // state.dp_size
    for step in range(steps):
        optimizer.zero_grad()
        for i in range(MICRO):
            lo = state.dp_rank * rows + i * rows // MICRO
            with ddp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                (_gpt_loss(ddp, step, slice(lo, lo + rows // MICRO)) / MICRO).backward()
        finalize_model_grads([ddp], state)
        assert optimizer.step()[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_dp2_tp2_matches_adamw(distributed, stage):
    reference, _ = reference_adamw(build_model(tiny_config(), initialize_model_parallel()), _gpt_loss)
    results = distributed(4, train_gpt, stage, 2)
    tp_group = [results[0], results[1]]  # ranks 0, 1: tp shards of dp rank 0 (ranks 2, 3: dp rank 1)
    full = {n: unshard([r[n][0] for r in tp_group], tp_group[0][n][1], tp_group[0][n][2]) for n in results[0]}
    diff, key_bias = gpt_parity_diffs(full, {n: reference[n] for n in full}, tiny_config())
    LARGEST_DIFF[f"gpt dp=2 tp=2 stage={stage}"] = diff
    LARGEST_DIFF[f"gpt dp=2 tp=2 stage={stage}, key-bias rows"] = key_bias
    for other in results[2:]:
        assert all(torch.equal(other[n][0], results[other is results[3]][n][0]) for n in other)
    assert diff <= 5e-6, f"stage {stage}: largest parameter difference {diff:.3e}"
    assert key_bias <= KEY_BIAS_TOLERANCE, f"stage {stage}: largest key-bias difference {key_bias:.3e}"


def teardown_module(module):
    for name, diff in LARGEST_DIFF.items():
        print(f"largest |param - AdamW reference| {name}: {diff:.2e}")
