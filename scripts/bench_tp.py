"""Our GPTModel at tp 2 (plain, sequence parallel, sequence parallel + --tp-comm-overlap) against megatron-core
0.16.1's GPTModel (local spec, CUDA calls mapped to CPU, no sequence parallelism: its local spec refuses it)
at tp 2, on 2 gloo ranks, steps alternated.

    PYTHONPATH=. python scripts/bench_tp.py [--layers 4 --hidden 256 --heads 8 --seq 128 --batch 4 --steps 15]
        [--fp8 tensorwise]

``--fp8 RECIPE`` adds the FP8 variants "ours sp fp8" and "ours sp+overlap fp8" (the emulated FP8 GEMMs;
``fp8.comm_overlap`` in the second), whose ratio to each other is printed too.

Every variant lives in the same two ranks; one round runs one train step (forward, backward, grad
finalization over tp, torch AdamW) of each variant in turn, a barrier before each step. Prints the median
step time of each variant, its ratio to megatron-core's and to our plain
tp 2 step, and the CPU time per step of a rank's process (all threads; mean over ranks), which other jobs on
a shared machine disturb far less than wall-clock time. One thread per rank; gloo on this machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.distributed import finalize_model_grads
from megatron_core.models import GPTModel
from megatron_core.testing import run_distributed

ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = ("ours", "ours sp", "ours sp+overlap", "ours sp fp8", "ours sp+overlap fp8", "megatron-core")


def _batch(args):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), torch.arange(args.seq).expand(args.batch, args.seq), tokens[:, 1:].contiguous()


def _ours(args, state, *, sp: bool, overlap: bool, fp8=None):
    overlap_flag = {"tp_comm_overlap": overlap} if overlap else {}  # (also runs against trees without the flag)
    fp8_flag = {"fp8": fp8} if fp8 is not None else {}
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               max_position_embeddings=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=state.tp_size, sequence_parallel=sp, **overlap_flag,
                               **fp8_flag)
    torch.manual_seed(0)
    model = GPTModel(config, parallel_state=state, vocab_size=args.vocab, max_sequence_length=args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens, positions, labels = _batch(args)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(tokens, positions, labels=labels).mean().backward()
        finalize_model_grads(model, state)
        optimizer.step()
    return step


def _megatron_reference():
    spec = importlib.util.spec_from_file_location(
        "megatron_core_reference", ROOT / "tests" / "integration" / "megatron_core_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _megatron(args):
    """megatron-core's GPTModel, local spec, without sequence parallelism (its local spec's torch LayerNorm
    refuses it; Megatron's sequence-parallel path needs Apex or Transformer Engine)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPT
    from megatron.core.transformer.transformer_config import TransformerConfig as MegatronConfig

    tp = mps.get_tensor_model_parallel_world_size()
    config = MegatronConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            ffn_hidden_size=4 * args.hidden, activation_func=F.gelu, hidden_dropout=0.0,
                            attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            pipeline_dtype=torch.float32, layernorm_epsilon=1e-5)
    torch.manual_seed(0)
    model = MegatronGPT(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=-(-args.vocab // (128 * tp)) * 128 * tp, max_sequence_length=args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens, positions, labels = _batch(args)
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), 1)[None, None]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(tokens, positions, mask, labels=labels).mean().backward()
        optimizer.step()
    return step


def _bench(args) -> dict[str, float]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    reference = _megatron_reference()
    reference._patch_cuda()
    from megatron.core import parallel_state as mps
    mps.initialize_model_parallel(dist.get_world_size(), 1)
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    steps = {"ours": _ours(args, state, sp=False, overlap=False),
             "ours sp": _ours(args, state, sp=True, overlap=False)}
    if "tp_comm_overlap" in TransformerConfig.__dataclass_fields__:
        steps["ours sp+overlap"] = _ours(args, state, sp=True, overlap=True)
    if args.fp8:
        from megatron_core.fp8 import Fp8Config
        for name, overlap in (("ours sp fp8", False), ("ours sp+overlap fp8", True)):
            steps[name] = _ours(args, state, sp=True, overlap=overlap, fp8=Fp8Config(fp8_recipe=args.fp8))
    steps["megatron-core"] = _megatron(args)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for round_ in range(args.steps + 1):  # round 0 warms up
        for name, step in steps.items():
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            step()
            if round_:
                times[name].append((time.perf_counter() - start, time.process_time() - cpu))
    destroy_model_parallel(state)
    mps.destroy_model_parallel()
    return {name: (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
            for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("layers", 4), ("hidden", 256), ("heads", 8), ("seq", 128), ("vocab", 1024),
                          ("batch", 4), ("steps", 15), ("tp", 2)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--fp8", choices=("tensorwise", "delayed"), default=None,
                        help="add FP8 variants with this recipe, plain and --tp-comm-overlap")
    args = parser.parse_args()
    results = run_distributed(args.tp, _bench, args, timeout_s=1200)
    # the slower rank sets the step; CPU time: of the rank's process (all its threads), insensitive to other jobs
    medians = {name: max(r[name][0] for r in results) for name in VARIANTS if name in results[0]}
    cpu = {name: statistics.mean(r[name][1] for r in results) for name in medians}
    print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, "
          f"batch {args.batch}; tp {args.tp} on gloo, 1 thread per rank; median of {args.steps} alternating rounds")
    print(f"{'variant':<20}{'s/step':>9}{'/ megatron-core':>17}{'/ ours tp':>11}{'CPU s/step':>12}"
          f"{'CPU / megatron-core':>21}")
    for name in medians:
        peer = medians["megatron-core"]
        print(f"{name:<20}{medians[name]:>9.4f}{medians[name] / peer:>17.3f}{medians[name] / medians['ours']:>11.3f}"
              f"{cpu[name]:>12.4f}{cpu[name] / cpu['megatron-core']:>21.3f}")
    if args.fp8:
        overlapped, plain = medians["ours sp+overlap fp8"], medians["ours sp fp8"]
        print(f"FP8 ({args.fp8}) sp+overlap / sp: {overlapped / plain:.3f} (wall), "
              f"{cpu['ours sp+overlap fp8'] / cpu['ours sp fp8']:.3f} (CPU)")


if __name__ == "__main__":
    main()
