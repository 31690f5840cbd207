"""DeepSpeed's JSON config keys (0.19), their types and defaults, and the validator that walks a config.

Every key DeepSpeed 0.19 reads is in the table below, so a DeepSpeed config is accepted as it is. A key is
one of:

* *mapped*: it drives something here (``Key.unused`` is None);
* *accepted, no effect here*: ``Key.unused`` says why; setting it warns once (``UnusedConfigWarning``);
* an *opaque section* (monitors, profilers, compression, ...): accepted as any JSON object, contents not
  checked, a warning once.

An unknown key or a value of the wrong type is a ``ValueError`` naming its dotted path in the JSON
(``zero_optimization.stage3_prefetch_bucket_size``) and, for a typo, the nearest known key.
"""
from __future__ import annotations

import dataclasses
import difflib
import warnings
from types import MappingProxyType
from typing import Any, Mapping, Optional


class UnusedConfigWarning(UserWarning):
    """A DeepSpeed config key that is accepted but has no effect in this engine."""


@dataclasses.dataclass(frozen=True)
class Key:
    kind: str                      # "int", "float", "bool", "str", "list", "section", "opaque", "number|str"
    default: Any = None
    unused: Optional[str] = None   # why the key does nothing here (None: it is mapped)
    children: Optional[Mapping[str, "Key"]] = None
    choices: Optional[tuple] = None
    minimum: Optional[float] = None
    nullable: bool = False
    alias_of: Optional[str] = None  # another spelling of a sibling key (DeepSpeed's pydantic aliases)


def int_key(default=None, *, minimum=None, unused=None, nullable=False, choices=None) -> Key:
    return Key("int", default, unused=unused, minimum=minimum, nullable=nullable or default is None,
                choices=choices)


def float_key(default=None, *, minimum=None, unused=None, nullable=False) -> Key:
    return Key("float", default, unused=unused, minimum=minimum, nullable=nullable or default is None)


def bool_key(default=False, *, unused=None) -> Key:
    return Key("bool", default, unused=unused)


def str_key(default=None, *, choices=None, unused=None) -> Key:
    return Key("str", default, unused=unused, choices=choices, nullable=default is None)


def section_key(children: dict, *, unused=None) -> Key:
    return Key("section", None, unused=unused, children=MappingProxyType(children))


def opaque_key(reason: str) -> Key:
    return Key("opaque", None, unused=reason, nullable=True)


def alias_key(name: str) -> Key:
    return Key("alias", alias_of=name)


_NO_ZERO3_TUNING = "ZeRO-3 here gathers one module (unit) at a time and prefetches the next one"
_PIN = bool_key(True, unused="host buffers are pinned whenever the device is CUDA")
OFFLOAD_OPTIMIZER = MappingProxyType({
    "device": str_key("none", choices=("none", "cpu", "nvme")),
    "nvme_path": str_key(None),
    "buffer_count": int_key(4, minimum=0, unused="the NVMe update streams through a ring of 3 chunk buffers"),
    "pin_memory": _PIN,
    "pipeline_read": bool_key(unused="NVMe reads of the next chunk always overlap the update"),
    "pipeline_write": bool_key(unused="NVMe writes of the previous chunk always overlap the update"),
    "fast_init": bool_key(unused="the NVMe files are created and reserved once (posix_fallocate)"),
    "ratio": float_key(1.0, minimum=0.0, unused="the whole optimizer state is offloaded"),
    "super_offload": bool_key(unused="SuperOffload is DeepSpeed's GH200 path"),
    "cpuadam_cores_perc": float_key(0.8, unused="the host Adam uses torch's threads"),
})
OFFLOAD_PARAM = MappingProxyType({
    "device": str_key("none", choices=("none", "cpu", "nvme")),
    "nvme_path": str_key(None),
    "buffer_count": int_key(5, minimum=0, unused="each shard is fetched into its own storage when gathered"),
    "pin_memory": _PIN,
    "buffer_size": int_key(100_000_000, minimum=0, unused="each shard is fetched into its own storage"),
    "max_in_cpu": int_key(1_000_000_000, minimum=0, unused="every offloaded shard lives in its home"),
})

ZERO = MappingProxyType({
    "stage": int_key(0, choices=(0, 1, 2, 3)),
    "overlap_comm": Key("bool", None, nullable=True),
    "contiguous_gradients": bool_key(True, unused="gradients always land in contiguous buffers"),
    "reduce_scatter": bool_key(True, unused="stages 1-3 always reduce-scatter (stage 0 all-reduces)"),
    "reduce_bucket_size": int_key(None, minimum=1),
    "use_multi_rank_bucket_allreduce": bool_key(True, unused="buckets are reduced one collective each"),
    "allgather_partitions": bool_key(True, unused="updated shards are always all-gathered per bucket"),
    "allgather_bucket_size": int_key(500_000_000, minimum=0,
                                  unused="the all-gather of updated shards uses the reduce buckets"),
    "compute_grad_norm": bool_key(True, unused="the grad norm is always computed (get_global_grad_norm)"),
    "load_from_fp32_weights": bool_key(True, unused="checkpoints hold fp32 masters when they are copies"),
    "elastic_checkpoint": bool_key(unused="every checkpoint loads at any dp size and stage"),
    "offload_param": section_key(OFFLOAD_PARAM),
    "offload_optimizer": section_key(OFFLOAD_OPTIMIZER),
    "zenflow": opaque_key("ZenFlow is not implemented here"),
    "sub_group_size": int_key(1_000_000_000, minimum=0, unused="the optimizer steps every piece in one pass"),
    "cpu_offload": Key("bool", None, nullable=True),
    "cpu_offload_param": Key("bool", None, nullable=True),
    "cpu_offload_use_pin_memory": Key("bool", None, nullable=True, unused="see offload_*.pin_memory"),
    "stage3_prefetch_bucket_size": int_key(50_000_000, minimum=0, unused=_NO_ZERO3_TUNING),
    "prefetch_bucket_size": alias_key("stage3_prefetch_bucket_size"),
    "stage3_param_persistence_threshold": int_key(100_000, minimum=0),
    "param_persistence_threshold": alias_key("stage3_param_persistence_threshold"),
    "stage3_model_persistence_threshold": int_key(2 ** 63 - 1, minimum=0, unused=_NO_ZERO3_TUNING),
    "model_persistence_threshold": alias_key("stage3_model_persistence_threshold"),
    "stage3_max_live_parameters": int_key(1_000_000_000, minimum=0,
                                       unused="at most two units are gathered at once"),
    "max_live_parameters": alias_key("stage3_max_live_parameters"),
    "stage3_max_reuse_distance": int_key(1_000_000_000, minimum=0, unused="a unit is freed right after its use"),
    "max_reuse_distance": alias_key("stage3_max_reuse_distance"),
    "stage3_gather_16bit_weights_on_model_save": bool_key(unused="checkpoints always hold full weights"),
    "gather_16bit_weights_on_model_save": alias_key("stage3_gather_16bit_weights_on_model_save"),
    "stage3_gather_fp16_weights_on_model_save": bool_key(unused="checkpoints always hold full weights"),
    "stage3_module_granularity_threshold": int_key(0, minimum=0, unused=_NO_ZERO3_TUNING),
    "module_granularity_threshold": alias_key("stage3_module_granularity_threshold"),
    "stage3_use_all_reduce_for_fetch_params": bool_key(unused="parameters are fetched with all-gathers"),
    "use_all_reduce_for_fetch_params": alias_key("stage3_use_all_reduce_for_fetch_params"),
    "stage3_allgather_sequential": bool_key(unused="each unit's gather is one collective"),
    "allgather_sequential": alias_key("stage3_allgather_sequential"),
    "ignore_unused_parameters": bool_key(True, unused="parameters that get no grad receive zeros"),
    "legacy_stage1": bool_key(unused="one stage-1 implementation"),
    "round_robin_gradients": bool_key(unused="grads are reduced bucket by bucket in order"),
    "parameter_alignment": bool_key(unused="buckets are padded to a multiple of dp"),
    "zero_hpz_partition_size": int_key(1, minimum=0, unused="no hierarchical partitioning (ZeRO++ hpZ)"),
    "zero_quantized_weights": bool_key(unused="no quantized all-gather (ZeRO++ qwZ)"),
    "zero_quantized_nontrainable_weights": bool_key(unused="no quantized all-gather (ZeRO++ qwZ)"),
    "zero_quantized_gradients": bool_key(unused="no quantized reduce-scatter (ZeRO++ qgZ)"),
    "mics_shard_size": int_key(-1, unused="MiCS is not implemented here"),
    "mics_hierarchical_params_gather": bool_key(unused="MiCS is not implemented here"),
    "memory_efficient_linear": bool_key(True, unused="ZeRO-3 frees the storage autograd saved (no special linear)"),
    "pipeline_loading_checkpoint": bool_key(unused="no pipeline engine"),
    "override_module_apply": bool_key(True, unused="module.apply is not patched"),
    "log_trace_cache_warnings": bool_key(unused="no trace cache"),
    "enable_sanity_checks": bool_key(unused="there are no optional ZeRO-3 checks to enable"),
    "save_muon_momentum_buffer_in_memory": bool_key(unused="no Muon optimizer"),
    "leaf_module": opaque_key("units are the modules that own parameters (see docs/engine.md)"),
})

FP16 = MappingProxyType({
    "enabled": bool_key(False),
    "auto_cast": bool_key(False),
    "loss_scale": float_key(0.0, minimum=0.0),
    "initial_scale_power": int_key(16, minimum=0),
    "loss_scale_window": int_key(1000, minimum=1),
    "hysteresis": int_key(2, minimum=1),
    "consecutive_hysteresis": bool_key(False),
    "min_loss_scale": float_key(1.0, minimum=0.0),
    "fp16_master_weights_and_grads": bool_key(unused="master weights are always fp32"),
    "type": str_key(None, unused="fp16 is torch.float16"),
})
BF16 = MappingProxyType({
    "enabled": bool_key(False),
    "immediate_grad_update": bool_key(True, unused="grads accumulate in fp32 buffers and are reduced per bucket"),
    "check_grad_overflow": bool_key(unused="bf16 runs no overflow check (no loss scaling)"),
    "bf16_master_weights_and_grads": bool_key(unused="master weights are always fp32"),
    "bf16_optimizer_states": bool_key(unused="optimizer states are always fp32"),
})
ACTIVATION_CHECKPOINTING = MappingProxyType({
    "partition_activations": bool_key(unused="no tensor parallelism in the engine: nothing to partition over"),
    "contiguous_memory_optimization": bool_key(unused="recompute frees activations; no contiguous buffer"),
    "cpu_checkpointing": bool_key(unused="checkpointed inputs stay where they are"),
    "number_checkpoints": int_key(None, unused="each checkpoint() call is one segment"),
    "synchronize_checkpoint_boundary": bool_key(unused="no device synchronization is needed on CPU or CUDA here"),
    "profile": bool_key(unused="no recompute profiler"),
})
OPTIMIZER = MappingProxyType({"type": str_key(None), "params": Key("opaque", None, nullable=True),
             "legacy_fusion": bool_key(unused="no legacy fused optimizer")})
SCHEDULER = MappingProxyType({"type": str_key(None), "params": Key("opaque", None, nullable=True)})

_MONITOR = "monitoring backends are not wired in; use the engine's logger (steps_per_print)"
TOP = MappingProxyType({
    "train_batch_size": int_key(None, minimum=1),
    "train_micro_batch_size_per_gpu": int_key(None, minimum=1),
    "gradient_accumulation_steps": int_key(None, minimum=1),
    "managed_gradient_accumulation": bool_key(True),
    "gradient_clipping": float_key(1.0, minimum=0.0),
    "optimizer": section_key(OPTIMIZER),
    "scheduler": section_key(SCHEDULER),
    "fp16": section_key(FP16),
    "bf16": section_key(BF16),
    "bfloat16": alias_key("bf16"),
    "zero_optimization": section_key(ZERO),
    "activation_checkpointing": section_key(ACTIVATION_CHECKPOINTING),
    "steps_per_print": int_key(None, minimum=1),
    "wall_clock_breakdown": bool_key(False),
    "dataloader_drop_last": bool_key(False),
    "communication_data_type": str_key(None, choices=("fp32", "fp16", "bf16")),
    "seq_parallel_communication_data_type": str_key("fp32", unused="no sequence parallelism in the engine"),
    "prescale_gradients": bool_key(unused="grads are always pre-scaled by 1/dp and summed (the same fp32 mean)"),
    "gradient_predivide_factor": float_key(1.0, unused="grads are pre-scaled by 1/dp"),
    "gradient_allreduce_op": str_key("mean", choices=("mean",), unused="grads are always averaged over dp"),
    "sparse_gradients": bool_key(unused="embedding grads are dense"),
    "zero_allow_untested_optimizer": bool_key(unused="only Adam, AdamW and SGD are supported (all tested)"),
    "zero_force_ds_cpu_optimizer": bool_key(True, unused="CPU offload uses torch's AdamW math"),
    "disable_allgather": bool_key(unused="updated shards are always all-gathered"),
    "dump_state": bool_key(unused="no state dump"),
    "disable_python_gc": int_key(0, unused="the Python GC is left alone"),
    "memory_breakdown": bool_key(unused="see megatron_core.optimizer.memory_report"),
    "vocabulary_size": int_key(None, unused="the model is yours; nothing pads its vocabulary"),
    "log_level": str_key(None, unused="use logging.getLogger('megatron_core')"),
    "amp": opaque_key("apex AMP is not used; set fp16 or bf16"),
    "torch_autocast": opaque_key("torch.autocast is not applied by the engine; set fp16 or bf16"),
    "data_types": opaque_key("grads accumulate and are reduced in fp32 (see communication_data_type)"),
    "checkpoint": opaque_key("checkpoints are always atomic, full and layout-independent"),
    "aio": opaque_key("NVMe files are read and written with preadv/pwrite"),
    "tensorboard": opaque_key(_MONITOR), "wandb": opaque_key(_MONITOR), "csv_monitor": opaque_key(_MONITOR),
    "comet": opaque_key(_MONITOR), "comms_logger": opaque_key(_MONITOR), "flops_profiler": opaque_key(_MONITOR),
    "timers": opaque_key("wall_clock_breakdown is the engine's timer"),
    "autotuning": opaque_key("no autotuner"), "elasticity": opaque_key("no elastic batch sizes"),
    "compression_training": opaque_key("no compression"), "data_efficiency": opaque_key("no curriculum sampler"),
    "curriculum_learning": opaque_key("no curriculum sampler"), "pipeline": opaque_key("no pipeline engine"),
    "compile": opaque_key("torch.compile is yours to apply to the model"), "nebula": opaque_key("no Nebula"),
    "hybrid_engine": opaque_key("no hybrid (RLHF) engine"), "eigenvalue": opaque_key("no eigenvalue monitor"),
    "progressive_layer_drop": opaque_key("no progressive layer drop"),
    "quantize_training": opaque_key("no quantized training"), "weight_quantization": opaque_key("no quantization"),
    "sequence_parallel_size": int_key(1, choices=(1,), unused="no sequence parallelism in the engine"),
    "tensor_parallel": opaque_key("no tensor parallelism in the engine (use megatron_core's layers)"),
    "expert_parallel": opaque_key("no expert parallelism in the engine"),
    "use_data_before_expert_parallelism": bool_key(unused="no expert parallelism in the engine"),
    "datastates": opaque_key("no DataStates checkpointing"),
})

_TYPE_NAMES = MappingProxyType({"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "list": "a list", "section": "a JSON object", "opaque": "a JSON object"})


def _fail(path: str, value: Any, expected: str, source: str) -> None:
    hint = ""
    if value == "auto":
        hint = " ('auto' is resolved by transformers' Trainer before DeepSpeed sees it: write the number)"
    raise ValueError(f"{source}{path} must be {expected}, got {value!r} ({type(value).__name__}){hint}")


def _check_scalar(value: Any, key: Key, path: str, source: str) -> Any:
    if value is None and key.nullable:
        return None
    if key.kind == "bool":
        if not isinstance(value, bool):
            _fail(path, value, _TYPE_NAMES["bool"], source)
    elif key.kind == "int":
        if isinstance(value, float) and value.is_integer():  # 5e8 in JSON (pydantic accepts it too)
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, value, _TYPE_NAMES["int"], source)
    elif key.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, value, _TYPE_NAMES["float"], source)
        value = float(value)
    elif key.kind == "str":
        if not isinstance(value, str):
            _fail(path, value, _TYPE_NAMES["str"], source)
    if key.choices is not None and value not in key.choices:
        raise ValueError(f"{source}{path} is {value!r}, not one of {list(key.choices)}")
    if key.minimum is not None and value is not None and value < key.minimum:
        raise ValueError(f"{source}{path} is {value!r}; it must be >= {key.minimum}")
    return value


def warn_unused(path: str, reason: str) -> None:
    """Warns that ``path`` is accepted but does nothing here (a config is validated once: each key of it is
    warned about once)."""
    warnings.warn(f"DeepSpeed config key {path} is accepted but has no effect here: {reason}",
                  UnusedConfigWarning, stacklevel=4)


def validate_section(raw: Any, schema: Mapping[str, Key], *, path: str = "", source: str = "") -> dict:
    """Checks ``raw`` (a JSON object) against ``schema``; returns every key with its value or default.

    Args:
        raw: the user's object at ``path``.
        schema: the known keys there.
        path: dotted path of ``raw`` in the JSON ("" for the top level).
        source: a prefix for errors (the JSON file's name).
    Raises:
        ValueError: an unknown key (with the nearest known one) or a value of the wrong type, by path.
    """
    prefix = f"{path}." if path else ""
    if not isinstance(raw, dict):
        _fail(path or "the config", raw, _TYPE_NAMES["section"], source)
    resolved: dict[str, Any] = {}
    for name, value in raw.items():
        key = schema.get(name) if isinstance(name, str) else None
        if key is None:
            near = difflib.get_close_matches(str(name), list(schema), n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
            raise ValueError(f"{source}unknown DeepSpeed config key {prefix}{name}{hint}; the keys known at "
                             f"{path or 'the top level'} are listed in docs/engine.md")
        target = key.alias_of or name
        key = schema[target]
        if target in resolved:
            raise ValueError(f"{source}{prefix}{name} and another spelling of it ({prefix}{target}) are both set")
        resolved[target] = _check_value(value, key, f"{prefix}{name}", source)
        if key.unused is not None and key.kind != "section":
            warn_unused(f"{prefix}{name}", key.unused)
    for name, key in schema.items():
        if name not in resolved and key.alias_of is None:
            resolved[name] = validate_section({}, key.children, path=f"{prefix}{name}", source=source) \
                if key.kind == "section" else key.default
    return resolved


def _check_value(value: Any, key: Key, path: str, source: str) -> Any:
    if key.kind == "section":
        if value is None:
            value = {}
        return validate_section(value, key.children, path=path, source=source)
    if key.kind == "opaque":
        if value is not None and not isinstance(value, dict):
            _fail(path, value, _TYPE_NAMES["opaque"], source)
        return value
    return _check_scalar(value, key, path, source)


def params_schema(spec: Mapping[str, Key]) -> Mapping[str, Key]:
    """A read-only schema for an optimizer's or scheduler's ``params``."""
    return MappingProxyType(dict(spec))


__all__ = ["Key", "TOP", "UnusedConfigWarning", "alias_key", "bool_key", "float_key", "int_key", "opaque_key",
           "params_schema", "section_key", "str_key", "validate_section", "warn_unused"]
