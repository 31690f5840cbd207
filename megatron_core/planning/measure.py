"""Measuring what the planner predicts, on this machine's ranks: model-state bytes (``memory_report``), the
peak of the bytes autograd holds for backward, and the step time of one training step at a layout.

Run ``measure_layout`` on every rank (e.g. with ``megatron_core.testing.run_distributed``); each rank returns
its own numbers. Used by ``tests/distributed/test_planner.py`` and ``scripts/benchmark.py --only planner``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.context_parallel import split_batch
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.fp8 import update_fp8_scales
from megatron_core.models import GPTModel
from megatron_core.optimizer import OptimizerConfig, get_optimizer, memory_report
from megatron_core.optimizer.memory import MemoryCategories
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.tensor_parallel import model_parallel_seed
from megatron_core.transformer.specs import layer_spec_for
from megatron_core.utils.live_memory import LiveMemoryTracker


class SavedActivationTracker:
    """Counts the bytes of tensors autograd saves for backward while they are alive, once per storage,
    parameters excluded; ``peak`` is the largest total seen. Use as a context manager around forward and
    backward (it installs ``torch.autograd.graph.saved_tensors_hooks``)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: collections.Counter = collections.Counter()
        self._sizes: dict[int, int] = {}
        self._recomputed: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivationTracker":
        self._original_recompute_init = torch.utils.checkpoint._recomputation_hook.__init__
        torch.utils.checkpoint._recomputation_hook.__init__ = self._counting_recompute_init()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        torch.utils.checkpoint._recomputation_hook.__init__ = self._original_recompute_init

    def _counting_recompute_init(self):
        """Full recompute (non-reentrant ``torch.utils.checkpoint``) saves the recomputed tensors through
        its own hooks, which take precedence over ours: count them too, alive until garbage."""
        original, tracker = self._original_recompute_init, self

        def init(hook, target_frame_ref, gid) -> None:
            original(hook, target_frame_ref, gid)
            pack = hook.pack_hook

            def counting_pack(x):
                result = pack(x)
                frame = target_frame_ref()
                for stored in list(frame.recomputed[gid].values()) if frame is not None else []:
                    if id(stored) not in tracker._recomputed:
                        key = tracker._register(stored)
                        if key is not None:  # the stored tensor is dropped once backward has used it
                            tracker._recomputed.add(id(stored))
                            weakref.finalize(stored, tracker._release_recomputed, id(stored), key)
                return result

            hook.pack_hook = counting_pack
        return init

    def _register(self, tensor: torch.Tensor) -> Optional[int]:
        """Counts ``tensor``'s storage once (None for parameters and empty storages); returns its key."""
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return None
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key == 0 or nbytes == 0:
            return None
        if self._refs[key] == 0:
            self._sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        return key

    def _pack(self, tensor: torch.Tensor):
        key = self._register(tensor)
        return tensor if key is None else _Saved(tensor, key, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release_recomputed(self, ident: int, key: int) -> None:
        self._recomputed.discard(ident)
        self.release(key)

    def release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live -= self._sizes.pop(key)
            del self._refs[key]


class _Saved:
    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: int, tracker: SavedActivationTracker) -> None:
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self) -> None:
        self.tracker.release(self.key)


@dataclasses.dataclass(frozen=True)
class LayoutMeasurement:
    """One rank's numbers for one training step."""

    pp_rank: int
    model_state_bytes: int
    activation_bytes: int
    step_seconds: float
    transient_bytes: Optional[int] = None
    """With ``track_live``: the peak live bytes of ZeRO's gathered parameters plus that of its gradient buckets
    (``LiveMemoryTracker``; the step time then includes the tracker's overhead)."""


def _chunks(config: TransformerConfig, state, vocab_size: int, seq_length: int) -> list[GPTModel]:
    vpp = state.vpp_size
    spec = {"layer_spec": layer_spec_for(config)}
    chunks = []
    for vp in range(vpp or 1):
        torch.manual_seed(0)
        first = state.is_first_model_chunk(vp) if vpp else state.is_pipeline_first_stage
        last = state.is_last_model_chunk(vp) if vpp else state.is_pipeline_last_stage
        chunks.append(GPTModel(config, parallel_state=state, vocab_size=vocab_size, max_sequence_length=seq_length,
                               pre_process=first, post_process=last, vp_stage=vp if vpp else None,
                               make_vocab_size_divisible_by=8, **spec))
    return chunks


def measure_layout(config_kwargs: dict, *, tp: int, pp: int, zero_stage: int, vocab_size: int, seq_length: int,
                   micro_batch_size: int, num_microbatches: int, steps: int = 1,
                   vpp: Optional[int] = None, track_live: bool = False, cp: int = 1,
                   ep: int = 1, etp: int = 1, track_activations: bool = True,
                   grad_reduce_in_fp32: bool = True, dtype: torch.dtype = torch.bfloat16) -> LayoutMeasurement:
    """Builds the GPT at (tp, cp, pp, dp = world / (tp cp pp)) with ZeRO ``zero_stage`` (sharded over dp x cp),
    bf16 with fp32 grads and fp32 Adam masters (the training loop's defaults), runs ``steps`` steps; returns
    the last step's numbers. With cp > 1 each cp rank gets its ``split_batch`` tokens and the loss is
    normalized as the training loop's ``forward_step`` (sum over the cp ranks' tokens, times cp). An MoE
    model (``config_kwargs["moe"]``) runs at expert-parallel size ``ep`` (and expert tensor-parallel size
    ``etp``), experts over expert-dp. ``track_activations=False`` times the step without the saved-tensor
    hooks (``activation_bytes`` is then 0). ``grad_reduce_in_fp32=False``: grads kept and reduced in bf16
    (``--grad-reduce-in-bf16``). ``dtype=torch.float32``: an fp32 model (no masters), for CPUs without bf16
    instructions (``planning.calibrate.fastest_cpu_dtype``)."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"measure_layout dtype {dtype} is not supported: use torch.bfloat16 or torch.float32")
    state = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                                      expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    config = TransformerConfig(**config_kwargs, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                               max_position_embeddings=seq_length, params_dtype=dtype,
                               bf16=dtype == torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(zero_stage=zero_stage, grad_reduce_in_fp32=grad_reduce_in_fp32)
    chunks = [DistributedDataParallel(c, config=ddp_config, dp_group=state.dp_cp_group,
                                      expert_dp_group=state.expert_dp_group)
              for c in _chunks(config, state, vocab_size, seq_length)]
    model_parallel_seed(1 + state.pp_rank, tp_rank=state.tp_rank, tracker=state.rng_tracker)
    optimizer = get_optimizer(OptimizerConfig(bf16=dtype == torch.bfloat16), chunks, parallel_state=state)
    g = torch.Generator().manual_seed(state.dp_rank)
    tokens = torch.randint(0, vocab_size, (num_microbatches, micro_batch_size, seq_length + 1), generator=g)
    positions = torch.arange(seq_length).expand(micro_batch_size, seq_length)
    batches = [split_batch({"tokens": t[:, :-1], "labels": t[:, 1:], "position_ids": positions},
                           cp_size=state.cp_size, cp_rank=state.cp_rank) for t in tokens]

    def forward_step(iterator, model):
        batch = next(iterator)
        output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])

        def loss_func(per_token_loss):
            # the loss-mask average over the whole sequence (all ones here: the token count of every cp
            # rank), times cp because the gradient reduction averages over dp x cp (training/loop.py)
            count = torch.tensor(float(per_token_loss.numel()))
            if state.cp_size > 1:
                dist.all_reduce(count, group=state.cp_group)
            loss = per_token_loss.float().sum() * state.cp_size / count
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    schedule = get_forward_backward_func(state.pp_size, state.vpp_size)
    categories = MemoryCategories(chunks, optimizer)  # the module walk once, outside the timed steps
    for _ in range(steps):
        optimizer.zero_grad()
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        live = LiveMemoryTracker(categories=categories, every_op=False)
        tracker = SavedActivationTracker()
        with tracker if track_activations else contextlib.nullcontext(), \
                live if track_live else contextlib.nullcontext():
            schedule(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks] if vpp
                     else iter(batches), model=chunks if vpp else chunks[0], num_microbatches=num_microbatches,
                     seq_length=seq_length, micro_batch_size=micro_batch_size, parallel_state=state)
        update_fp8_scales(chunks, state)  # FP8 delayed scaling (as training/loop.py): the next step's scales
        optimizer.step()
        seconds = time.perf_counter() - start
    transient = None
    if track_live:
        transient = live.peak_by_category["gathered_parameters"] + live.peak_by_category["grad_buckets"]
    result = LayoutMeasurement(pp_rank=state.pp_rank, model_state_bytes=memory_report(chunks, optimizer).total,
                               activation_bytes=tracker.peak, step_seconds=seconds, transient_bytes=transient)
    destroy_model_parallel(state)
    return result


__all__ = ["SavedActivationTracker", "LayoutMeasurement", "measure_layout"]
