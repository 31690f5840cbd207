"""The DeepSpeed config: batch-size arithmetic and its errors, DeepSpeed's defaults, unknown keys and wrong types
named by their path, accepted-but-unused keys warned about once, and the translation into our configs."""
import json
import warnings

import pytest

from megatron_core.engine import UnusedConfigWarning
from megatron_core.engine.config import EngineConfig, resolve_batch_sizes


def _config(dp_size=2, **overrides):
    return EngineConfig.from_json({"train_micro_batch_size_per_gpu": 2, **overrides}, dp_size=dp_size)


@pytest.mark.parametrize("given, dp, expected", [
    ((32, 4, None), 2, (32, 4, 4)),      # train and micro imply accumulation
    ((32, None, 2), 4, (32, 4, 2)),      # train and accumulation imply micro
    ((None, 3, 5), 2, (30, 3, 5)),       # micro and accumulation imply train
    ((16, None, None), 2, (16, 8, 1)),   # train alone: accumulation 1
    ((None, 3, None), 4, (12, 3, 1)),    # micro alone: accumulation 1
    ((24, 3, 4), 2, (24, 3, 4)),         # all three, consistent
])
def test_any_two_batch_sizes_imply_the_third(given, dp, expected):
    assert resolve_batch_sizes(*given, dp_size=dp) == expected


@pytest.mark.parametrize("given, dp", [((24, 3, 2), 2), ((10, 2, None), 2), ((8, None, 3), 2), ((1, None, None), 2)])
def test_inconsistent_batch_sizes_name_all_three(given, dp):
    with pytest.raises(ValueError) as error:
        resolve_batch_sizes(*given, dp_size=dp)
    message = str(error.value)
    for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", f"dp={dp}"):
        assert name in message


def test_no_batch_size_is_an_error():
    with pytest.raises(ValueError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        EngineConfig.from_json({"gradient_accumulation_steps": 2}, dp_size=1)


def test_deepspeed_defaults():
    config = _config()
    assert config.gradient_clipping == 1.0  # DeepSpeed 0.19's default
    assert config.zero_stage == 0 and config.optimizer is None and config.scheduler is None
    assert dict(config.fp16) == {**config.fp16, "enabled": False, "loss_scale": 0.0, "initial_scale_power": 16,
                                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1.0}
    ddp = config.ddp_config()
    assert ddp.zero_stage == 0 and not ddp.overlap_grad_reduce and ddp.bucket_size is None
    assert _config(zero_optimization={"stage": 3}).ddp_config().overlap_grad_reduce  # overlap_comm default at 3


def test_optimizer_and_precision_map_onto_our_config():
    config = _config(zero_optimization={"stage": 2, "reduce_bucket_size": 5e5,
                                        "offload_optimizer": {"device": "cpu"}},
                     optimizer={"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                           "weight_decay": 0.1}},
                     fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 3, "loss_scale_window": 50,
                           "min_loss_scale": 0.5},
                     gradient_clipping=0.5)
    ours = config.optimizer_config(config.optimizer)
    assert (ours.optimizer, ours.lr, ours.adam_beta1, ours.adam_beta2, ours.adam_eps, ours.weight_decay) == \
        ("adam", 3e-4, 0.8, 0.95, 1e-6, 0.1)
    assert ours.fp16 and ours.loss_scale is None and ours.initial_loss_scale == 256.0
    assert (ours.hysteresis, ours.loss_scale_window, ours.min_loss_scale, ours.clip_grad) == (3, 50, 0.5, 0.5)
    assert ours.optimizer_cpu_offload and config.ddp_config().bucket_size == 500_000
    static = _config(fp16={"enabled": True, "loss_scale": 128})
    assert static.optimizer_config(_config(optimizer={"type": "AdamW"}).optimizer).loss_scale == 128.0
    # FusedAdam's weight decay default is 0; torch.optim.AdamW's (torch_adam) 0.01
    assert _config(optimizer={"type": "AdamW"}).optimizer.weight_decay == 0.0
    assert _config(optimizer={"type": "AdamW", "params": {"torch_adam": True}}).optimizer.weight_decay == 0.01
    sgd = _config(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}).optimizer
    assert (sgd.kind, sgd.lr, sgd.momentum, sgd.weight_decay) == ("sgd", 0.1, 0.9, 0.0)


def test_unknown_keys_are_errors_naming_their_path(tmp_path):
    with pytest.raises(ValueError, match=r"zero_optimization\.stage3_prefetch_bucket_sze.*did you mean "
                                         r"zero_optimization\.stage3_prefetch_bucket_size"):
        _config(zero_optimization={"stage": 3, "stage3_prefetch_bucket_sze": 10})
    with pytest.raises(ValueError, match=r"unknown DeepSpeed config key train_micro_batch_size_per_gp\b"):
        EngineConfig.from_json({"train_micro_batch_size_per_gp": 2}, dp_size=1)
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.devce"):
        _config(zero_optimization={"stage": 1, "offload_optimizer": {"devce": "cpu"}})
    with pytest.raises(ValueError, match=r"optimizer\.params\.lrr"):
        _config(optimizer={"type": "AdamW", "params": {"lrr": 1e-3}})
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_num_step\b"):
        _config(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 10}})
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabeld": True}}))
    with pytest.raises(ValueError, match=rf"{path}: unknown DeepSpeed config key fp16\.enabeld"):
        EngineConfig.from_json(str(path), dp_size=2)


@pytest.mark.parametrize("overrides, path, expected", [
    ({"zero_optimization": {"stage3_prefetch_bucket_size": "big"}}, "zero_optimization.stage3_prefetch_bucket_size",
     "an integer"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage", "an integer"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", "a number"),
    ({"fp16": {"enabled": 1}}, "fp16.enabled", "true or false"),
    ({"zero_optimization": {"reduce_bucket_size": "auto"}}, "zero_optimization.reduce_bucket_size",
     "transformers' Trainer"),
    ({"zero_optimization": 3}, "zero_optimization", "a JSON object"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "optimizer.params.betas", "two numbers"),
])
def test_wrong_types_name_the_key_and_value(overrides, path, expected):
    with pytest.raises(ValueError) as error:
        _config(**overrides)
    assert path in str(error.value) and expected in str(error.value)


@pytest.mark.parametrize("overrides, match", [
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization\.stage is 4, not one of \[0, 1, 2, 3\]"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "choose one precision"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "nvme_path is not set"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "parameter offload needs stage 3"),
    ({"optimizer": {"type": "Lamb"}}, "'Lamb' is not supported here: use 'Adam', 'AdamW' or 'SGD'"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}}, "L2 regularization"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, r"scheduler\.params\.total_num_steps is required"),
    ({"scheduler": {"type": "StepLR"}}, "'StepLR' is not supported here"),
    ({"gradient_clipping": -1}, "gradient_clipping is -1.0; it must be >= 0"),
])
def test_bad_values_say_what_to_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


def test_accepted_keys_without_effect_warn_once():
    overrides = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1000}, "tensorboard": {
        "enabled": True}}
    with pytest.warns(UnusedConfigWarning) as records:
        _config(**overrides)
    messages = [str(r.message) for r in records]
    assert any("zero_optimization.stage3_max_live_parameters" in m and "at most two units" in m for m in messages)
    assert any(m.startswith("DeepSpeed config key tensorboard ") for m in messages)
    assert sum("stage3_max_live_parameters" in m for m in messages) == 1  # once per key of the config
    with warnings.catch_warnings():  # mapped keys do not warn
        warnings.simplefilter("error", UnusedConfigWarning)
        _config(zero_optimization={"stage": 3, "overlap_comm": True}, gradient_clipping=0.5, steps_per_print=10)


def test_aliases_and_deprecated_spellings():
    config = _config(zero_optimization={"stage": 3, "prefetch_bucket_size": 100, "cpu_offload_param": True},
                     bfloat16={"enabled": True})
    assert config.bf16_enabled and config.raw["zero_optimization"]["stage3_prefetch_bucket_size"] == 100
    assert config.zero["offload_param"]["device"] == "cpu"
    with pytest.raises(ValueError, match="both set"):
        _config(zero_optimization={"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2})
