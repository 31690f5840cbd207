"""The peer of scripts/benchmark.py: a plain eager PyTorch GPT in nanoGPT's style (karpathy/nanoGPT model.py),
with the same shape as megatron_core's GPTModel (pre-norm LayerNorm, GELU MLP of 4h, learned positions,
biases, untied output layer), and its tensor-parallel plan for PyTorch DTensor (``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``, as torchtitan does). Q, K and V are separate linears so that a
column split gives each rank whole heads.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        h = shape.hidden
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.proj = nn.Linear(h, h)
        self.head_dim = h // shape.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (B, nh, T, hs); nh is the local head count under tensor parallelism
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.fc = nn.Linear(shape.hidden, 4 * shape.hidden)
        self.proj = nn.Linear(4 * shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(shape.hidden), CausalSelfAttention(shape)
        self.ln_2, self.mlp = nn.LayerNorm(shape.hidden), MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(shape.vocab, shape.hidden), nn.Embedding(shape.seq, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln_f, self.lm_head = nn.LayerNorm(shape.hidden), nn.Linear(shape.hidden, shape.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parallelize_dtensor(model: NanoGPT, mesh) -> NanoGPT:
    """Megatron's split through DTensor: q/k/v and fc column-parallel, the projections row-parallel, the
    output layer column-parallel with its logits gathered (Replicate) for the loss."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.attn.q": ColwiseParallel(), f"blocks.{i}.attn.k": ColwiseParallel(),
                     f"blocks.{i}.attn.v": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return parallelize_module(model, mesh, plan)
