"""NVMe optimizer offload (``optimizer_nvme_offload_dir``): 10 steps of the tiny GPT equal the in-memory run
bit for bit (dp 1 stage 0, dp 2 stages 1 and 2, fp32; bf16 against CPU offload); the live master and Adam state
bytes during a step stay within three chunks while the files hold all of them; a checkpoint of an offloaded run
resumes exactly; at ZeRO-3 with parameter offload (cpu, nvme) the run equals the in-memory one and no parameter
shard stays in memory between uses; bad folders raise ``ValueError`` naming the path."""
import os

import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.checkpointing import load_model_weights, read_metadata, save_checkpoint
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron_core.optimizer import OptimizerConfig, get_optimizer, memory_report
from megatron_core.optimizer.memory import memory_categories
from megatron_core.optimizer.offload import check_offload_dir, offload_parameters
from megatron_core.utils.live_memory import LiveMemoryTracker
from tests.model_helpers import VOCAB, build_model, make_batch, tiny_config

OPT = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.3)
CHUNK = 500  # elements: the tiny GPT's 5,632 parameters make 12 chunks at dp 1, 6 per rank at dp 2


def _setup(stage: int, *, nvme_dir=None, cpu_offload=False, dtype=torch.float32, param_offload="none",
           param_dir=None, host_adam="exact"):
    state = initialize_model_parallel()
    model = build_model(tiny_config(), state).to(dtype)
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(
        zero_stage=stage, bucket_size=2000, grad_reduce_in_fp32=True), dp_group=state.dp_group)
    offload_parameters(ddp, param_offload, directory=param_dir, rank=torch.distributed.get_rank()
                       if torch.distributed.is_initialized() else 0)
    config = OptimizerConfig(**OPT, bf16=dtype == torch.bfloat16, optimizer_cpu_offload=cpu_offload,
                             optimizer_nvme_offload_dir=nvme_dir, optimizer_nvme_chunk_elements=CHUNK,
                             optimizer_host_adam=host_adam, fused_adam=False)  # resident: per-op, as "exact"
    return state, model, ddp, get_optimizer(config, ddp, parallel_state=state)


def _train(state, ddp, optimizer, steps: range) -> list[float]:
    losses, rows = [], 4 // state.dp_size
    for step in steps:
        input_ids, positions, labels = make_batch(seed=step, batch=4)
        rank_rows = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
        optimizer.zero_grad()
        loss = ddp(input_ids[rank_rows], positions[rank_rows], labels=labels[rank_rows]).float().mean()
        loss.backward()
        finalize_model_grads([ddp], state)
        assert optimizer.step()[0]
        losses.append(loss.item())
    return losses


def train(stage: int, steps: int = 10, **kwargs):
    state, _, ddp, optimizer = _setup(stage, **kwargs)
    losses = _train(state, ddp, optimizer, range(steps))
    return losses, {k: v.float() for k, v in ddp.state_dict().items()}


@pytest.mark.parametrize("dp,stage", [(1, 0), (2, 1), (2, 2)])
def test_nvme_offload_equals_in_memory(distributed, tmp_path, dp, stage):
    nvme = distributed(dp, train, stage, nvme_dir=str(tmp_path))
    resident = distributed(dp, train, stage)
    for (losses, params), (ref_losses, ref_params) in zip(nvme, resident):
        assert losses == ref_losses
        assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)
    assert not os.listdir(tmp_path)  # the per-rank files are removed with the optimizer


def test_nvme_offload_bf16_equals_cpu_offload(distributed, tmp_path):
    nvme = distributed(2, train, 1, steps=4, nvme_dir=str(tmp_path), dtype=torch.bfloat16)
    host = distributed(2, train, 1, steps=4, cpu_offload=True, dtype=torch.bfloat16)
    for (losses, params), (ref_losses, ref_params) in zip(nvme, host):
        assert losses == ref_losses and all(torch.equal(params[k], ref_params[k]) for k in ref_params)


def test_fused_host_adam_is_close(distributed, tmp_path):
    """The fused kernel orders its arithmetic differently: within fp32 rounding of the exact run, not equal."""
    resident = distributed(1, train, 0, steps=4)
    for kwargs in (dict(nvme_dir=str(tmp_path)), dict(cpu_offload=True)):
        (losses, params), = distributed(1, train, 0, steps=4, host_adam="fused", **kwargs)
        (ref_losses, ref_params), = resident
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
        for key in ref_params:
            torch.testing.assert_close(params[key], ref_params[key], rtol=0, atol=2e-5)  # 4 steps at lr 1e-2


def test_nvme_states_are_not_in_memory(tmp_path):
    state, model, ddp, optimizer = _setup(0, nvme_dir=str(tmp_path))
    _train(state, ddp, optimizer, range(1))
    numel = sum(p.model.numel() for p in optimizer.pieces)
    files = optimizer.optimizer.files
    assert files.file_bytes() == 3 * numel * 4  # masters, exp_avg, exp_avg_sq: all of them on disk
    chunk_bytes = 3 * CHUNK * 4
    assert numel > 10 * CHUNK  # in memory they would be > 10 chunks, far above the bound below
    with LiveMemoryTracker(categories=lambda: memory_categories(ddp, optimizer)) as tracker:
        _train(state, ddp, optimizer, range(1, 3))
    live = tracker.peak_by_category["master_weights"] + tracker.peak_by_category["optimizer_states"]
    assert 0 < live <= 3 * chunk_bytes, f"{live} live state bytes, 3 chunks are {3 * chunk_bytes}"
    report = memory_report(ddp, optimizer, tracker=tracker)
    assert report.master_weights == report.optimizer_states == 0
    assert report.nvme_master_weights == numel * 4 and report.nvme_optimizer_states == 2 * numel * 4
    assert report.tiers["optimizer_states"] == "nvme" and report.tiers["parameters"] == "cpu"
    in_memory = _setup(0)
    _train(in_memory[0], in_memory[2], in_memory[3], range(1))
    assert memory_report(in_memory[2], in_memory[3]).optimizer_states > 3 * chunk_bytes


def resume(stage: int, ckpt: str, nvme_dir: str, *, save_offloaded: bool = True):
    """5 steps, checkpoint, 5 more; a fresh NVMe-offloaded run loads the checkpoint and repeats the last 5."""
    state, model, ddp, optimizer = _setup(stage, nvme_dir=nvme_dir if save_offloaded else None)
    _train(state, ddp, optimizer, range(5))
    save_checkpoint(ckpt, iteration=5, model_chunks=[ddp], config=model.config, state=state,
                    true_vocab_size=VOCAB, consumed_samples=20, optimizer=optimizer)
    expected = _train(state, ddp, optimizer, range(5, 10))
    state, model, ddp, optimizer = _setup(stage, nvme_dir=nvme_dir)
    folder, metadata = read_metadata(ckpt)
    load_model_weights(folder, metadata, model_chunks=[ddp], config=model.config, state=state,
                       optimizer=optimizer)
    return expected, _train(state, ddp, optimizer, range(5, 10))


@pytest.mark.parametrize("dp,stage,save_offloaded", [(1, 0, True), (2, 1, True), (1, 0, False)])
def test_nvme_checkpoint_resume_is_exact(distributed, tmp_path, dp, stage, save_offloaded):
    """(1, 0, False): an in-memory fp32 run's checkpoint (no masters: they were the model storage) resumes
    exactly with NVMe offload."""
    for expected, resumed in distributed(dp, resume, stage, str(tmp_path / "ckpt"), str(tmp_path / "nvme"),
                                         save_offloaded=save_offloaded):
        assert expected == resumed


def test_bad_offload_dir_names_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="a_file"):
        check_offload_dir(str(blocker / "sub"), needed_bytes=1)
    with pytest.raises(ValueError, match="GiB free"):
        check_offload_dir(str(tmp_path), needed_bytes=1 << 60)
    readonly = tmp_path / "ro"
    readonly.mkdir()
    os.chmod(readonly, 0o500)
    if not os.access(readonly, os.W_OK):  # root ignores permissions
        with pytest.raises(ValueError, match="permissions"):
            check_offload_dir(str(readonly), needed_bytes=1)
    with pytest.raises(ValueError, match="optimizer='adam'"):
        OptimizerConfig(optimizer="sgd", optimizer_nvme_offload_dir=str(tmp_path))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_zero3_param_offload_equals_in_memory(distributed, tmp_path, tier):
    offloaded = distributed(2, train, 3, param_offload=tier, param_dir=str(tmp_path / "p"),
                            nvme_dir=str(tmp_path / "o") if tier == "nvme" else None)
    resident = distributed(2, train, 3)
    for (losses, params), (ref_losses, ref_params) in zip(offloaded, resident):
        assert losses == ref_losses and all(torch.equal(params[k], ref_params[k]) for k in ref_params)


def param_memory(tier: str, param_dir: str):
    """The live device bytes of parameter shards during forward/backward and between steps."""
    state, model, ddp, optimizer = _setup(3, param_offload=tier, param_dir=param_dir)
    shards = sorted((b.shard_size * b.kind.param_dtype.itemsize for b in ddp.buckets), reverse=True)
    _train(state, ddp, optimizer, range(1))
    input_ids, positions, labels = make_batch(seed=1, batch=4)
    with LiveMemoryTracker(categories=lambda: memory_categories(ddp, optimizer)) as tracker:
        ddp(input_ids[:2], positions[:2], labels=labels[:2]).mean().backward()
    between = sum(b.param_shard.untyped_storage().nbytes() for b in ddp.buckets)
    report = memory_report(ddp, optimizer)
    return tracker.peak_by_category["parameters"], between, shards, report.tiers["parameters"]


def test_zero3_param_offload_frees_shards(distributed, tmp_path):
    for peak, between, shards, tier in distributed(2, param_memory, "nvme", str(tmp_path)):
        assert between == 0 and tier == "nvme"
        assert peak <= sum(shards[:2]) < sum(shards), f"{peak} live shard bytes, all shards {sum(shards)}"


def norm_after(stage: int, **kwargs) -> float:
    state, _, ddp, optimizer = _setup(stage, **kwargs)
    _train(state, ddp, optimizer, range(2))
    return optimizer.params_norm()


def test_params_norm_with_offload(distributed, tmp_path):
    """``--log-params-norm`` reads the masters; with NVMe states they are in files, with parameter offload the
    shards are freed between uses."""
    reference = distributed(2, norm_after, 3)
    for kwargs in (dict(nvme_dir=str(tmp_path / "o")), dict(nvme_dir=str(tmp_path / "o"), param_offload="nvme",
                                                             param_dir=str(tmp_path / "p"))):
        assert distributed(2, norm_after, 3, **kwargs) == reference


def test_reads_and_writes_overlap_the_update(tmp_path):
    """The read of chunk i+1 and the write of chunk i-1 run (on the pool) while chunk i is updated."""
    import threading
    import time
    from types import SimpleNamespace

    from megatron_core.optimizer.offload import NvmeAdam
    pieces = [SimpleNamespace(model=torch.randn(1000), master_grad=torch.randn(1000), decay=True)]
    adam = NvmeAdam(pieces, directory=str(tmp_path), rank=0, chunk_elements=100, lr=1e-3, betas=(0.9, 0.999),
                    eps=1e-8, weight_decay=0.0)
    events, lock = [], threading.Lock()

    def traced(kind, fn):
        def run(chunk, *args):
            with lock:
                events.append((kind, chunk.start // 100, "start"))
            time.sleep(0.01)
            fn(chunk, *args)
            with lock:
                events.append((kind, chunk.start // 100, "end"))
        return run

    adam._read, adam._write, adam._update = (traced("read", adam._read), traced("write", adam._write),
                                             traced("update", adam._update))
    adam.step()
    at = {event: i for i, event in enumerate(events)}
    for i in range(1, 9):
        assert at[("read", i + 1, "start")] < at[("update", i, "end")]  # read of i+1 during update of i
        assert at[("read", i + 1, "end")] > at[("update", i, "start")]
        assert at[("write", i - 1, "end")] > at[("update", i, "start")]  # write of i-1 still running then
    assert at[("write", 9, "end")] < len(events)
