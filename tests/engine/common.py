"""Models we did not write (a transformers GPT-2, an nn.Sequential, a module with a parameter used twice and a
buffer), their batches, the single-process plain-torch reference loop, and the engine loop run on every rank."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch._dynamo  # noqa: F401  (the first optimizer step imports it: ~9 s here; imported before the
import torch.distributed as dist  # rank pool forks, every rank inherits it)
import torch.nn.functional as F
import transformers
from torch import nn

GLOBAL_BATCH, MICRO, STEPS, LR, WEIGHT_DECAY = 8, 2, 4, 1e-2, 0.1
# Adam's eps: GPT-2's key biases get pure rounding-noise grads (~1e-11; softmax ignores them), which Adam with
# eps 1e-8 turns into 1e-5-sized steps that differ between any two summation orders; 1e-6 keeps those below 1e-7
EPS = 1e-6
VOCAB, SEQ = 64, 8
transformers.logging.set_verbosity_error()


def gpt2(seed: int = 0, *, layers: int = 2) -> nn.Module:
    """transformers' GPT2LMHeadModel from a config: Conv1D layers, tied embeddings, no dropout."""
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def sequential(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


class SharedUse(nn.Module):
    """``block`` runs twice per forward, ``scale`` (a parameter) is used in two places, ``offset`` is a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(16))
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inp(x)) * self.scale + self.offset
        hidden = torch.tanh(self.block(torch.tanh(self.block(hidden)))) * self.scale
        return self.out(hidden)


def shared_use(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SharedUse()


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "sequential": sequential, "shared_use": shared_use}


def batch(kind: str, step: int, rows: int = GLOBAL_BATCH) -> tuple[torch.Tensor, ...]:
    """The global batch of ``step`` (the same on every rank)."""
    generator = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt2":
        return (torch.randint(0, VOCAB, (rows, SEQ), generator=generator),)
    return torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)


def loss_of(kind: str, model: Any, data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if kind == "gpt2":
        return model(input_ids=data[0], labels=data[0]).loss
    return F.mse_loss(model(data[0]).float(), data[1])


def reference(kind: str, *, steps: int = STEPS, optimizer: str = "adamw", groups: Optional[Callable] = None,
              clip: float = 1.0, model: Optional[nn.Module] = None,
              scheduler: Optional[Callable] = None) -> tuple[list[float], dict, list[float]]:
    """Single-process plain torch on the full batch: ``(losses, final state_dict, grad norms)``."""
    model = model if model is not None else MODELS[kind]()
    params = groups(model) if groups is not None else model.parameters()
    if optimizer == "adamw":
        torch_optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    else:
        torch_optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY)
    lr_scheduler = scheduler(torch_optimizer) if scheduler is not None else None
    losses, norms = [], []
    for step in range(steps):
        torch_optimizer.zero_grad()
        loss = loss_of(kind, model, batch(kind, step))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        torch_optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def ds_config(stage: int, *, optimizer: str = "AdamW", **extra: Any) -> dict:
    params = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    params.update({"momentum": 0.9} if optimizer == "SGD" else {"eps": EPS})
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
            "optimizer": {"type": optimizer, "params": params}, "zero_optimization": {"stage": stage}, **extra}


def train_steps(engine: Any, kind: str, steps: range, *, cast: Optional[torch.dtype] = None,
                before_backward: Optional[Callable] = None) -> list[float]:
    """Runs optimizer steps ``steps`` on this rank's rows of each global batch, micro-batch by micro-batch;
    returns each step's loss averaged over micro-batches and dp ranks."""
    dp, rank = engine.dp_world_size, engine.state.dp_rank
    rows = GLOBAL_BATCH // dp
    losses = []
    for step in steps:
        mine = [t[rank * rows:(rank + 1) * rows] for t in batch(kind, step)]
        total = torch.zeros(())
        for i in range(0, rows, engine.train_micro_batch_size_per_gpu()):
            micro = [t[i:i + engine.train_micro_batch_size_per_gpu()] for t in mine]
            if cast is not None and kind != "gpt2":
                micro[0] = micro[0].to(cast)
            loss = loss_of(kind, engine, tuple(micro))
            if before_backward is not None:
                loss = before_backward(engine, step, loss)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        total /= engine.gradient_accumulation_steps()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total) / dp)
    return losses


def full_state(engine: Any) -> dict:
    """The model's full weights (ZeRO-3: gathered)."""
    from megatron_core.engine import zero
    with zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _warm_up() -> None:
    """Imports what the first GPT-2 step imports lazily (transformers' GPT-2 code, the attention-mask helpers,
    torch._dynamo through the optimizer: ~4 s here), before the rank pools fork, so no rank pays it again."""
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    loss_of("gpt2", model, batch("gpt2", 0, rows=1)).backward()
    optimizer.step()


_warm_up()
