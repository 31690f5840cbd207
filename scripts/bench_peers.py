"""The train steps ``scripts/benchmark.py`` times side by side: ours and the peers, built on this rank.

Each builder returns a ``step()`` that runs one optimizer step (forward + backward + AdamW, fp32, dropout off)
on this rank's rows of the same GPT shape and the same tokens:

- ``ours_step``: our ``GPTModel`` at the tp size of the parallel state, plain or in our
  ``DistributedDataParallel`` at ZeRO stage 0-3 (dp = the state's dp size); ``micro_batches`` > 1 accumulates
  grads over that many micro-batches (the single-process reference of a dp run does 2 of them);
- ``eager_step``: the nanoGPT-style eager model of ``nanogpt_reference.py``, alone or under DTensor tp;
- ``torch_dp_step``: our ``GPTModel`` under ``torch.nn.parallel.DistributedDataParallel`` or FSDP2
  ``fully_shard`` (per layer and root), so only the data-parallel machinery differs from ours;
- ``deepspeed_step``: the same model in DeepSpeed's engine at ZeRO stage 2 or 3 (its defaults, gloo on CPU,
  as ``bench_memory.py`` runs it);
- ``megatron_core_step``: NVIDIA megatron-core 0.16.1's ``GPTModel`` (local layer spec, its own parallel
  state in module globals, the few CUDA calls of this path mapped to CPU, as
  ``tests/integration/megatron_core_reference.py`` does); it returns ``(step, close)``.

Optimizers: ours runs its default (torch's fused AdamW kernel); the eager model and the DDP/FSDP2 peers run
``torch.optim.AdamW`` with ``fused`` as given (default: torch's default, the per-op update on CPU);
megatron-core runs torch's default ``AdamW`` (its own optimizer needs CUDA); DeepSpeed its engine's AdamW.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from nanogpt_reference import GPTShape, NanoGPT, parallelize_dtensor

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.models import GPTModel
from megatron_core.optimizer import OptimizerConfig, get_optimizer

Step = Callable[[], None]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def batch(shape: GPTShape, rows: int, *, seed: int = 1, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` ``[rows, seq]`` of fixed random tokens (seed per dp rank)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (rows, shape.seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def ours_model(shape: GPTShape, state, device=None, **config) -> GPTModel:
    """Our GPTModel of ``shape`` at the state's tp size (untied output layer, as the eager peer)."""
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                               max_position_embeddings=shape.seq, hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=state.tp_size, untie_embeddings_and_output_weights=True,
                               **config)
    torch.manual_seed(0)
    return GPTModel(config, parallel_state=state, vocab_size=shape.vocab, max_sequence_length=shape.seq).to(device)


def ours_step(shape: GPTShape, rows: int, *, state=None, zero_stage: Optional[int] = None, micro_batches: int = 1,
              seed: int = 1, device=None) -> Step:
    """Our step on this rank: ``micro_batches`` micro-batches of ``rows`` rows, then the optimizer step."""
    state = state or initialize_model_parallel()
    model = ours_model(shape, state, device)
    if zero_stage is not None:
        model = DistributedDataParallel(model, dp_group=state.dp_group, config=DistributedDataParallelConfig(
            zero_stage=zero_stage, overlap_param_gather=zero_stage in (1, 2)))
    optimizer = get_optimizer(OptimizerConfig(lr=1e-4, clip_grad=0.0), model, parallel_state=state)
    micro = [batch(shape, rows, seed=seed + i, device=device) for i in range(micro_batches)]
    positions = torch.arange(shape.seq, device=device).expand(rows, shape.seq)

    def step() -> None:
        optimizer.zero_grad()
        for i, (inputs, labels) in enumerate(micro):
            last = i == len(micro) - 1
            with model.no_sync() if zero_stage is not None and not last else contextlib.nullcontext():
                (model(inputs, positions, labels=labels).mean() / len(micro)).backward()
        if zero_stage is not None:
            model.finish_grad_sync()
        optimizer.step()
    return step


def eager_step(shape: GPTShape, rows: int, *, dtensor: bool = False, fused: Optional[bool] = None,
               device=None) -> Step:
    """The eager nanoGPT-style model's step (``dtensor``: tensor-parallel over all ranks with DTensor)."""
    torch.manual_seed(0)
    model = NanoGPT(shape).to(device)
    if dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        model = parallelize_dtensor(model, init_device_mesh((device or torch.device("cpu")).type,
                                                            (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    inputs, labels = batch(shape, rows, device=device)

    def step() -> None:
        optimizer.zero_grad()
        model(inputs, labels).backward()
        optimizer.step()
    return step


def torch_dp_step(kind: str, shape: GPTShape, rows: int, *, state, fused: Optional[bool] = None) -> Step:
    """Our GPTModel under torch's ``DistributedDataParallel`` (``kind="ddp"``) or FSDP2 (``"fsdp2"``)."""
    model = ours_model(shape, state)
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=state.dp_group)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model.decoder.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    inputs, labels = batch(shape, rows, seed=1 + state.dp_rank)
    positions = torch.arange(shape.seq).expand(rows, shape.seq)

    def step() -> None:
        optimizer.zero_grad()
        model(inputs, positions, labels=labels).mean().backward()
        optimizer.step()
    return step


def deepspeed_step(stage: int, shape: GPTShape, rows: int, *, state) -> Step:
    """Our GPTModel in DeepSpeed's engine at ZeRO ``stage`` (its defaults; torch AdamW inside)."""
    import deepspeed
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    model = ours_model(shape, state)
    config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      dist_init_required=False)
    inputs, labels = batch(shape, rows, seed=1 + state.dp_rank)
    positions = torch.arange(shape.seq).expand(rows, shape.seq)

    def step() -> None:
        engine.backward(engine(inputs, positions, labels=labels).mean())
        engine.step()
    return step


def _patch_megatron_core_for_cpu() -> None:
    """The CUDA calls megatron-core makes on this path, mapped to CPU (dropout is off: no RNG fork)."""
    import megatron.core.tensor_parallel.random as mrandom
    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def megatron_core_step(shape: GPTShape, rows: int, *, tp: int) -> tuple[Step, Callable[[], None]]:
    """megatron-core's GPTModel at tp ``tp`` (= world size / dp) on CPU; ``close()`` drops its globals."""
    warnings.filterwarnings("ignore", module="megatron")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import torch.nn.functional as F
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig as MegatronConfig
    _patch_megatron_core_for_cpu()
    mps.initialize_model_parallel(tp, 1)
    config = MegatronConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                            ffn_hidden_size=4 * shape.hidden, activation_func=F.gelu, hidden_dropout=0.0,
                            attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            pipeline_dtype=torch.float32)
    torch.manual_seed(0)
    model = MegatronGPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                             vocab_size=shape.vocab, max_sequence_length=shape.seq,
                             share_embeddings_and_output_weights=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, labels = batch(shape, rows)
    positions = torch.arange(shape.seq).expand(rows, shape.seq)
    mask = torch.triu(torch.ones(shape.seq, shape.seq, dtype=torch.bool), 1)[None, None]  # True = masked

    def step() -> None:
        optimizer.zero_grad()
        model(inputs, positions, mask, labels=labels).mean().backward()
        optimizer.step()
    return step, mps.destroy_model_parallel
