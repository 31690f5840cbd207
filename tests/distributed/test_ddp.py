"""DistributedDataParallel: buckets overlap backward, ZeRO-3 gathers/frees around modules (tied parameters, a
module used twice, state_dict export), shards shrink memory, and the fp16 loss scaler skips and recovers."""
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_core import initialize_model_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron_core.optimizer import OptimizerConfig, get_optimizer, memory_report
from tests.distributed.test_optimizer_parity import OPT, Net, net_batch, reference_adamw


def _overlap_events(stage: int, p2p_collectives=None):
    """Records collectives and the input's grad (computed last in backward) in the order they happen."""
    state = initialize_model_parallel()
    torch.manual_seed(0)
    config = DistributedDataParallelConfig(zero_stage=stage, bucket_size=100,
                                           p2p_collectives=p2p_collectives)
    ddp = DistributedDataParallel(Net(), config=config, dp_group=state.dp_group)
    events = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single", "isend")}

    def recorder(name):
        def call(*args, **kwargs):
            events.append((name, kwargs.get("async_op", False)))
            return originals[name](*args, **kwargs)
        return call

    x, y = net_batch(0)
    x.requires_grad_(True)
    x.register_hook(lambda grad: events.append(("input_grad", None)))
    try:
        for name in originals:
            setattr(dist, name, recorder(name))
        F.mse_loss(ddp(x), y).backward()
        events.append(("backward_returned", None))
        ddp.finish_grad_sync()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return events, ddp.launch_log, len(ddp.buckets)


def test_first_bucket_collective_launched_before_backward_finishes(distributed):
    # ZeRO-1 reduce-scatters too (Megatron's distributed optimizer); on gloo, by default, point to point (one
    # isend per bucket at dp 2)
    for stage, p2p, collective in ((0, None, "all_reduce"), (1, False, "reduce_scatter_single"),
                                   (2, False, "reduce_scatter_single"), (1, None, "isend"), (2, None, "isend")):
        events, launch_log, num_buckets = distributed(2, _overlap_events, stage, p2p)[0]
        names = [name for name, _ in events]
        assert num_buckets >= 3 and launch_log == list(range(num_buckets))
        first = names.index(collective)
        assert first < names.index("input_grad") < names.index("backward_returned"), names
        if collective != "isend":  # (isend is asynchronous by nature)
            assert events[first][1] is True  # asynchronous: backward continues while it runs
        assert names.count(collective) == num_buckets


# ------------------------------------------------------------------------------------------------------------
class TiedNet(nn.Module):
    """Embedding and output layer share one weight; ``block`` runs twice in each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block, self.norm = nn.Embedding(12, 8), nn.Linear(8, 8), nn.LayerNorm(8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        hidden = self.embed(ids)
        hidden = self.block(torch.tanh(self.block(hidden)))
        return self.head(self.norm(hidden))


def _tied_loss(model, step, rows=slice(None)):
    g = torch.Generator().manual_seed(step)
    ids, labels = torch.randint(0, 12, (8,), generator=g), torch.randint(0, 12, (8,), generator=g)
    return F.cross_entropy(model(ids[rows]), labels[rows])


def _train_tied(stage: int):
    state = initialize_model_parallel()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TiedNet(), config=DistributedDataParallelConfig(zero_stage=stage),
                                  dp_group=state.dp_group)
    optimizer = get_optimizer(OptimizerConfig(**OPT), ddp, parallel_state=state)
    rows = 8 // state.dp_size
    released = []
    for step in range(5):
        optimizer.zero_grad()
        for i in range(2):
            lo = state.dp_rank * rows + i * rows // 2
            with ddp.no_sync() if i == 0 else contextlib.nullcontext():
                (_tied_loss(ddp, step, slice(lo, lo + rows // 2)) / 2).backward()
            released.append(all(p.numel() == 0 for p in ddp.module.parameters()))
        finalize_model_grads([ddp], state)
        assert optimizer.step()[0]
    return ddp.state_dict(), all(released), memory_report(ddp, optimizer)


def test_zero3_tied_parameters_and_module_used_twice(distributed):
    torch.manual_seed(0)
    reference, _ = reference_adamw(TiedNet(), _tied_loss)
    (ref_params, ref_released, ref_report), = distributed(1, _train_tied, 0)
    assert not ref_released
    for params, released, report in distributed(2, _train_tied, 3):
        assert released  # every parameter is freed outside forward and backward
        assert params.keys() == reference.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5)
        # 1/dp of the parameters (up to padding) and of the grads, masters alias the fp32 shards
        assert report.parameters <= ref_report.parameters / 2 + 4 * 8
        assert report.optimizer_states <= ref_report.optimizer_states / 2 + 8 * 8


def _load_and_export(stage: int):
    state = initialize_model_parallel()
    torch.manual_seed(dist.get_rank())  # different weights per rank: load_state_dict makes them equal
    ddp = DistributedDataParallel(Net(), config=DistributedDataParallelConfig(zero_stage=stage),
                                  dp_group=state.dp_group)
    torch.manual_seed(7)
    ddp.load_state_dict(Net().state_dict())
    x, _ = net_batch(0)
    with torch.no_grad():
        return ddp(x), ddp.state_dict()


def test_state_dict_round_trip_at_stage3(distributed):
    torch.manual_seed(7)
    reference = Net()
    x, _ = net_batch(0)
    for output, state in distributed(2, _load_and_export, 3):
        torch.testing.assert_close(output, reference(x).detach())
        for name, value in reference.state_dict().items():
            assert torch.equal(state[name], value)


# ------------------------------------------------------------------------------------------------------------
def _fp16_scaler(hysteresis: int):
    state = initialize_model_parallel()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net().half(), config=DistributedDataParallelConfig(zero_stage=1),
                                  dp_group=state.dp_group)
    config = OptimizerConfig(**OPT, fp16=True, initial_loss_scale=2.0 ** 10, loss_scale_window=2,
                             hysteresis=hysteresis)
    optimizer = get_optimizer(config, ddp, parallel_state=state)
    history = []
    for step in range(6):
        x, y = net_batch(step)
        if step in (1, 2) and state.dp_rank == 0:
            x[0, 0] = float("inf")  # an overflow on one rank must skip the step on all
        before = [p.detach().clone() for p in ddp.module.parameters()]
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(x.half()).float(), y)
        optimizer.scale_loss(loss).backward()
        finalize_model_grads([ddp], state)
        ok, norm, _ = optimizer.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, ddp.module.parameters()))
        history.append((ok, norm is None, unchanged, float(optimizer.get_loss_scale())))
    return history


def test_fp16_overflow_skips_and_backs_off_then_grows(distributed):
    h1 = distributed(2, _fp16_scaler, 1)
    assert h1[0] == h1[1]
    # step 0 fine; 1 and 2 overflow (skip, params unchanged, scale halved each time); 3, 4 fine -> doubled
    assert [(ok, none, same) for ok, none, same, _ in h1[0]] == [
        (True, False, False), (False, True, True), (False, True, True), (True, False, False),
        (True, False, False), (True, False, False)]
    assert [scale for *_, scale in h1[0]] == [1024.0, 512.0, 256.0, 256.0, 512.0, 512.0]
    h2 = distributed(2, _fp16_scaler, 2)[0]  # hysteresis 2: the first overflow keeps the scale
    assert [scale for *_, scale in h2] == [1024.0, 1024.0, 512.0, 512.0, 1024.0, 1024.0]


# ------------------------------------------------------------------------------------------------------------
def _overlapped_param_gather(stage: int):
    """Trains with overlap_param_gather: after each step the gather is pending until the next forward."""
    state = initialize_model_parallel()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), config=DistributedDataParallelConfig(
        zero_stage=stage, bucket_size=100, overlap_param_gather=True), dp_group=state.dp_group)
    optimizer = get_optimizer(OptimizerConfig(**OPT), ddp, parallel_state=state)
    pending_after_step, pending_after_forward = [], []
    for step in range(4):
        x, y = net_batch(step)
        rows = x.shape[0] // state.dp_size
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(x[state.dp_rank * rows:(state.dp_rank + 1) * rows]),
                          y[state.dp_rank * rows:(state.dp_rank + 1) * rows])
        pending_after_forward.append(any(b.param_sync_pending for b in ddp.buckets))
        loss.backward()
        finalize_model_grads([ddp], state)
        assert optimizer.step()[0]
        pending_after_step.append(all(b.param_sync_pending for b in ddp.buckets))
    return ddp.state_dict(), pending_after_step, pending_after_forward


def test_overlap_param_gather_waits_in_the_next_forward(distributed):
    torch.manual_seed(0)
    reference, _ = reference_adamw(Net(), lambda model, step: F.mse_loss(model(net_batch(step)[0]), net_batch(step)[1]),
                                   steps=4)
    for stage in (1, 2):
        for params, after_step, after_forward in distributed(2, _overlapped_param_gather, stage):
            assert all(after_step) and not any(after_forward)  # started by the step, finished by the forward
            for name, value in params.items():
                torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5)


def test_overlap_param_gather_needs_the_distributed_optimizer():
    import pytest
    with pytest.raises(ValueError, match="overlap_param_gather=True needs the distributed optimizer"):
        DistributedDataParallelConfig(zero_stage=0, overlap_param_gather=True)


def test_default_buckets_let_a_small_model_overlap():
    """Megatron's 40M-element default would put a 4M-parameter model in one bucket (nothing to overlap)."""
    model = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(4)])
    for stage in (0, 1, 2):
        ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=stage), dp_group=None)
        assert len(ddp.buckets) >= 4, (stage, len(ddp.buckets))


def test_a_dropped_wrapper_frees_its_model_and_process_groups():
    """The grad hooks live in the parameters' C++ grad accumulators, out of the garbage collector's sight: they
    must not hold the wrapper, or every wrapped model (and its gloo groups, three threads each) lives forever."""
    import gc
    import weakref

    from tests.model_helpers import build_model, tiny_config
    state = initialize_model_parallel()
    model = DistributedDataParallel(build_model(tiny_config(), state), config=DistributedDataParallelConfig(),
                                    dp_group=state.dp_group)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------------------------------------------------------
def _gathers_in_the_step(stage: int) -> int:
    """How many all-gathers one optimizer step issues at ``stage`` (dp 2)."""
    state = initialize_model_parallel()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), config=DistributedDataParallelConfig(zero_stage=stage, bucket_size=100),
                                  dp_group=state.dp_group)
    optimizer = get_optimizer(OptimizerConfig(**OPT), ddp, parallel_state=state)
    x, y = net_batch(0)
    F.mse_loss(ddp(x), y).backward()
    finalize_model_grads([ddp], state)
    from megatron_core.distributed.param_and_grad_buffer import Bucket
    original, calls = Bucket._all_gather, []
    Bucket._all_gather = lambda self, shard: calls.append(1) or original(self, shard)
    try:
        assert optimizer.step()[0]
    finally:
        Bucket._all_gather = original
    return len(calls)


def test_only_the_distributed_optimizer_gathers_parameters_after_its_step(distributed):
    """Stage 0 updates whole parameters on every rank from the same all-reduced grads: nothing to gather (it
    all-gathered every bucket before, 8 ms of a 130 ms dp 2 step in scripts/benchmark.py)."""
    assert distributed(2, _gathers_in_the_step, 0) == [0, 0]
    gathers = distributed(2, _gathers_in_the_step, 1)
    assert gathers[0] == gathers[1] >= 3


class _SometimesUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.sometimes = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_both: bool):
        return self.sometimes(self.used(x)) if use_both else self.used(x)


def _grads_of_an_unused_parameter(stage: int):
    """Step 1 gives every parameter a grad; step 2 leaves ``sometimes`` out: its grad slot must read zero (the
    buffers are zeroed lazily, so the slot still holds step 1's grad unless something zeros it)."""
    state = initialize_model_parallel()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_SometimesUnused(), config=DistributedDataParallelConfig(zero_stage=stage,
                                  bucket_size=16), dp_group=state.dp_group)  # a bucket per linear layer
    x = torch.randn(3, 4)
    seen = []
    for use_both in (True, False, True):
        ddp.zero_grad_buffer()
        for micro in range(2):  # accumulation: the second micro-batch adds to the first one's grads
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                ddp(x, use_both).square().sum().backward()
        ddp.finish_grad_sync()
        if stage >= 2:  # the grads live in this rank's shard of each bucket
            seen.append([torch.cat([b.grad_shard.clone() for b in ddp.buckets
                                    if any(p is module.weight for p in b.params)])
                         for module in (ddp.module.sometimes, ddp.module.used)])
        else:
            seen.append([ddp.module.sometimes.weight.main_grad.clone(), ddp.module.used.weight.main_grad.clone()])
    return seen


def test_lazily_zeroed_grad_buffers_read_zero_for_parameters_without_a_grad(distributed):
    for stage in (0, 1, 2, 3):
        (first, second, third), _ = distributed(2, _grads_of_an_unused_parameter, stage)
        assert first[0].abs().sum() > 0 and torch.equal(second[0], torch.zeros_like(second[0])), stage
        torch.testing.assert_close(third[0], first[0], rtol=0, atol=0)  # accumulation starts from zero again
        torch.testing.assert_close(third[1], first[1], rtol=0, atol=0)


def _reduce_scatter_targets(stage: int):
    """(output is the rank's slice of the bucket's own storage, output numel) of each native reduce-scatter."""
    state = initialize_model_parallel()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), config=DistributedDataParallelConfig(
        zero_stage=stage, bucket_size=100, p2p_collectives=False), dp_group=state.dp_group)
    original, seen = dist.reduce_scatter_single, []

    def record(output, input, *args, **kwargs):
        same = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        offset = (output.data_ptr() - input.data_ptr()) // output.element_size()
        seen.append((same and offset == state.dp_rank * output.numel(), output.numel()))
        return original(output, input, *args, **kwargs)

    x, y = net_batch(0)
    dist.reduce_scatter_single = record
    try:
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
    finally:
        dist.reduce_scatter_single = original
    return seen


def test_native_reduce_scatter_writes_into_the_buckets_own_shard(distributed):
    """ZeRO 1-2 on NCCL's path reduce-scatter each bucket in place, into this rank's slice of the bucket (as
    Megatron-LM does): no receive buffer of a shard's size per bucket in flight (a 70B dry run held seven,
    0.4 GiB, at its peak before)."""
    for stage in (1, 2):
        for seen in distributed(2, _reduce_scatter_targets, stage):
            assert seen and all(in_place for in_place, _ in seen), seen
