"""Convert GPT checkpoints between tp/pp/dp layouts, and to/from Hugging Face GPT-2 (offline, streaming).

    # reshard a megatron_core checkpoint to tp 4 x pp 2 (optimizer states converted too)
    python tools/checkpoint_convert.py --model-type GPT --loader mcore --saver mcore --load-dir ckpt \\
        --save-dir ckpt_tp4_pp2 --target-tensor-parallel-size 4 --target-pipeline-parallel-size 2 --check
    # reshard an MoE checkpoint to tp 2 x ep 4 (experts keep their global ids; --num-experts divisible by ep)
    python tools/checkpoint_convert.py --model-type GPT --loader mcore --saver mcore --load-dir moe_ckpt \\
        --save-dir moe_tp2_ep4 --target-tensor-parallel-size 2 --target-expert-parallel-size 4
    # import a Hugging Face folder (gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen3_moe: config.json +
    # model.safetensors, the sharded model-0000i-of-0000n.safetensors + index, or pytorch_model.bin; dtypes kept
    # unless --params-dtype; MoE experts go to their --target-expert-parallel-size rank)
    python tools/checkpoint_convert.py --model-type GPT --loader hf --saver mcore --load-dir Llama-3.2-1B \\
        --save-dir ckpt_llama --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    # import a Megatron-LM checkpoint (torch or torch_dist format, any tp/pp; target sizes default to its own)
    python tools/checkpoint_convert.py --model-type GPT --loader core --saver mcore --load-dir megatron_ckpt \\
        --save-dir ckpt
    # export one that megatron-core / Megatron-LM loads (--ckpt-format torch_dist or torch)
    python tools/checkpoint_convert.py --model-type GPT --loader mcore --saver core --load-dir ckpt \\
        --save-dir megatron_ckpt --target-tensor-parallel-size 2
    # export for transformers.AutoModelForCausalLM.from_pretrained (the family the import recorded, else the
    # one the architecture is), sharded past --max-shard-size
    python tools/checkpoint_convert.py --model-type GPT --loader mcore --saver hf --load-dir ckpt \\
        --save-dir hf_out --max-shard-size 5GB

No process group is needed; each tensor is read (its tp shards merged), re-split and written before the
next, so memory stays near the largest tensor. A progress bar is drawn on stderr. ``--check`` builds the
source and the converted model in this process (tp 1, pp 1) and prints the max logit difference on random
tokens.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_core.checkpointing.convert import (  # noqa: E402
    SourceCheckpoint,
    expert_id_of,
    read_mcore_checkpoint,
    write_mcore_checkpoint,
)
from megatron_core.inference.checkpoint_model import config_from_flags, run_flags  # noqa: E402
from megatron_core.utils.errors import run_tool  # noqa: E402
from megatron_core.utils.malloc import mmap_large_allocations  # noqa: E402

PROG = "checkpoint_convert.py"
MEGATRON_LM = ("core", "megatron")  # Megatron-LM checkpoints of megatron-core's GPTModel (torch or torch_dist)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model-type", required=True, choices=["GPT"])
    p.add_argument("--loader", choices=["mcore", "hf", *MEGATRON_LM], default="mcore",
                   help="mcore: a megatron_core checkpoint; hf: a Hugging Face folder (gpt2, llama, mistral, qwen2, "
                        "qwen3, mixtral, qwen3_moe); core / megatron: a Megatron-LM checkpoint (torch or torch_dist "
                        "format)")
    p.add_argument("--saver", choices=["mcore", "hf", "core"], default="mcore",
                   help="core: a Megatron-LM checkpoint megatron-core's GPTModel loads (see --ckpt-format)")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=int, default=None, help="default: the source's")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=None, help="default: the source's")
    p.add_argument("--target-expert-parallel-size", type=int, default=None,
                   help="MoE: the target --expert-model-parallel-size (default: the source's)")
    p.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                   help="MoE: the target --expert-tensor-parallel-size (any size whose product with ep divides "
                        "tp x cp x dp at run time; default: the source's when the target tp equals it or the "
                        "source's tp, else 1)")
    p.add_argument("--target-data-parallel-size", type=int, default=1,
                   help="recorded in the layout; data-parallel sharding happens at load time")
    p.add_argument("--true-vocab-size", type=int, default=None,
                   help="Megatron-LM loaders: the tokenizer's vocab, to drop the padding rows (default: "
                        "NullTokenizer's from the checkpoint args, else every padded row is kept)")
    p.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch_dist",
                   help="--saver core: Megatron-LM's checkpoint format to write")
    p.add_argument("--params-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="--loader hf: convert every tensor to this dtype (default: keep the folder's; fp8 / "
                        "mxfp4-quantized weights dequantize to bf16)")
    p.add_argument("--max-shard-size", default="50GB",
                   help="--saver hf: largest safetensors file (transformers' units: 5GB, 500MB, 2GiB; default 50GB "
                        "as save_pretrained); past it the weights are sharded with model.safetensors.index.json")
    p.add_argument("--no-optim", action="store_true", help="drop optimizer states")
    p.add_argument("--check", action="store_true", help="compare logits of source and result (tp 1, pp 1)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--allow-missing-checksums", action="store_true",
                   help="--loader mcore: read a checkpoint whose metadata.json lacks the sha256 of some file")
    p.add_argument("--debug", action="store_true", help="show the traceback of a handled error")
    return p


def read_source(args: argparse.Namespace) -> SourceCheckpoint:
    if args.loader == "mcore":
        return read_mcore_checkpoint(args.load_dir, require_checksums=not args.allow_missing_checksums)
    if args.loader in MEGATRON_LM:
        from megatron_core.checkpointing.megatron_lm import read_megatron_lm_checkpoint
        return read_megatron_lm_checkpoint(args.load_dir, vars(run_flags({})), true_vocab_size=args.true_vocab_size)
    from megatron_core.models.hf import read_hf
    return read_hf(args.load_dir, vars(run_flags({})), params_dtype=args.params_dtype)


def target_flags(source: SourceCheckpoint, tp: int, pp: int, ep: int = 1, etp: int = 1) -> dict:
    """The source's run flags at the target layout (virtual pipelining and sequence parallelism reset
    when they no longer apply)."""
    flags = dict(source.flags)
    flags.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if flags.get("num_experts") or ep > 1:
        flags["expert_model_parallel_size"] = ep
        flags["expert_tensor_parallel_size"] = etp
        if tp > 1:  # MoE layers at tp > 1 route each tp rank's chunk of the sequence
            flags["sequence_parallel"] = True
    per_stage = flags.get("num_layers_per_virtual_pipeline_stage")
    if per_stage and (pp == 1 or flags["num_layers"] % (pp * per_stage) != 0):
        flags["num_layers_per_virtual_pipeline_stage"] = None
    if pp != source.flags.get("pipeline_model_parallel_size", 1):  # a layout string or virtual-stage count is
        for name in ("pipeline_model_parallel_layout", "num_virtual_stages_per_pipeline_rank",  # for its own pp
                     "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            if flags.get(name) is not None:
                flags[name] = None
        flags["account_for_embedding_in_pipeline_split"] = flags["account_for_loss_in_pipeline_split"] = False
    if tp == 1:
        flags["sequence_parallel"] = False
    return flags


def target_layout(args: argparse.Namespace, source: SourceCheckpoint) -> tuple[int, int, int]:
    """(tp, pp, dp) of the result: the flags, else the source's layout (as Megatron-LM's converter)."""
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    tp = int(source.layout.get("tp", 1)) if tp is None else tp
    pp = int(source.layout.get("pp", 1)) if pp is None else pp
    for name, value in (("--target-tensor-parallel-size", tp), ("--target-pipeline-parallel-size", pp),
                        ("--target-data-parallel-size", args.target_data_parallel_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return tp, pp, args.target_data_parallel_size


def convert(args: argparse.Namespace) -> str:
    """Runs the conversion the flags describe; returns the written folder."""
    source = read_source(args)
    tp, pp, dp = target_layout(args, source)
    ep = args.target_expert_parallel_size
    ep = int(source.layout.get("ep", 1)) if ep is None else ep
    etp = args.target_expert_tensor_parallel_size
    if etp is None:
        saved = int(source.flags.get("expert_tensor_parallel_size") or 1)
        etp = saved if tp in (saved, int(source.layout.get("tp", 1))) else 1
    has_experts = any(expert_id_of(t.name) is not None for t in source.tensors)
    if has_experts and args.saver == "core":
        raise ValueError(f"{source.description} is a mixture-of-experts checkpoint: only --saver mcore and --saver "
                         "hf write experts")
    if args.saver == "hf":
        from megatron_core.models.hf import write_hf
        return write_hf(source, args.save_dir, max_shard_size=args.max_shard_size, progress=not args.no_progress)
    flags = target_flags(source, tp, pp, ep, etp)
    try:
        config = config_from_flags(flags, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    except ValueError as error:
        raise ValueError(f"cannot convert {source.description} to tensor parallel {tp} x pipeline parallel {pp}: "
                         f"{error}") from error
    if args.saver == "core":
        from megatron_core.checkpointing.megatron_lm import write_megatron_lm_checkpoint
        return write_megatron_lm_checkpoint(source, args.save_dir, tp=tp, pp=pp, ckpt_format=args.ckpt_format)
    return write_mcore_checkpoint(source, args.save_dir, config=config, flags=flags, data_parallel_size=dp,
                                  no_optim=args.no_optim, progress=not args.no_progress, expert_parallel_size=ep,
                                  expert_tensor_parallel_size=etp)


def _hf_quantization(directory: str):
    """config.json's ``quantization_config.quant_method`` (None for an unquantized folder)."""
    import json
    with open(os.path.join(directory, "config.json")) as handle:
        return (json.load(handle).get("quantization_config") or {}).get("quant_method")


def reference_logits(kind: str, directory: str, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[b, s, V]`` of the model in ``directory`` (built at tp 1, pp 1; HF via transformers)."""
    if kind == "hf":
        import transformers
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        except ImportError as error:  # a quantized folder: transformers' fp8 / mxfp4 loaders want accelerate
            raise ValueError(f"--check loads {directory} in transformers as the reference, which cannot load its "
                             f"{_hf_quantization(directory)!r}-quantized weights here ({error}); convert without "
                             "--check, or check a dequantized export (--saver hf) instead") from error
        with torch.no_grad():
            return model(tokens).logits.float()
    from megatron_core import initialize_model_parallel
    from megatron_core.inference import load_gpt_from_checkpoint
    model, _ = load_gpt_from_checkpoint(directory, initialize_model_parallel(), parallel_output=False)
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        return model(tokens, positions).float()


def check(args: argparse.Namespace, source: SourceCheckpoint, seed: int = 0) -> float:
    """Max |logit difference| between source and converted model on random tokens."""
    positions = int(source.flags.get("seq_length") or 16)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, source.true_vocab_size, (2, min(positions, 32)), generator=generator)
    before = reference_logits(args.loader, args.load_dir, tokens)
    after = reference_logits(args.saver, args.save_dir, tokens)
    vocab = source.true_vocab_size
    return float((before[..., :vocab] - after[..., :vocab]).abs().max())


def _run(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    mmap_large_allocations()  # tensors read, joined and freed one at a time: keep the peak near the largest
    if args.check and (args.saver == "core" or args.loader in MEGATRON_LM):
        parser.error("--check runs megatron_core and Hugging Face models only; compare a Megatron-LM checkpoint "
                     "in megatron-core itself (see tests/integration/test_megatron_lm_checkpoints.py)")
    folder = convert(args)
    print(f"wrote {folder}")
    if args.check:
        difference = check(args, read_source(args))
        print(f"check: max |logit difference| between {args.load_dir} and {args.save_dir} = {difference:.3e}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the tool; returns 0, or 2 for bad input / 1 for the environment after one ``checkpoint_convert.py:
    error:`` paragraph on stderr (with the traceback under ``--debug``)."""
    return run_tool(PROG, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
