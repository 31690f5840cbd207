"""Train a tiny transformers GPT-2 (random weights from a config, no hub access) with DeepSpeed's API, run by
DeepSpeed itself or by megatron_core's engine: the backends differ only in the module imported.

    torchrun --nproc_per_node 2 scripts/engine_example.py --backend megatron_core --zero-stage 3
    torchrun --nproc_per_node 2 scripts/engine_example.py --backend deepspeed --zero-stage 3
    python scripts/engine_example.py --backend megatron_core            # one process

Each prints (rank 0) one JSON line: the loss of every optimizer step (mean over the micro-batches and dp
ranks), the lr and the grad norm. ``train()`` is importable: tests and scripts/bench_engine.py call it in
ranks they started themselves.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset


def import_backend(name: str) -> Any:
    """``deepspeed`` or ``megatron_core.engine``: the only line a DeepSpeed user changes."""
    if name == "deepspeed":
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() if dist.is_initialized() else 0))
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        return importlib.import_module("deepspeed")
    if name == "megatron_core":
        return importlib.import_module("megatron_core.engine")
    raise ValueError(f"--backend {name!r}: use deepspeed or megatron_core")


def ds_config(*, stage: int, micro: int, accumulation: int, lr: float = 1e-3, warmup: int = 4,
              clip: float = 1.0, offload: str = "none") -> dict:
    """The DeepSpeed config both backends read (``torch_adam``: DeepSpeed uses torch's AdamW on CPU)."""
    zero: dict[str, Any] = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": clip, "steps_per_print": 10 ** 9, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                         "warmup_num_steps": warmup, "warmup_type": "linear"}}}


def build_gpt2(*, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 32,
               seed: int = 0) -> torch.nn.Module:
    """A transformers ``GPT2LMHeadModel`` with random weights (tied embeddings, Conv1D layers, no dropout)."""
    import transformers
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                     n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


class RandomTokens(Dataset):
    """``size`` sequences of ``seq`` random tokens (sample i from seed ``seed + i``: the same on every rank)."""

    def __init__(self, size: int, seq: int, vocab: int, seed: int = 1) -> None:
        self.size, self.seq, self.vocab, self.seed = size, seq, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + index)
        return torch.randint(0, self.vocab, (self.seq,), generator=generator)


def train(backend: str, *, stage: int = 0, steps: int = 6, micro: int = 2, accumulation: int = 2,
          hidden: int = 64, layers: int = 2, seq: int = 32, offload: str = "none") -> dict:
    """Trains ``steps`` optimizer steps on every rank (torch.distributed initialized or a single process).

    Returns ``{"losses", "lrs", "grad_norms"}`` per optimizer step, the losses averaged over micro-batches and
    dp ranks (an all-reduce per step).
    """
    deepspeed = import_backend(backend)
    model = build_gpt2(layers=layers, hidden=hidden, seq=seq)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dataset = RandomTokens(steps * micro * accumulation * world, seq, model.config.vocab_size)
    config = ds_config(stage=stage, micro=micro, accumulation=accumulation, offload=offload)
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=dataset, config=config)
    losses, lrs, norms, window = [], [], [], []
    for tokens in loader:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        window.append(loss.detach().float())
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            mean = torch.stack(window).mean()
            if dist.is_initialized():
                dist.all_reduce(mean)
                mean /= world
            norm = engine.get_global_grad_norm()
            losses.append(float(mean))
            lrs.append(float(engine.get_lr()[0]))
            norms.append(None if norm is None else float(norm))
            window = []
    return {"losses": losses, "lrs": lrs, "grad_norms": norms}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("deepspeed", "megatron_core"), default="megatron_core")
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--offload-optimizer", choices=("none", "cpu"), default="none")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import_backend(args.backend).init_distributed(dist_backend="gloo")
    result = train(args.backend, stage=args.zero_stage, steps=args.steps, micro=args.micro_batch,
                   accumulation=args.accumulation, offload=args.offload_optimizer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({"backend": args.backend, "zero_stage": args.zero_stage, **result}))


if __name__ == "__main__":
    main(sys.argv[1:])
