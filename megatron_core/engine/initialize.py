"""``init_distributed`` and ``initialize``: DeepSpeed's entry points, building megatron_core's pieces.

``initialize`` validates the config (``EngineConfig``), builds the parallel state (every rank is a dp rank),
converts the model's precision (fp16 / bf16), wraps it in ``DistributedDataParallel`` at the configured
ZeRO stage (a model built under ``zero.Init`` is materialized shard by shard at stage 3, whole otherwise),
offloads ZeRO-3 parameter shards, builds ``MegatronOptimizer`` from the config's optimizer or a client
optimizer's settings, the lr schedule, and the data loader.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron_core.distributed import DistributedDataParallel
from megatron_core.engine.config import EngineConfig, OptimizerSpec
from megatron_core.engine.data import EngineDataLoader
from megatron_core.engine.engine import Engine, SmallParametersRoot
from megatron_core.engine.lr_schedules import SCHEDULES
from megatron_core.engine.zero import register_zero3_buckets
from megatron_core.engine.zero_init import materialize_
from megatron_core.optimizer import get_optimizer
from megatron_core.optimizer.offload import offload_parameters
from megatron_core.parallel_state import ParallelState, initialize_model_parallel
from megatron_core.utils import accelerator

logger = logging.getLogger(__name__)
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # DeepSpeed's default_pg_timeout


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initializes torch.distributed as DeepSpeed does (a no-op when it already is).

    The rank and world size come from ``rank``/``world_size`` or the launcher's ``RANK``/``WORLD_SIZE``
    (torchrun, deepspeed); without them this is a world of one process (on a free local port). The backend
    defaults to nccl with CUDA, else gloo. ``timeout`` bounds every collective of the default group.
    ``auto_mpi_discovery``, ``verbose`` and ``config`` are accepted and unused (no MPI launcher here).
    """
    del auto_mpi_discovery, config
    if dist.is_initialized() or dist_init_required is False:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if rank < 0 and "RANK" not in os.environ:
        rank, world_size = 0, 1
        init_method = init_method or f"tcp://127.0.0.1:{_free_port()}"
    elif rank < 0:
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(f"RANK={os.environ['RANK']} is set but WORLD_SIZE is not: launch with torchrun (or "
                             "deepspeed), or set both, or pass rank= and world_size=")
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        init_method = "env://"
    if verbose:
        logger.info("initializing torch.distributed: backend %s, rank %d of %d", backend, rank, world_size)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    if backend == "nccl":  # CUDA-only path
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, accelerator.device_count()))))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize(args: Any = None, model: Optional[nn.Module] = None,
               optimizer: Union[torch.optim.Optimizer, Callable, None] = None,
               model_parameters: Optional[Iterable] = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config: Union[str, dict, None] = None, config_params: Union[str, dict, None] = None,
               timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's ``deepspeed.initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` names the config when ``config`` is None.
        model: any ``nn.Module`` (required).
        optimizer: a ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` (or a callable taking the parameters and
            returning one) whose settings and param groups the engine's optimizer takes over; or None to use
            the config's ``optimizer`` section.
        model_parameters: the parameters or param-group dicts (``params``, ``weight_decay``, ``lr``) to train;
            default every parameter, decayed with the config's ``weight_decay``.
        training_data: a map-style dataset: a loader of this rank's micro-batches is returned.
        lr_scheduler: a scheduler object (driving the client ``optimizer``) or a callable taking the engine's
            optimizer; None to use the config's ``scheduler`` section.
        collate_fn: the data loader's collate function.
        config: the DeepSpeed config, a dict or a JSON path (``config_params`` is its old name).
        timeout: bounds every collective of the engine's process groups.
    Collectives: process-group creation and the wrapper's setup over all ranks.
    """
    del mpu
    if model is None:
        raise ValueError("initialize() needs model=: the nn.Module to train")
    config = _config_source(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required, timeout=timeout)
    state = initialize_model_parallel(timeout=timeout)
    cfg = EngineConfig.from_json(config, dp_size=state.dp_size)
    groups = _param_groups(model, model_parameters)
    spec, groups, follower = _optimizer_spec(cfg, optimizer, groups)
    no_decay_names = _no_decay_names(model, groups, spec)
    ddp = _wrap(model, cfg, state)
    engine_optimizer = None
    if spec is not None:
        no_decay = {id(p) for name, p in model.named_parameters() if name in no_decay_names}
        engine_optimizer = get_optimizer(cfg.optimizer_config(spec), ddp, parallel_state=state,
                                         no_weight_decay_cond=lambda param: id(param) in no_decay)
    scheduler = _scheduler(cfg, lr_scheduler, engine_optimizer)
    engine = Engine(ddp=ddp, optimizer=engine_optimizer, lr_scheduler=scheduler, config=cfg, state=state,
                    lr_follower=follower if lr_scheduler is not None else None, num_param_groups=len(groups))
    loader = None
    if training_data is not None:
        loader = EngineDataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                  dp_rank=state.dp_rank, dp_size=state.dp_size, collate_fn=collate_fn,
                                  drop_last=cfg.dataloader_drop_last, pin_memory=ddp.device.type == "cuda")
        engine.training_dataloader = loader
    return engine, engine_optimizer, loader, scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Union[str, dict]:
    if config is not None and config_params is not None:
        raise ValueError("pass the DeepSpeed config once: config= or config_params=, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise ValueError(f"the DeepSpeed config is given twice: config= and args.deepspeed_config={from_args!r}")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("no DeepSpeed config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    return config


def _param_groups(model: nn.Module, model_parameters: Optional[Iterable]) -> list[dict]:
    """The client's param groups as dicts; every trainable parameter of ``model`` in exactly one."""
    items = list(model.parameters() if model_parameters is None else model_parameters)
    if not items:
        raise ValueError("model_parameters is empty: pass model.parameters() or param-group dicts")
    if all(isinstance(item, dict) for item in items):
        groups = [dict(item, params=list(item["params"])) for item in items]
    elif all(isinstance(item, torch.Tensor) for item in items):
        groups = [{"params": items}]
    else:
        raise ValueError("model_parameters must be parameters or param-group dicts (with 'params'), not a mix")
    for index, group in enumerate(groups):
        unknown = set(group) - {"params", "weight_decay", "lr", "name"}
        if unknown:
            raise ValueError(f"param group {index} sets {sorted(unknown)}: only 'params', 'weight_decay', 'lr' "
                             "and 'name' are supported per group (the rest comes from the optimizer config)")
    listed = [id(p) for group in groups for p in group["params"]]
    if len(listed) != len(set(listed)):
        raise ValueError("a parameter appears in more than one param group")
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in set(listed)]
    if missing:
        raise ValueError(f"trainable parameters missing from model_parameters: {missing[:5]}; list every "
                         "trainable parameter or set requires_grad=False on those you do not train")
    return groups


def _optimizer_spec(cfg: EngineConfig, client: Any,
                    groups: list[dict]) -> tuple[Optional[OptimizerSpec], list[dict], Any]:
    """The optimizer to build: the config's, or the client optimizer's settings and param groups."""
    if client is None:
        return cfg.optimizer, groups, None
    if cfg.optimizer is not None:
        raise ValueError("an optimizer is given twice: optimizer= and the config's optimizer section; remove one")
    if callable(client) and not isinstance(client, torch.optim.Optimizer):
        client = client([p for group in groups for p in group["params"]] if len(groups) == 1 else groups)
    if not isinstance(client, torch.optim.Optimizer):
        raise ValueError(f"optimizer= must be a torch.optim.Optimizer or a callable returning one, got "
                         f"{type(client).__name__}")
    return _spec_from_client(client), [dict(g) for g in client.param_groups], client


def _spec_from_client(client: torch.optim.Optimizer) -> OptimizerSpec:
    """AdamW / Adam (no weight decay) / SGD settings, the same in every group."""
    name = type(client).__name__
    groups = client.param_groups
    shared = {"AdamW": ("lr", "betas", "eps"), "Adam": ("lr", "betas", "eps", "weight_decay"),
              "SGD": ("lr", "momentum")}.get(name)
    if shared is None:
        raise ValueError(f"client optimizer {name} is not supported: pass torch.optim.AdamW, Adam or SGD, or "
                         "set the config's optimizer section")
    for key in shared:
        values = {str(g[key]) for g in groups}
        if len(values) > 1:
            raise ValueError(f"the client {name}'s param groups differ in {key} ({sorted(values)}); the engine "
                             f"keeps one {key} for all groups")
    first = groups[0]
    for key in ("amsgrad", "nesterov", "maximize", "dampening"):
        if first.get(key):
            raise ValueError(f"the client {name} sets {key}={first[key]}, which is not supported here")
    decays = sorted({float(g.get("weight_decay", 0.0)) for g in groups} - {0.0})
    if name == "Adam" and decays:
        raise ValueError(f"torch.optim.Adam with weight_decay={decays[0]} is L2 regularization, which is not "
                         "supported here: use torch.optim.AdamW (decoupled weight decay)")
    kind = "sgd" if name == "SGD" else "adam"
    return OptimizerSpec(kind=kind, lr=float(first["lr"]), weight_decay=decays[0] if decays else 0.0,
                         betas=tuple(first.get("betas", (0.9, 0.999))), eps=float(first.get("eps", 1e-8)),
                         momentum=float(first.get("momentum", 0.0)))


def _no_decay_names(model: nn.Module, groups: list[dict], spec: Optional[OptimizerSpec]) -> set[str]:
    """Names of the parameters in groups without weight decay; groups must agree on lr and nonzero decay."""
    if spec is None:
        return set()
    names = {id(p): name for name, p in model.named_parameters()}
    lrs = {float(g["lr"]) for g in groups if "lr" in g}
    if len(lrs) > 1 or (lrs and lrs != {spec.lr}):
        raise ValueError(f"param groups set lr {sorted(lrs)} but the optimizer's lr is {spec.lr}: the engine keeps "
                         "one lr for all groups (the optimizer's); remove the per-group lr")
    decays = {float(g.get("weight_decay", spec.weight_decay)) for g in groups} - {0.0}
    if decays - {spec.weight_decay}:
        raise ValueError(f"param groups set weight_decay {sorted(decays)} and the optimizer "
                         f"{spec.weight_decay}: the engine supports one nonzero weight decay (and 0 per group)")
    return {names[id(p)] for g in groups if float(g.get("weight_decay", spec.weight_decay)) == 0.0
            for p in g["params"] if id(p) in names}


def _wrap(model: nn.Module, cfg: EngineConfig, state: ParallelState) -> DistributedDataParallel:
    """Precision, materialization of a ``zero.Init`` model, the data-parallel wrapper, parameter offload."""
    if cfg.fp16_enabled:
        model.half()
    elif cfg.bf16_enabled:
        model.bfloat16()
    device = state.device
    if cfg.zero_stage != 3:
        materialize_(model, device=device)  # a zero.Init model, whole (no-op otherwise)
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
    if cfg.zero_stage == 3 and cfg.raw["zero_optimization"]["reduce_bucket_size"] is not None:
        logger.warning("zero_optimization.reduce_bucket_size has no effect at stage 3: one bucket per module")
    small_together = cfg.zero_stage == 3 and cfg.zero["stage3_param_persistence_threshold"] > 0
    root = SmallParametersRoot(model) if small_together else model
    ddp = DistributedDataParallel(root, config=cfg.ddp_config(), dp_group=state.dp_group, device=device)
    register_zero3_buckets(ddp)
    offload = cfg.zero["offload_param"]
    if offload["device"] != "none":
        rank = dist.get_rank() if dist.is_initialized() else 0
        offload_parameters(ddp, offload["device"], directory=offload["nvme_path"], rank=rank)
    return ddp


def _scheduler(cfg: EngineConfig, client: Any, optimizer: Any) -> Any:
    if client is not None:
        if cfg.scheduler is not None:
            raise ValueError("an lr scheduler is given twice: lr_scheduler= and the config's scheduler section")
        if callable(client) and not hasattr(client, "step"):
            inner = getattr(optimizer, "optimizer", None)
            return client(inner if isinstance(inner, torch.optim.Optimizer) else optimizer)
        return client
    if cfg.scheduler is None or optimizer is None:
        return None
    return SCHEDULES[cfg.scheduler.type](optimizer, **cfg.scheduler.params)


__all__ = ["init_distributed", "initialize", "DEFAULT_TIMEOUT"]
