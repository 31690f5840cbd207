"""Mixture-of-experts speed and communication on this machine (fp32, forward + backward of one layer).

1. Tokens/s of an MoE layer (E experts of size f, top-k routing) against the dense MLP with the same
   *active* parameters (ffn = k x f), single process; the MoE local experts run as a loop and as one
   batched (grouped) GEMM.
2. All-to-all bytes per step (dispatch and combine, forward and backward) sent by each rank of an
   expert-parallel group, counted by the dispatcher, against the analytic volume for balanced routing:
   ``4 x T k (ep - 1) / ep x h x 4 bytes`` per rank (each of the four all-to-alls moves the T k assignments
   that leave the rank).

    python scripts/bench_moe.py                  # options: --hidden 128 --ffn 128 --experts 8 --tokens 2048
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.testing import run_distributed
from megatron_core.transformer.mlp import MLP
from megatron_core.transformer.moe import MoEConfig, MoELayer


def _config(args, *, ffn: int, moe: bool, grouped: bool = False, dispatcher: str = "alltoall") -> TransformerConfig:
    settings = MoEConfig(num_moe_experts=args.experts, moe_router_topk=args.topk, moe_aux_loss_coeff=1e-2,
                         moe_grouped_gemm=grouped, moe_token_dispatcher_type=dispatcher) if moe else None
    return TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=4, ffn_hidden_size=ffn,
                             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                             max_position_embeddings=args.tokens, moe=settings)


def _time(layer, x: torch.Tensor, steps: int) -> float:
    """Seconds per forward + backward (best of ``steps`` after one warm-up)."""
    best = float("inf")
    for step in range(steps + 1):
        begin = time.perf_counter()
        out, _ = layer(x)
        out.sum().backward()
        if step:
            best = min(best, time.perf_counter() - begin)
    return best


def speed(args) -> None:
    state = initialize_model_parallel()
    torch.manual_seed(0)
    x = torch.randn(args.tokens // 4, 4, args.hidden, requires_grad=True)  # [s, b, h]
    layers = {"dense MLP (ffn = k f)": MLP(_config(args, ffn=args.topk * args.ffn, moe=False), layer_number=1,
                                           parallel_state=state),
              "MoE, expert loop": MoELayer(_config(args, ffn=args.ffn, moe=True), layer_number=1, parallel_state=state),
              "MoE, grouped GEMM": MoELayer(_config(args, ffn=args.ffn, moe=True, grouped=True), layer_number=1,
                                            parallel_state=state)}
    print(f"tokens/s, one layer fwd+bwd, {args.tokens} tokens, h {args.hidden}, {args.experts} experts of f "
          f"{args.ffn}, top-{args.topk} (1 process, {torch.get_num_threads()} threads)")
    dense = None
    for name, layer in layers.items():
        seconds = _time(layer, x, args.steps)
        dense = dense or seconds
        print(f"  {name:24s} {args.tokens / seconds:12.0f} tokens/s   {seconds * 1e3:8.1f} ms   "
              f"x{dense / seconds:.2f} of dense")


def _comm_body(args, ep: int, dispatcher: str) -> tuple[int, int]:
    state = initialize_model_parallel(expert_model_parallel_size=ep)
    torch.manual_seed(0)
    layer = MoELayer(_config(args, ffn=args.ffn, moe=True, dispatcher=dispatcher), layer_number=1,
                     parallel_state=state)
    gen = torch.Generator().manual_seed(state.rank)
    x = torch.randn(args.tokens // 4, 4, args.hidden, generator=gen, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    return layer.comm_stats.bytes_sent, args.tokens


def communication(args) -> None:
    print("all-to-all bytes per step and rank (dispatch + combine, forward + backward), balanced-routing formula "
          "4 T k (ep-1)/ep h 4")
    for ep in args.ep:
        results = run_distributed(ep, _comm_body, args, ep, "alltoall")
        analytic = 4 * args.tokens * args.topk * (ep - 1) / ep * args.hidden * 4
        for rank, (sent, _) in enumerate(results):
            print(f"  ep {ep} rank {rank}: measured {sent / 2**20:8.3f} MiB   analytic {analytic / 2**20:8.3f} MiB   "
                  f"ratio {sent / analytic:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    speed(args)
    communication(args)


if __name__ == "__main__":
    main()
