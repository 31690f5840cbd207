"""The engine's checkpoints: DeepSpeed's folder layout (``save_dir/<tag>/``, ``save_dir/latest``) with
megatron_core's files: full tensors in safetensors and JSON, no pickle, written atomically.

    save_dir/latest                          the newest tag (replaced atomically, after the folder is published)
    save_dir/global_step3/engine.json        counters, lr schedule, loss scaler, client_state, config, names
    save_dir/global_step3/model.safetensors  every parameter and persistent buffer, whole (tied ones once)
    save_dir/global_step3/optim.safetensors  optimizer states ``optim/<state>/<name>``, whole, fp32
    save_dir/global_step3/client.safetensors the tensors of client_state

Rank 0 writes into ``.<tag>.partial``, fsyncs every file and the folder, renames it to ``<tag>`` and only then
replaces ``latest``; a crash never leaves a checkpoint that looks complete. Tensors are whole (ZeRO-3 shards
are gathered one bucket at a time, optimizer shards to dp rank 0), so a checkpoint loads at any dp size and
ZeRO stage. Loading reads safetensors and JSON only (nothing is unpickled); ``client_state`` holds JSON
values and tensors (a tuple comes back as a list).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_core.checkpointing.durable import publish_folder, remove_path, save_file_durably
from megatron_core.checkpointing.optimizer_state import collect_optimizer_state, restore_optimizer_state
from megatron_core.checkpointing.publication import CheckpointSaveError, agree_on_failure
from megatron_core.checkpointing.streaming import StreamingSafetensorsWriter
from megatron_core.utils.durable import fsync_path, write_text_atomically

if TYPE_CHECKING:
    from megatron_core.engine.engine import Engine

FORMAT = "megatron_core.engine/1"
LATEST = "latest"
logger = logging.getLogger(__name__)


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or "\\" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain folder name (no '/', not starting with '.')")
    return tag


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ----------------------------------------------------------------------------------------------------------------
# client_state: JSON values and tensors
def encode_client_state(value: Any, tensors: dict[str, torch.Tensor], path: str = "client_state") -> Any:
    """``value`` as JSON, its tensors moved to ``tensors`` (``{"__tensor__": name}`` in their place)."""
    if isinstance(value, torch.Tensor):
        name = f"client/{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous()
        return {"__tensor__": name}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{path} has a non-string key: checkpoints hold JSON objects (string keys)")
        return {k: encode_client_state(v, tensors, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_client_state(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{path} is a {type(value).__name__}: client_state holds JSON values (dict, list, str, number, "
                     "bool, None) and tensors only, so that loading never unpickles; convert it")


def decode_client_state(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        return {k: decode_client_state(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_client_state(v, tensors) for v in value]
    return value


# ----------------------------------------------------------------------------------------------------------------
# save
def _names(engine: "Engine") -> tuple[dict[str, torch.nn.Parameter], dict[str, str]]:
    """Each parameter once by its first name, and every other name of a tied parameter -> its first name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    named: dict[str, torch.nn.Parameter] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)], named[name] = name, param
    return named, tied


def _model_specs(engine: "Engine", named: dict, *, frozen: bool) -> tuple[list, list, list]:
    """``(parameters in the order gathered_buckets yields them, [(name, dtype, shape)], [(name, buffer)])``."""
    ddp = engine.ddp
    shapes = {id(p): tuple(b.shapes[p]) for b in ddp.buckets for p in b.params}
    if ddp.config.zero_stage == 3:
        order = [p for b in ddp.buckets for p in b.params] + [p for p in named.values() if id(p) not in shapes]
    else:
        order = list(named.values())
    order = [p for p in order if frozen or p.requires_grad]
    name_of = {id(p): n for n, p in named.items()}
    buffers = [(n, b) for n, b in engine.module.state_dict(keep_vars=True).items()
               if n not in named and isinstance(b, torch.Tensor) and not isinstance(b, torch.nn.Parameter)]
    specs = [(name_of[id(p)], p.dtype, shapes.get(id(p), tuple(p.shape))) for p in order]
    return order, specs + [(n, b.dtype, tuple(b.shape)) for n, b in buffers], buffers


def _write_model(engine: "Engine", path: Optional[str], named: dict, *, frozen: bool) -> Optional[BaseException]:
    """Streams every parameter (whole: stage 3 gathers one bucket at a time, collective over dp, so every
    rank walks all buckets even after a write failed) and persistent buffer into ``path`` (rank 0; None
    elsewhere). Returns the write error, if any."""
    order, specs, buffers = _model_specs(engine, named, frozen=frozen)
    name_of, shapes = {id(p): n for n, p in named.items()}, {name: shape for name, _, shape in specs}
    wanted, error, writer = {id(p) for p in order}, None, None
    try:
        writer = StreamingSafetensorsWriter(path, specs, atomic=False) if path is not None else None
    except OSError as failure:
        error = failure
    for params in engine.ddp.gathered_buckets():
        for param in params:
            if writer is None or id(param) not in wanted:
                continue
            name = name_of[id(param)]
            try:
                writer.write(name, param.detach().reshape(shapes[name]))
            except OSError as failure:
                writer.abort()
                writer, error = None, failure
    try:
        if writer is not None:
            for name, buffer in buffers:
                writer.write(name, buffer)
            writer.close()
    except OSError as failure:
        writer.abort()
        error = failure
    return error


def save(engine: "Engine", save_dir: str, *, tag: Optional[str], client_state: dict, save_latest: bool = True,
         exclude_frozen_parameters: bool = False) -> bool:
    """Writes checkpoint ``tag`` of ``engine`` (see the module docstring). Collective over every rank.
    Collectives: ZeRO-3 all-gathers (one bucket at a time), a gather of the optimizer shards to dp rank 0,
    ``all_gather_object``s that agree on failures. Raises ``CheckpointSaveError`` on every rank if any fails
    (nothing is published then; the previous checkpoint and ``latest`` are untouched)."""
    tag = _check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    final, partial = os.path.join(save_dir, tag), os.path.join(save_dir, f".{tag}.partial")
    writer, error = _rank() == 0, None
    client_tensors: dict[str, torch.Tensor] = {}
    try:
        encoded = encode_client_state(client_state, client_tensors)
        if writer:
            os.makedirs(save_dir, exist_ok=True)
            remove_path(partial)
            os.mkdir(partial)
    except (OSError, ValueError) as failure:
        error = failure
    agree_on_failure(error, folder=final, what="start checkpoint")
    try:
        _save_into(engine, partial, final, tag=tag, writer=writer, client=(encoded, client_tensors),
                   frozen=not exclude_frozen_parameters)
    except CheckpointSaveError:
        if writer:
            with contextlib.suppress(OSError):
                remove_path(partial)
        raise
    error = None
    if writer and save_latest:
        try:
            write_text_atomically(os.path.join(save_dir, LATEST), tag)
        except OSError as failure:
            error = failure
    agree_on_failure(error, folder=os.path.join(save_dir, LATEST), what="point to the checkpoint with")
    return True


def _save_into(engine: "Engine", partial: str, final: str, *, tag: str, writer: bool, client: tuple,
               frozen: bool) -> None:
    """The collective part of ``save``: the model (streamed), the optimizer states (gathered to dp rank 0),
    then rank 0's remaining files and the publication of the folder."""
    named, tied = _names(engine)
    error = _write_model(engine, os.path.join(partial, "model.safetensors") if writer else None, named,
                         frozen=frozen)
    optim_tensors, scalars = ({}, None)
    if engine.optimizer is not None:
        optim_tensors, scalars = collect_optimizer_state(engine.optimizer, named, engine.state)
    if writer and error is None:
        try:
            _write_rest(engine, partial, final, tag=tag, named=named, tied=tied, client=client,
                        optim={k: v for k, (v, _) in optim_tensors.items()}, scalars=scalars)
        except (OSError, ValueError) as failure:
            error = failure
    agree_on_failure(error, folder=final, what="write checkpoint")


def _write_rest(engine: "Engine", partial: str, final: str, *, tag: str, named: dict, tied: dict,
                client: tuple, optim: dict, scalars: Optional[dict]) -> None:
    """Rank 0: optimizer states, client tensors, engine.json; then publishes the folder."""
    encoded, client_tensors = client
    if optim:
        save_file_durably(optim, os.path.join(partial, "optim.safetensors"))
    if client_tensors:
        save_file_durably(client_tensors, os.path.join(partial, "client.safetensors"))
    optimizer = engine.optimizer
    group = optimizer.param_groups[0] if optimizer is not None and optimizer.param_groups else {}
    meta = {"format": FORMAT, "tag": tag, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
            "dp_world_size": engine.dp_world_size, "zero_stage": engine.config.zero_stage,
            "tensors": {name: {"shape": list(shape), "dtype": str(dtype)}
                           for name, dtype, shape in _model_specs(engine, named, frozen=True)[1]},
            "tied": tied, "optimizer": None if scalars is None else {
                **scalars, "lr": group.get("lr"), "betas": list(group["betas"]) if "betas" in group else None,
                "momentum": group.get("momentum")},
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "client_state": encoded, "ds_config": json.loads(json.dumps(dict(engine.config.raw)))}
    with open(os.path.join(partial, "engine.json"), "x", encoding="utf-8") as handle:
        json.dump(meta, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    old = None
    if os.path.lexists(final):  # the same tag again: the new folder replaces it
        old = os.path.join(os.path.dirname(final), f".{tag}.old")
        remove_path(old)
        os.replace(final, old)
    publish_folder(partial, final)
    if old is not None:
        remove_path(old)
        fsync_path(os.path.dirname(os.path.abspath(final)))


# ----------------------------------------------------------------------------------------------------------------
# load
def _read_meta(folder: str) -> dict:
    path = os.path.join(folder, "engine.json")
    try:
        with open(path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except OSError as error:
        raise ValueError(f"{path} cannot be read ({error.strerror}): {folder} is not a complete engine "
                         "checkpoint") from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a megatron_core engine checkpoint (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r}); DeepSpeed's own checkpoints load with DeepSpeed")
    return meta


def _resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    if tag is not None:
        return _check_tag(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        logger.warning("no %s file in %s: nothing loaded (pass tag= to load a given checkpoint)", LATEST, load_dir)
        return None
    with open(latest, encoding="utf-8") as handle:
        return _check_tag(handle.read().strip())


@torch.no_grad()
def _load_model(engine: "Engine", folder: str, meta: dict, *, strict: bool) -> dict[str, torch.nn.Parameter]:
    """Copies every saved parameter and buffer into the model (ZeRO-3: into this rank's shard, no gather)."""
    named, _ = _names(engine)
    buckets = {id(p): b for b in engine.ddp.buckets for p in b.params if b.shard_params}
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as reader:
        saved = set(reader.keys())
        buffers = {n: b for n, b in engine.module.state_dict(keep_vars=True).items()
                   if n not in named and not isinstance(b, torch.nn.Parameter)}
        missing = [n for n in list(named) + list(buffers) if n not in saved]
        unexpected = sorted(saved - set(named) - set(buffers))
        if strict and (missing or unexpected):
            raise ValueError(f"{folder}: the checkpoint does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]} (load_module_strict=False loads the rest)")
        for name, param in named.items():
            if name not in saved:
                continue
            full = reader.get_tensor(name)
            bucket = buckets.get(id(param))
            shape = tuple(bucket.shapes[param]) if bucket is not None else tuple(param.shape)
            if tuple(full.shape) != shape:
                raise ValueError(f"{folder}: {name} has shape {tuple(full.shape)} in the checkpoint, {shape} here")
            if bucket is not None:
                bucket.load_full(param, full)
            else:
                param.data.copy_(full)
        for name, buffer in buffers.items():
            if name in saved and isinstance(buffer, torch.Tensor):
                buffer.copy_(reader.get_tensor(name))
    return named


def load(engine: "Engine", load_dir: str, *, tag: Optional[str], strict: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True
         ) -> tuple[Optional[str], Optional[dict]]:
    """Loads a checkpoint written by ``save`` at any dp size and ZeRO stage; returns ``(folder, client_state)``
    or ``(None, None)`` without a ``latest`` file. Collective only through the optimizer's parameter gather."""
    tag = _resolve_tag(load_dir, tag)
    if tag is None:
        return None, None
    folder = os.path.join(load_dir, tag)
    meta = _read_meta(folder)
    named = _load_model(engine, folder, meta, strict=strict)
    optimizer = engine.optimizer
    if optimizer is not None:
        if load_optimizer_states and meta["optimizer"] is not None:
            _load_optimizer(engine, folder, meta["optimizer"], named)
        else:
            optimizer.reload_model_params()  # masters that are copies (fp16/bf16, offload) from the weights
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    engine.global_steps, engine.global_samples = meta["global_steps"], meta["global_samples"]
    engine.skipped_steps = meta["skipped_steps"]
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    client_tensors: dict[str, torch.Tensor] = {}
    client_path = os.path.join(folder, "client.safetensors")
    if os.path.isfile(client_path):
        with safe_open(client_path, framework="pt") as reader:
            client_tensors = {k: reader.get_tensor(k) for k in reader.keys()}
    return folder, decode_client_state(meta["client_state"], client_tensors)


def _load_optimizer(engine: "Engine", folder: str, saved: dict, named: dict) -> None:
    optimizer = engine.optimizer
    path = os.path.join(folder, "optim.safetensors")
    stack = contextlib.ExitStack()
    with stack:
        reader = stack.enter_context(safe_open(path, framework="pt")) if os.path.isfile(path) else None
        keys = set(reader.keys()) if reader is not None else set()

        def read(name: str, param: Any) -> Optional[torch.Tensor]:
            return reader.get_tensor(name) if name in keys else None
        restore_optimizer_state(optimizer, {id(p): n for n, p in named.items()},
                                {"step": saved.get("step", 0.0), "grad_scaler": saved.get("grad_scaler")}, read)
    for group in optimizer.param_groups:
        if saved.get("lr") is not None:
            group["lr"] = saved["lr"]
        if saved.get("betas") is not None and "betas" in group:
            group["betas"] = tuple(saved["betas"])


__all__ = ["save", "load", "encode_client_state", "decode_client_state", "FORMAT", "LATEST"]
