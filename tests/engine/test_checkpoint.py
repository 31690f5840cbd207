"""Engine checkpoints: saved at step 3 at dp 2 and resumed in other processes at another dp size and ZeRO
stage, the losses equal the uninterrupted run's; DeepSpeed's folder layout (``latest``, ``global_step3``);
safetensors + JSON only (loading unpickles nothing); client_state round-trips; bad input names the problem."""
import errno
import json
import os
import pickle

import pytest
import torch

from megatron_core import engine as deepspeed
from megatron_core.checkpointing.publication import CheckpointSaveError
from megatron_core.engine import checkpoint
from tests.engine.common import MODELS, ds_config, full_state, train_steps

STEPS, SAVE_AT = 6, 3


def _config(stage):
    return {**ds_config(stage), "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": STEPS, "warmup_num_steps": 2, "warmup_max_lr": 1e-2}}}


def _engine(stage, kind="gpt2"):
    model = MODELS[kind]()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    return engine


def _uninterrupted(stage):
    return train_steps(_engine(stage), "gpt2", range(STEPS))


def _save(stage, save_dir):
    engine = _engine(stage)
    losses = train_steps(engine, "gpt2", range(SAVE_AT))
    client = {"epoch": 1, "note": "x", "best": [0.5, None], "mask": torch.arange(4), "nested": {"t": torch.ones(2)}}
    engine.save_checkpoint(save_dir, client_state=client)
    return losses, full_state(engine)


def _resume(stage, save_dir, *, tag=None, optimizer_states=True):
    engine = _engine(stage)
    real_loads, real_torch_load = pickle.loads, torch.load

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")
    pickle.loads, torch.load = refuse, refuse
    try:
        path, client = engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=optimizer_states)
    finally:
        pickle.loads, torch.load = real_loads, real_torch_load
    loaded = full_state(engine)
    counters = (engine.global_steps, engine.skipped_steps, engine.get_lr()[0], engine.lr_scheduler.last_batch_iteration)
    return path, client, loaded, counters, train_steps(engine, "gpt2", range(SAVE_AT, STEPS))


def test_resume_at_another_dp_size_and_stage_equals_the_uninterrupted_run(distributed, tmp_path):
    expected = distributed(2, _uninterrupted, 1)[0]
    save_dir = str(tmp_path / "checkpoints")
    first, saved_state = distributed(2, _save, 2, save_dir)[0]
    assert first == pytest.approx(expected[:SAVE_AT], abs=1e-5)
    assert open(os.path.join(save_dir, "latest")).read() == "global_step3"
    files = sorted(os.listdir(os.path.join(save_dir, "global_step3")))
    assert files == ["client.safetensors", "engine.json", "model.safetensors", "optim.safetensors"]
    assert not [f for f in os.listdir(save_dir) if f.startswith(".")]  # no partial folder left
    for world, stage in ((1, 3), (2, 0)):  # dp 1 in the one-rank pool's process: not the processes that saved
        path, client, loaded, counters, rest = distributed(world, _resume, stage, save_dir)[0]
        assert path == os.path.join(save_dir, "global_step3")
        assert rest == pytest.approx(expected[SAVE_AT:], abs=1e-5), (world, stage)
        for name, value in saved_state.items():
            assert torch.equal(loaded[name], value), name
        assert counters[:2] == (SAVE_AT, 0) and counters[3] == SAVE_AT - 1
        assert client["epoch"] == 1 and client["best"] == [0.5, None] and client["note"] == "x"
        assert torch.equal(client["mask"], torch.arange(4)) and torch.equal(client["nested"]["t"], torch.ones(2))
    # without the optimizer states: the same weights, fresh Adam moments, so the run continues differently
    _, _, loaded, _, rest = distributed(2, _resume, 1, save_dir, tag="global_step3", optimizer_states=False)[0]
    assert all(torch.equal(loaded[name], value) for name, value in saved_state.items())
    assert rest != pytest.approx(expected[SAVE_AT:], abs=1e-4)


def _save_twice_and_bad_inputs(save_dir):
    engine = _engine(0, "sequential")
    train_steps(engine, "sequential", range(1))
    engine.save_checkpoint(save_dir, tag="mine")
    train_steps(engine, "sequential", range(1, 2))
    engine.save_checkpoint(save_dir, tag="mine")  # the same tag again replaces it
    errors = {}
    for name, call in (("tag", lambda: engine.save_checkpoint(save_dir, tag="../escape")),
                       ("client", lambda: engine.save_checkpoint(save_dir, client_state={"f": open}))):
        try:
            call()
        except Exception as error:  # noqa: BLE001 - the test compares the errors
            errors[name] = f"{type(error).__name__}: {error}"
    errors["disk"] = _failing_save(engine, save_dir)
    missing = engine.load_checkpoint(os.path.join(save_dir, "nowhere"))
    with open(os.path.join(save_dir, "mine", "engine.json")) as handle:
        meta = json.load(handle)
    return errors, missing, meta["global_steps"], sorted(os.listdir(save_dir))


def _failing_save(engine, save_dir):
    """Rank 0's disk fills up in the middle of the model file: every rank raises, nothing is published."""
    real_write = checkpoint.StreamingSafetensorsWriter.write

    def full_disk(writer, name, tensor):
        raise OSError(errno.ENOSPC, "No space left on device", writer.path)
    checkpoint.StreamingSafetensorsWriter.write = full_disk
    try:
        engine.save_checkpoint(save_dir, tag="broken")
    except CheckpointSaveError as error:
        return str(error)
    finally:
        checkpoint.StreamingSafetensorsWriter.write = real_write
    return None


def test_same_tag_replaces_and_bad_inputs_name_the_problem(distributed, tmp_path):
    results = distributed(2, _save_twice_and_bad_inputs, str(tmp_path))
    errors, missing, steps, entries = results[0]
    assert steps == 2 and entries == ["latest", "mine"]  # no broken or partial folder, `latest` untouched
    assert open(tmp_path / "latest").read() == "mine"
    assert "ENOSPC" in errors["disk"] and "model.safetensors" in errors["disk"]
    assert results[1][0]["disk"] == errors["disk"]  # rank 1 (which wrote nothing) raises the same
    assert "checkpoint tag '../escape' must be a plain folder name" in errors["tag"]
    assert "client_state['f'] is a builtin_function_or_method" in errors["client"]
    assert missing == (None, None)  # no `latest` file: nothing loaded, as DeepSpeed


def _load_other_model(save_dir):
    engine = _engine(0, "sequential")
    try:
        engine.load_checkpoint(save_dir)
    except ValueError as error:
        return str(error)
    return None


def test_loading_another_models_checkpoint_names_the_mismatch(distributed, tmp_path):
    distributed(2, _save, 0, str(tmp_path))
    error = distributed(2, _load_other_model, str(tmp_path))[0]
    assert "does not match the model: missing ['0.weight'" in error and "load_module_strict=False" in error
