"""``--compile`` (regional torch.compile of each transformer layer) against the eager model, one process, same
weights and data, train steps alternated (eager, compiled, eager, ...), median of --steps each.

    python scripts/bench_compile.py                          # GPT 4 layers, hidden 256, 8 heads, seq 128, batch 4
    python scripts/bench_compile.py --layers 8 --hidden 512 --seq 256 --threads 2

A train step is forward + backward + AdamW step, fp32, dropout off, the kernels' torch paths outside the
compiled layers too (on a GPU: the Triton kernels outside, inductor's inside). Compilation happens in the
warm-up steps and is reported separately; the losses of the two models are printed to show they agree.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"megatron_core_inductor_{os.getuid()}"))

import torch  # noqa: E402

from megatron_core import initialize_model_parallel  # noqa: E402
from megatron_core.config import TransformerConfig  # noqa: E402
from megatron_core.models import GPTModel  # noqa: E402


def build(args: argparse.Namespace, state, *, compile: bool):
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               max_position_embeddings=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                               compile=compile)
    torch.manual_seed(1234)
    model = GPTModel(config, parallel_state=state, vocab_size=args.vocab, max_sequence_length=args.seq).to(state.device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, optimizer, batch) -> tuple[float, float]:
    """One train step; returns (seconds, loss)."""
    tokens, positions, labels = batch
    begin = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, positions, labels=labels).mean()
    loss.backward()
    optimizer.step()
    if tokens.is_cuda:  # CUDA-only path
        torch.cuda.synchronize()
    return time.perf_counter() - begin, float(loss.detach())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per model (alternated)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (compilation)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    state = initialize_model_parallel()
    (eager, eager_opt), (compiled, compiled_opt) = build(args, state, compile=False), build(args, state, compile=True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(state.device)
    positions = torch.arange(args.seq, device=state.device).expand(args.batch, -1)
    batch = (tokens[:, :-1].contiguous(), positions, tokens[:, 1:].contiguous())
    begin = time.perf_counter()
    for _ in range(args.warmup):
        step(compiled, compiled_opt, batch)
    compile_s = time.perf_counter() - begin
    for _ in range(args.warmup):
        step(eager, eager_opt, batch)
    times = {"eager": [], "compiled": []}
    losses = {"eager": [], "compiled": []}
    for _ in range(args.steps):
        for name, (model, opt) in (("eager", (eager, eager_opt)), ("compiled", (compiled, compiled_opt))):
            seconds, loss = step(model, opt, batch)
            times[name].append(seconds)
            losses[name].append(loss)
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
          f"fp32 AdamW, {state.device}, {torch.get_num_threads()} threads; median of {args.steps} alternated steps")
    for name in ("eager", "compiled"):
        print(f"  {name:<9} {med[name] * 1e3:8.1f} ms/step (min {min(times[name]) * 1e3:.1f}, "
              f"max {max(times[name]) * 1e3:.1f})  last loss {losses[name][-1]:.6f}")
    print(f"  compiled / eager step time: {med['compiled'] / med['eager']:.3f}x "
          f"(speed-up {med['eager'] / med['compiled']:.2f}x); warm-up incl. compilation {compile_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
