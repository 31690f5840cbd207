"""Tensor x data parallel demo: a small byte-level language model trained on N gloo ranks, checked against
the same model trained in one process.

    torchrun --nproc-per-node 4 scripts/tp_demo.py --tensor-model-parallel-size 2 --sequence-parallel

The model is VocabParallelEmbedding -> ColumnParallelLinear -> GELU -> RowParallelLinear -> output layer tied
to the embedding -> vocab_parallel_cross_entropy. Ranks form tp groups of ``--tensor-model-parallel-size``
and dp = world / tp replicas; each replica trains on its slice of the global batch and gradients are
averaged over dp. Rank 0 then trains the tp=1 model from the same seed on the whole global batch and prints
both loss curves; the run fails if they differ by more than 1e-4. The corpus is the bytes of this
repository's Python sources (present wherever the demo is).
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_core import ParallelState, destroy_model_parallel, initialize_model_parallel
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
    vocab_size_with_padding,
)

BYTE_VOCAB = 256


class TinyParallelLM(nn.Module):
    """One tensor-parallel MLP block over token embeddings; activations ``[s, b, h]`` (``[s/tp, b, h]`` with
    sequence parallelism between the blocks)."""

    def __init__(self, *, vocab: int, hidden: int, ffn: int, tp_group, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.embedding = VocabParallelEmbedding(vocab, hidden, tp_group=tp_group,
                                                reduce_scatter_embeddings=sequence_parallel)
        self.fc1 = ColumnParallelLinear(hidden, ffn, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn, hidden, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.output_layer = ColumnParallelLinear(hidden, vocab, tp_group=tp_group, bias=False,
                                                 sequence_parallel=sequence_parallel,
                                                 skip_weight_param_allocation=True)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens, labels ``[b, s]`` -> mean loss over the tokens of this replica."""
        hidden = self.embedding(tokens)
        if not self.sequence_parallel:
            hidden = hidden.transpose(0, 1)  # [s, b, h]
        mlp, _ = self.fc2(F.gelu(self.fc1(hidden)[0]))
        logits, _ = self.output_layer(hidden + mlp, weight=self.embedding.weight)  # [s, b, V/tp]
        return vocab_parallel_cross_entropy(logits, labels.t(), tp_group=self.fc1.tp_group).mean()


def load_corpus(seq_length: int) -> torch.Tensor:
    """All samples of ``seq_length + 1`` bytes of the repository's Python sources, ``[n, seq_length + 1]``."""
    root = pathlib.Path(__file__).resolve().parent.parent
    data = b"".join(path.read_bytes() for path in sorted(root.glob("megatron_core/**/*.py")))
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n = (tokens.numel() - 1) // seq_length
    return torch.stack([tokens[i * seq_length: i * seq_length + seq_length + 1] for i in range(n)])


def train(model: nn.Module, batches: list[torch.Tensor], *, lr: float, state: ParallelState | None) -> list[float]:
    """Adam on each batch ``[b, s + 1]``; with ``state``, grads are averaged over dp (and sequence-parallel
    grads summed over tp). Returns the loss averaged over the global batch at every step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if state is not None:
            loss = _reduce_grads_and_loss(model, loss.detach(), state)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _reduce_grads_and_loss(model: nn.Module, loss: torch.Tensor, state: ParallelState) -> torch.Tensor:
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and state.tp_size > 1:
            dist.all_reduce(param.grad, group=state.tp_group)
        if state.dp_size > 1:
            dist.all_reduce(param.grad, group=state.dp_group)
            param.grad /= state.dp_size
    if state.dp_size > 1:
        dist.all_reduce(loss, group=state.dp_group)
        loss /= state.dp_size
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=None, help="default: world size")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--ffn-hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="per data-parallel replica")
    parser.add_argument("--train-iters", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    torch.set_num_threads(1)
    state = initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size or dist.get_world_size())
    vocab = vocab_size_with_padding(BYTE_VOCAB, make_vocab_size_divisible_by=64,
                                    tensor_model_parallel_size=state.tp_size)
    samples = load_corpus(args.seq_length)
    global_batch = args.micro_batch_size * state.dp_size
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(samples.shape[0], generator=generator)[: global_batch * args.train_iters]
    global_batches = list(samples[order].split(global_batch))
    dims = dict(vocab=vocab, hidden=args.hidden_size, ffn=args.ffn_hidden_size)

    torch.manual_seed(args.seed)
    model = TinyParallelLM(**dims, tp_group=state.tp_group, sequence_parallel=args.sequence_parallel)
    mine = [b[state.dp_rank * args.micro_batch_size: (state.dp_rank + 1) * args.micro_batch_size]
            for b in global_batches]
    start = time.perf_counter()
    parallel_losses = train(model, mine, lr=args.lr, state=state)
    parallel_s = time.perf_counter() - start

    if dist.get_rank() == 0:
        torch.manual_seed(args.seed)
        reference = TinyParallelLM(**dims, tp_group=None, sequence_parallel=False)
        reference_losses = train(reference, global_batches, lr=args.lr, state=None)
        _report(args, state, parallel_losses, reference_losses, parallel_s)
    destroy_model_parallel(state)
    dist.destroy_process_group()


def _report(args, state, parallel_losses, reference_losses, parallel_s) -> None:
    print(f"layout: world={state.world_size} tp={state.tp_size} dp={state.dp_size} "
          f"sequence_parallel={args.sequence_parallel}; {args.train_iters} iterations in {parallel_s:.2f} s")
    print(f"{'iter':>5} {'parallel loss':>14} {'tp=1 loss':>12} {'|diff|':>9}")
    for step, (mine, ref) in enumerate(zip(parallel_losses, reference_losses), 1):
        if step == 1 or step % 5 == 0:
            print(f"{step:>5} {mine:>14.6f} {ref:>12.6f} {abs(mine - ref):>9.2e}")
    worst = max(abs(a - b) for a, b in zip(parallel_losses, reference_losses))
    print(f"max |parallel - single-process| loss difference: {worst:.2e}")
    if worst > 1e-4 or not parallel_losses[-1] < parallel_losses[0]:
        raise SystemExit("FAILED: the parallel run diverged from the single-process reference or did not learn")
    print("OK: tensor x data parallel training matches the single-process run")


if __name__ == "__main__":
    main()
