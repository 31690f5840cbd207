"""NVIDIA megatron-core 0.16.1 on CPU: writes Megatron-LM checkpoints of its own GPTModel, loads ours, gives logits.

Not a test module: ``test_megatron_lm_checkpoints.py`` runs it in its own processes (megatron-core keeps its
parallel state in module globals), one per rank over gloo with a FileStore:

    python megatron_core_reference.py save|load DIR --format torch|torch_dist --arch gpt|llama --tp T --pp P

``save`` builds a randomly initialized GPTModel (local layer spec) at tp T x pp P and writes it as Megatron-LM
does (``iter_0000007/mp_rank_*/model_optim_rng.pt`` with its args, or ``dist_checkpointing.save`` plus args in
common.pt); ``load`` reads DIR into the model (strict). Both write ``DIR/logits.pt``: ``[2, 8, V_padded]``
logits of fixed tokens. CUDA-only calls megatron-core makes on this path are mapped to CPU no-ops.
"""
import argparse
import contextlib
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

ITERATION = 7
TOKENS = torch.arange(16).reshape(2, 8) * 5 % 100


def _patch_cuda() -> None:
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied-embedding all-reduce at pp > 1
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # dropout is 0
    fs_async._process_memory = lambda: 0  # needs psutil otherwise


def megatron_args(arch: str, tp: int, pp: int, padded: int) -> argparse.Namespace:
    """The Megatron-LM args a checkpoint of this model records (with one of its enums, as real ones do)."""
    from megatron.core.transformer.enums import AttnBackend

    llama = arch == "llama"
    return argparse.Namespace(
        num_layers=4, hidden_size=32, ffn_hidden_size=64 if llama else 128, num_attention_heads=4, kv_channels=8,
        group_query_attention=llama, num_query_groups=2 if llama else 4, max_position_embeddings=16, seq_length=16,
        position_embedding_type="rope" if llama else "learned_absolute", rotary_percent=1.0, rotary_base=10000,
        normalization="RMSNorm" if llama else "LayerNorm", norm_epsilon=1e-5, apply_layernorm_1p=False,
        qk_layernorm=False, swiglu=llama, openai_gelu=False, add_bias_linear=not llama, add_qkv_bias=False,
        untie_embeddings_and_output_weights=llama, make_vocab_size_divisible_by=128, padded_vocab_size=padded,
        tokenizer_type="NullTokenizer", vocab_size=99, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=1234,
        consumed_train_samples=70, attention_backend=AttnBackend.auto, ckpt_format="torch")


def build_model(arch: str, tp: int, pp: int):
    import torch.nn.functional as F
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = arch == "llama"
    config = TransformerConfig(
        num_layers=4, hidden_size=32, ffn_hidden_size=64 if llama else 128, num_attention_heads=4,
        num_query_groups=2 if llama else None, normalization="RMSNorm" if llama else "LayerNorm",
        gated_linear_unit=llama, activation_func=F.silu if llama else F.gelu, add_bias_linear=not llama,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, layernorm_epsilon=1e-5)
    padded = 128 * tp
    torch.manual_seed(1234 + mps.get_pipeline_model_parallel_rank())  # same full weights on every tp rank
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
                     vocab_size=padded, max_sequence_length=16, pre_process=mps.is_pipeline_first_stage(),
                     post_process=mps.is_pipeline_last_stage(), parallel_output=False,
                     share_embeddings_and_output_weights=not llama,
                     position_embedding_type="rope" if llama else "learned_absolute")
    return model.eval(), padded


def logits(model, pp: int):
    """Full-vocab logits ``[b, s, V_padded]`` on the last stage (hidden states sent stage to stage), else None."""
    from megatron.core import parallel_state as mps

    positions = torch.arange(8).expand(2, 8)
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None]
    rank, stage = dist.get_rank(), mps.get_pipeline_model_parallel_rank()
    tp = mps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        if stage > 0:
            hidden = torch.empty(8, 2, 32)
            dist.recv(hidden, src=rank - tp)
            model.set_input_tensor(hidden)
        out = model(TOKENS if stage == 0 else None, positions, mask)
        if stage < pp - 1:
            dist.send(out.contiguous(), dst=rank + tp)
            return None
        return out


def save(model, folder: str, fmt: str, args: argparse.Namespace) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps

    tp_rank, pp_rank = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
    iteration_dir = os.path.join(folder, f"iter_{ITERATION:07d}")
    common = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    if fmt == "torch":
        name = f"mp_rank_{tp_rank:02d}" if args.pipeline_model_parallel_size == 1 else \
            f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        os.makedirs(os.path.join(iteration_dir, name), exist_ok=True)
        import numpy as np
        state = {**common, "model": model.state_dict_for_save_checkpoint(),
                 "rng_state": [{"random_rng_state": None, "np_rng_state": np.random.get_state()}]}
        torch.save(state, os.path.join(iteration_dir, name, "model_optim_rng.pt"))
    else:
        os.makedirs(iteration_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict(), **common}, iteration_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(ITERATION))


def load(model, folder: str, fmt: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mps

    iteration = open(os.path.join(folder, "latest_checkpointed_iteration.txt")).read().strip()
    iteration_dir = os.path.join(folder, f"iter_{int(iteration):07d}")
    if fmt == "torch":
        tp_rank, pp_rank = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
        pp = mps.get_pipeline_model_parallel_world_size()
        name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        state = torch.load(os.path.join(iteration_dir, name, "model_optim_rng.pt"), weights_only=False)
        assert state["args"].tensor_model_parallel_size == mps.get_tensor_model_parallel_world_size()
        model.load_state_dict(state["model"], strict=True)
    else:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iteration_dir)
        model.load_state_dict(loaded["model"], strict=True)


def rank_main(rank: int, world: int, options: argparse.Namespace, store: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    _patch_cuda()
    from megatron.core import parallel_state as mps

    mps.initialize_model_parallel(options.tp, options.pp)
    model, padded = build_model(options.arch, options.tp, options.pp)
    if options.mode == "save":
        save(model, options.dir, options.format, megatron_args(options.arch, options.tp, options.pp, padded))
    else:
        load(model, options.dir, options.format)
    out = logits(model, options.pp)
    if out is not None and mps.get_tensor_model_parallel_rank() == 0:
        torch.save(out, os.path.join(options.dir, "logits.pt"))
    dist.barrier()
    mps.destroy_model_parallel()
    dist.destroy_process_group()


def _import_megatron_core() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.models.gpt.gpt_model  # noqa: F401


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("dir")
    parser.add_argument("--format", choices=["torch", "torch_dist"], default="torch")
    parser.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    options = parser.parse_args(argv)
    os.makedirs(options.dir, exist_ok=True)
    world = options.tp * options.pp
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        if world == 1:
            rank_main(0, 1, options, store)
        else:
            _import_megatron_core()  # once, before forking the ranks (an import costs seconds of CPU)
            torch.multiprocessing.start_processes(rank_main, args=(world, options, store), nprocs=world,
                                                  start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main())
