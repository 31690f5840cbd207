"""The engine's configuration: DeepSpeed's JSON (a dict or a path) validated into typed, frozen dataclasses.

``EngineConfig.from_json(config, dp_size=...)`` checks every key against ``schema.TOP`` (unknown keys and
wrong types are ``ValueError``s naming their dotted path), fills DeepSpeed's defaults, resolves the batch
sizes (any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
``gradient_accumulation_steps`` imply the third; all three must satisfy
``train = micro * accumulation * dp``) and checks the optimizer's and scheduler's ``params`` by type.
``ddp_config()`` and ``optimizer_config()`` translate it into megatron_core's own configs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.engine import schema
from megatron_core.engine.schema import Key, bool_key, float_key, int_key, str_key, validate_section
from megatron_core.optimizer import OptimizerConfig

_ADAM_PARAMS = schema.params_schema({
    "lr": float_key(1e-3, minimum=0.0), "betas": Key("list", (0.9, 0.999)), "eps": float_key(1e-8, minimum=0.0),
    "weight_decay": float_key(None, minimum=0.0), "torch_adam": bool_key(False), "adam_w_mode": bool_key(True),
    "bias_correction": bool_key(True), "amsgrad": bool_key(False),
    "set_grad_none": bool_key(True, unused="grads live in the engine's buffers, zeroed after each step"),
    "fp32_optimizer_states": Key("bool", None, nullable=True, unused="optimizer states are always fp32"),
    "foreach": Key("bool", None, nullable=True, unused="torch's fused AdamW kernel runs when it can"),
})
_SGD_PARAMS = schema.params_schema({
    "lr": float_key(1e-3, minimum=0.0), "momentum": float_key(0.0, minimum=0.0), "dampening": float_key(0.0),
    "weight_decay": float_key(0.0, minimum=0.0), "nesterov": bool_key(False), "maximize": bool_key(False),
    "foreach": Key("bool", None, nullable=True, unused="torch's SGD picks its implementation"),
    "differentiable": bool_key(False), "fused": Key("bool", None, nullable=True, unused="torch's SGD picks it"),
})
_WARMUP = MappingProxyType({"warmup_min_lr": float_key(0.0), "warmup_max_lr": float_key(None),
                            "warmup_num_steps": int_key(1000), "warmup_type": str_key("log"),
                            "last_batch_iteration": int_key(-1)})
_REQUIRED = Key("int", None, nullable=True, minimum=1)
SCHEDULER_PARAMS = MappingProxyType({
    "WarmupLR": schema.params_schema(_WARMUP),
    "WarmupDecayLR": schema.params_schema({**_WARMUP, "warmup_max_lr": float_key(0.001), "total_num_steps": _REQUIRED}),
    "WarmupCosineLR": schema.params_schema({
        "total_num_steps": _REQUIRED, "warmup_min_ratio": float_key(0.0), "warmup_num_steps": int_key(1000),
        "cos_min_ratio": float_key(0.0001), "warmup_type": str_key("log"), "last_batch_iteration": int_key(-1)}),
    "OneCycle": schema.params_schema({
        "cycle_min_lr": float_key(None), "cycle_max_lr": float_key(None), "decay_lr_rate": float_key(0.0),
        "cycle_first_step_size": int_key(2000), "cycle_second_step_size": int_key(None),
        "cycle_first_stair_count": int_key(0), "cycle_second_stair_count": int_key(None),
        "decay_step_size": int_key(0), "cycle_momentum": bool_key(True), "cycle_min_mom": float_key(0.8),
        "cycle_max_mom": float_key(0.9), "decay_mom_rate": float_key(0.0), "last_batch_iteration": int_key(-1)}),
    "LRRangeTest": schema.params_schema({
        "lr_range_test_min_lr": float_key(1e-3), "lr_range_test_step_size": int_key(2000),
        "lr_range_test_step_rate": float_key(1.0), "lr_range_test_staircase": bool_key(False),
        "last_batch_iteration": int_key(-1)}),
})
_REQUIRED_SCHEDULER_PARAMS = MappingProxyType({"WarmupDecayLR": ("total_num_steps",),
                                               "WarmupCosineLR": ("total_num_steps",),
                                               "OneCycle": ("cycle_min_lr", "cycle_max_lr")})


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The optimizer: ``kind`` "adam" (AdamW math) or "sgd", and its resolved hyperparameters."""

    kind: str
    lr: float
    weight_decay: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerSpec:
    """A DeepSpeed schedule by name (``lr_schedules.SCHEDULES``) and its keyword arguments."""

    type: str
    params: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The resolved config. ``raw`` keeps every key with its value or DeepSpeed's default."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float
    optimizer: Optional[OptimizerSpec]
    scheduler: Optional[SchedulerSpec]
    fp16: Mapping[str, Any]
    bf16_enabled: bool
    zero: Mapping[str, Any]
    steps_per_print: Optional[int]
    wall_clock_breakdown: bool
    dataloader_drop_last: bool
    communication_data_type: Optional[str]
    raw: Mapping[str, Any]

    @property
    def zero_stage(self) -> int:
        return self.zero["stage"]

    @property
    def fp16_enabled(self) -> bool:
        return self.fp16["enabled"]

    @classmethod
    def from_json(cls, config: Union[str, os.PathLike, Mapping[str, Any]], *, dp_size: int) -> "EngineConfig":
        """Validates ``config`` (a dict, or the path of a JSON file) for ``dp_size`` data-parallel ranks."""
        raw, source = _load(config)
        resolved = validate_section(raw, schema.TOP, source=source)
        train, micro, accumulation = resolve_batch_sizes(resolved["train_batch_size"],
                                                         resolved["train_micro_batch_size_per_gpu"],
                                                         resolved["gradient_accumulation_steps"], dp_size=dp_size)
        if not resolved["managed_gradient_accumulation"]:
            raise ValueError(f"{source}managed_gradient_accumulation=false is not supported: the engine counts "
                             "micro-steps (every gradient_accumulation_steps-th step() updates); remove the key")
        if resolved["fp16"]["enabled"] and resolved["bf16"]["enabled"]:
            raise ValueError(f"{source}fp16.enabled and bf16.enabled are both true: choose one precision")
        zero = dict(resolved["zero_optimization"])
        _resolve_offload(zero, source)
        return cls(train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                   gradient_accumulation_steps=accumulation, gradient_clipping=resolved["gradient_clipping"],
                   optimizer=_optimizer_spec(resolved["optimizer"], source),
                   scheduler=_scheduler_spec(resolved["scheduler"], source),
                   fp16=MappingProxyType(resolved["fp16"]), bf16_enabled=resolved["bf16"]["enabled"],
                   zero=MappingProxyType(zero), steps_per_print=resolved["steps_per_print"],
                   wall_clock_breakdown=resolved["wall_clock_breakdown"],
                   dataloader_drop_last=resolved["dataloader_drop_last"],
                   communication_data_type=resolved["communication_data_type"], raw=MappingProxyType(resolved))

    def ddp_config(self) -> DistributedDataParallelConfig:
        """megatron_core's data-parallel config: the stage, ``reduce_bucket_size`` as the bucket size (stages
        0-2), ``overlap_comm`` as overlapped reduction (DeepSpeed's default: on at stage 3, else off; the
        buckets are launched from backward hooks either way when on), fp32 grad reduction unless
        ``communication_data_type`` names the model's 16-bit type."""
        overlap = self.zero["overlap_comm"]
        if overlap is None:
            overlap = self.zero_stage == 3
        return DistributedDataParallelConfig(
            zero_stage=self.zero_stage, bucket_size=self.zero["reduce_bucket_size"],
            overlap_grad_reduce=overlap, grad_reduce_in_fp32=self.communication_data_type in (None, "fp32"))

    def optimizer_config(self, spec: OptimizerSpec) -> OptimizerConfig:
        """megatron_core's optimizer config for ``spec``: precision and loss scaling (``fp16``, ``bf16``),
        clipping (``gradient_clipping``) and offload (``zero_optimization.offload_optimizer``)."""
        fp16 = self.fp16
        device = self.zero["offload_optimizer"]["device"]
        return OptimizerConfig(
            optimizer=spec.kind, lr=spec.lr, weight_decay=spec.weight_decay, adam_beta1=spec.betas[0],
            adam_beta2=spec.betas[1], adam_eps=spec.eps, sgd_momentum=spec.momentum,
            clip_grad=self.gradient_clipping, fp16=fp16["enabled"], bf16=self.bf16_enabled,
            loss_scale=fp16["loss_scale"] if fp16["enabled"] and fp16["loss_scale"] > 0 else None,
            initial_loss_scale=2.0 ** fp16["initial_scale_power"], min_loss_scale=fp16["min_loss_scale"],
            loss_scale_window=fp16["loss_scale_window"], hysteresis=fp16["hysteresis"],
            optimizer_cpu_offload=device == "cpu",
            optimizer_nvme_offload_dir=self.zero["offload_optimizer"]["nvme_path"] if device == "nvme" else None,
            fused_adam=False)


def _load(config: Union[str, os.PathLike, Mapping[str, Any]]) -> tuple[dict, str]:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as handle:
                return json.load(handle), f"{path}: "
        except OSError as error:
            raise ValueError(f"cannot read the DeepSpeed config {path!r}: {error.strerror}") from error
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error}); DeepSpeed configs are plain JSON") from error
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")
    return json.loads(json.dumps(config)), ""  # a deep copy; a value JSON cannot hold fails here


def resolve_batch_sizes(train: Optional[int], micro: Optional[int], accumulation: Optional[int], *,
                        dp_size: int) -> tuple[int, int, int]:
    """DeepSpeed's batch arithmetic: ``train_batch_size = micro * accumulation * dp``.

    Any two imply the third (integer division, as DeepSpeed); one of train or micro alone means
    accumulation 1. Returns ``(train, micro, accumulation)``.
    Raises:
        ValueError: neither train nor micro given, or the three (given or implied) inconsistent.
    """
    names = (f"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
             f"gradient_accumulation_steps={accumulation}")
    if train is None and micro is None:
        raise ValueError(f"set train_batch_size or train_micro_batch_size_per_gpu (got {names}, dp={dp_size})")
    if train is not None and micro is not None and accumulation is None:
        accumulation = train // micro // dp_size
    elif train is not None and accumulation is not None and micro is None:
        micro = train // dp_size // accumulation
    elif micro is not None and train is None:
        accumulation = accumulation or 1
        train = micro * accumulation * dp_size
    elif micro is None:
        accumulation, micro = 1, train // dp_size
    if micro < 1 or accumulation < 1 or train != micro * accumulation * dp_size:
        raise ValueError(f"inconsistent batch sizes: {names} with dp={dp_size}: train_batch_size must equal "
                         f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp "
                         f"({micro} * {accumulation} * {dp_size} = {micro * accumulation * dp_size}); "
                         "set two of the three and let the engine derive the third")
    return train, micro, accumulation


def _resolve_offload(zero: dict, source: str) -> None:
    """The deprecated ``cpu_offload`` / ``cpu_offload_param`` flags into the offload sections, and the checks
    DeepSpeed makes: NVMe needs a path, parameter offload needs stage 3."""
    for flag, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if zero.get(flag):
            zero[section] = {**zero[section], "device": "cpu"}
    for section in ("offload_optimizer", "offload_param"):
        device, path = zero[section]["device"], zero[section]["nvme_path"]
        if device == "nvme" and not path:
            raise ValueError(f"{source}zero_optimization.{section}.device is 'nvme' but "
                             f"zero_optimization.{section}.nvme_path is not set: name a folder on the NVMe disk")
    if zero["offload_param"]["device"] != "none" and zero["stage"] != 3:
        raise ValueError(f"{source}zero_optimization.offload_param.device is "
                         f"{zero['offload_param']['device']!r} but zero_optimization.stage is {zero['stage']}: "
                         "parameter offload needs stage 3")
    if zero["offload_optimizer"]["device"] != "none" and zero["stage"] == 0:
        raise ValueError(f"{source}zero_optimization.offload_optimizer needs zero_optimization.stage >= 1 "
                         "(DeepSpeed's ZeRO-Offload), got stage 0")


def _section_type(section: dict, what: str, source: str) -> Optional[str]:
    """``section["type"]``; ValueError when ``params`` are given without it."""
    if section["type"] is None and section["params"]:
        raise ValueError(f"{source}{what}.params is set but {what}.type is not")
    return section["type"]


def _optimizer_spec(section: dict, source: str) -> Optional[OptimizerSpec]:
    name = _section_type(section, "optimizer", source)
    if name is None:
        return None
    params = section["params"] or {}
    if name.lower() in ("adam", "adamw"):
        p = validate_section(params, _ADAM_PARAMS, path="optimizer.params", source=source)
        adamw = name.lower() == "adamw" or p["adam_w_mode"]
        weight_decay = p["weight_decay"]
        if weight_decay is None:  # FusedAdam's default 0; torch.optim.AdamW's 0.01 under torch_adam
            weight_decay = 0.01 if p["torch_adam"] and adamw else 0.0
        if not adamw and weight_decay > 0:
            raise ValueError(f"{source}optimizer.params.adam_w_mode=false with weight_decay={weight_decay}: "
                             "Adam with L2 regularization is not supported here; use AdamW (decoupled weight "
                             "decay) or weight_decay 0")
        for key, expected in (("bias_correction", True), ("amsgrad", False)):
            if p[key] != expected:
                raise ValueError(f"{source}optimizer.params.{key}={p[key]} is not supported here "
                                 f"(only {str(expected).lower()})")
        betas = _betas(p["betas"], source)
        return OptimizerSpec(kind="adam", lr=p["lr"], weight_decay=weight_decay, betas=betas, eps=p["eps"])
    if name == "SGD":
        p = validate_section(params, _SGD_PARAMS, path="optimizer.params", source=source)
        for key in ("dampening", "nesterov", "maximize", "differentiable"):
            if p[key]:
                raise ValueError(f"{source}optimizer.params.{key}={p[key]} is not supported here; leave it unset")
        return OptimizerSpec(kind="sgd", lr=p["lr"], weight_decay=p["weight_decay"], momentum=p["momentum"])
    raise ValueError(f"{source}optimizer.type {name!r} is not supported here: use 'Adam', 'AdamW' or 'SGD', "
                     "or pass optimizer= to initialize()")


def _betas(value: Any, source: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value):
        raise ValueError(f"{source}optimizer.params.betas must be two numbers in [0, 1), got {value!r}")
    return float(value[0]), float(value[1])


def _scheduler_spec(section: dict, source: str) -> Optional[SchedulerSpec]:
    name = _section_type(section, "scheduler", source)
    if name is None:
        return None
    if name not in SCHEDULER_PARAMS:
        raise ValueError(f"{source}scheduler.type {name!r} is not supported here: use one of "
                         f"{sorted(SCHEDULER_PARAMS)}, or pass lr_scheduler= to initialize()")
    params = validate_section(section["params"] or {}, SCHEDULER_PARAMS[name], path="scheduler.params",
                              source=source)
    for key in _REQUIRED_SCHEDULER_PARAMS.get(name, ()):
        if params[key] is None:
            raise ValueError(f"{source}scheduler.params.{key} is required by {name}")
    given = set((section["params"] or {}))
    kwargs = {k: v for k, v in params.items() if k in given or k in _REQUIRED_SCHEDULER_PARAMS.get(name, ())}
    return SchedulerSpec(type=name, params=MappingProxyType(kwargs))


__all__ = ["EngineConfig", "OptimizerSpec", "SchedulerSpec", "resolve_batch_sizes", "SCHEDULER_PARAMS"]
