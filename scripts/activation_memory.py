"""Activation memory of one transformer layer (bytes saved for backward), measured against the formulas of
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198),
Table 2, for 16-bit activations and 1-byte dropout masks:

    no parallelism             sbh (34 + 5as/h)
    tensor parallel (t)        sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel sbh/t (34 + 5as/h)
    tp + selective recompute   sbh (10 + 24/t)
    tp + sp + selective        sbh/t * 34

    python scripts/activation_memory.py [--seq-length 64 --micro-batch-size 2 --hidden-size 64 --heads 4 --tp 2]

Counts every tensor saved by autograd during one layer's forward (bf16, dropout on), once per storage,
excluding parameters; tensor-parallel runs use gloo ranks on this machine (megatron_core.testing).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.planning.activations import korthikanti_bytes  # noqa: F401 - the formula lives in the library
from megatron_core.tensor_parallel import model_parallel_seed
from megatron_core.testing import run_distributed
from megatron_core.transformer import TransformerLayer, gpt_layer_spec

CASES = [  # (name, tp > 1, sequence_parallel, selective recompute)
    ("no parallelism", False, False, False),
    ("tensor parallel", True, False, False),
    ("tensor + sequence parallel", True, True, False),
    ("tp + selective recompute", True, False, True),
    ("tp + sp + selective recompute", True, True, True),
]


def measure_layer_bytes(s: int, b: int, h: int, a: int, sp: bool, selective: bool) -> int:
    """Bytes saved for backward by one layer's forward on this rank (call on every tp rank)."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=a, max_position_embeddings=s,
                               tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=torch.bfloat16,
                               bf16=True, hidden_dropout=0.1, attention_dropout=0.1,
                               recompute_granularity="selective" if selective else None)
    layer = TransformerLayer(config, layer_number=1, parallel_state=state, spec=gpt_layer_spec())
    model_parallel_seed(0, tp_rank=state.tp_rank, tracker=state.rng_tracker)
    params = {p.data_ptr() for p in layer.parameters()}
    hidden = torch.randn(s // tp if sp else s, b, h, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in params:
            storage = tensor.untyped_storage()
            saved[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden)
    destroy_model_parallel(state)
    return sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    s, b, h, a, t = args.seq_length, args.micro_batch_size, args.hidden_size, args.heads, args.tp
    print(f"s={s} b={b} h={h} a={a} t={t}, bf16, bytes saved for backward per layer on one rank")
    print(f"{'case':<32}{'measured':>12}{'paper (1 B masks)':>19}{'ratio':>7}{'2 B masks (CPU)':>17}{'ratio':>7}")
    for name, parallel, sp, selective in CASES:
        tp = t if parallel else 1
        if tp == 1:
            measured = measure_layer_bytes(s, b, h, a, sp, selective)
        else:
            measured = run_distributed(tp, measure_layer_bytes, s, b, h, a, sp, selective)[0]
        paper = korthikanti_bytes(s, b, h, a, tp, sp, selective)
        cpu = korthikanti_bytes(s, b, h, a, tp, sp, selective, mask_bytes=2)
        print(f"{name:<32}{measured:>12,}{paper:>19,.0f}{measured / paper:>7.2f}{cpu:>17,.0f}{measured / cpu:>7.3f}")


if __name__ == "__main__":
    main()
