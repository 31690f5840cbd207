"""Generate text from a checkpoint with a key/value cache, in one process or under torchrun at any tp x pp.

    python tools/generate.py --load ckpt --prompt "def main(" --max-new-tokens 40 --greedy
    torchrun --nproc-per-node 4 tools/generate.py --load ckpt --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --prompt-ids 1,2,3 --max-new-tokens 20 --temperature 0.8 \\
        --top-k 50 --top-p 0.95 --seed 1 --output-json out.json
    torchrun --nproc-per-node 4 tools/generate.py --load ckpt_tp2_pp2 --prompt-ids 1,2,3 --max-new-tokens 20 \\
        --greedy    # no layout flags: the checkpoint's own tp x pp (x ep, x etp)

Rank 0 prints the prompt and its continuation; ``--output-json`` writes the generated token ids, the
log-probabilities of the prompt tokens (from the second on) and of the generated tokens, and the layout run.
The tokenizer defaults to the one the checkpoint's run recorded.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_core import initialize_model_parallel  # noqa: E402
from megatron_core.checkpointing import read_metadata  # noqa: E402
from megatron_core.data import build_tokenizer  # noqa: E402
from megatron_core.inference import generate, load_gpt_from_checkpoint  # noqa: E402
from megatron_core.utils.errors import run_tool  # noqa: E402
from megatron_core.utils.files import atomic_write  # noqa: E402

PROG = "generate.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="text generation from a checkpoint",
                                allow_abbrev=False)
    p.add_argument("--load", required=True)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", default=None)
    prompt.add_argument("--prompt-ids", default=None, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_checkpoint_flags(p)
    p.add_argument("--debug", action="store_true", help="show the traceback of a handled error")
    return p


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a tool that runs a checkpoint (generate.py, run_text_generation_server.py): the layout
    (default: the checkpoint's own), the tokenizer (default: the checkpoint's) and --allow-missing-checksums."""
    p.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="default: the checkpoint's tp when the launch has its tp x pp processes, else 1")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="default: the checkpoint's pp when the launch has its tp x pp processes, else 1")
    p.add_argument("--expert-model-parallel-size", type=int, default=None,
                   help="mixture-of-experts models: default the checkpoint's ep with its own layout, else 1")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="mixture-of-experts models: 1 or tp; default the checkpoint's with its own layout, else 1")
    for flag in ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file"):
        p.add_argument(flag, default=None, help="default: the checkpoint's")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the checkpoint's")
    p.add_argument("--allow-missing-checksums", action="store_true",
                   help="load a checkpoint whose metadata.json lacks the sha256 of some file")


def checkpoint_tokenizer(args: argparse.Namespace, flags: dict):
    """The tokenizer the flags name, each unset flag taken from the checkpoint's recorded ``flags``."""
    def pick(key: str):
        value = getattr(args, key)
        return value if value is not None else flags.get(key)
    return build_tokenizer(pick("tokenizer_type") or "ByteTokenizer", tokenizer_model=pick("tokenizer_model"),
                           vocab_file=pick("vocab_file"), merge_file=pick("merge_file"), vocab_size=pick("vocab_size"))


def _prompt_ids(args: argparse.Namespace, flags: dict) -> tuple[list[int], Optional[object]]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as error:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from error
        try:
            return ids, checkpoint_tokenizer(args, flags)
        except (ValueError, OSError):
            return ids, None  # ids need no tokenizer; the text is then printed as ids
    tokenizer = checkpoint_tokenizer(args, flags)
    return tokenizer.encode(args.prompt), tokenizer


LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                "expert_tensor_parallel_size")


def processes_for(tp: int, pp: int, ep: int, etp: int) -> int:
    """The fewest processes that run a tp x pp layout with ep x etp expert ranks: each pipeline stage needs
    tp x dp ranks, a multiple of tp and of ep x etp (dp replicas then generate the same tokens)."""
    return pp * math.lcm(tp, ep * etp)


def saved_layout(metadata: dict) -> tuple[int, int, int, int]:
    """``(tp, pp, ep, etp)`` the checkpoint was written at."""
    layout, flags = metadata["layout"], metadata.get("config") or {}
    tp, pp, ep = (int(layout.get(axis, 1)) for axis in ("tp", "pp", "ep"))
    return tp, pp, ep, int(flags.get("expert_tensor_parallel_size") or 1) if flags.get("num_experts") else 1


def launch_layout(args: argparse.Namespace, metadata: dict) -> tuple[int, int, int, int]:
    """``(tp, pp, ep, etp)``: the flags (1 for each one not given); without any, the checkpoint's own layout
    when the launch has ``processes_for`` it (one process: all 1); any other process count is an error
    naming both."""
    if any(getattr(args, flag) is not None for flag in LAYOUT_FLAGS):
        return tuple(getattr(args, flag) or 1 for flag in LAYOUT_FLAGS)
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, pp, ep, etp = saved_layout(metadata)
    needed = processes_for(tp, pp, ep, etp)
    if world == needed:
        return tp, pp, ep, etp
    if world == 1:
        return 1, 1, 1, 1
    experts = f" x ep {ep}" + (f" x etp {etp}" if etp > 1 else "") if ep * etp > 1 else ""
    raise ValueError(f"{world} processes cannot run {args.load} at its own layout (tp {tp} x pp {pp}{experts}): "
                     f"launch {needed} processes, or pass --tensor-model-parallel-size and "
                     "--pipeline-model-parallel-size (and --expert-model-parallel-size)")


def run(args: argparse.Namespace) -> dict:
    """Loads the model at the launch layout and generates (collective); returns the result dict."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    _, metadata = read_metadata(args.load, require_checksums=not args.allow_missing_checksums)
    flags = metadata.get("config") or {}
    tp, pp, ep, etp = launch_layout(args, metadata)
    state = initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model, _ = load_gpt_from_checkpoint(args.load, state, parallel_output=False,
                                        require_checksums=not args.allow_missing_checksums)
    ids, tokenizer = _prompt_ids(args, flags)
    if any(not 0 <= i < metadata["true_vocab_size"] for i in ids):
        raise ValueError(f"prompt ids {ids} fall outside the vocab [0, {metadata['true_vocab_size']})")
    result = generate(model, state, ids, max_new_tokens=args.max_new_tokens, greedy=args.greedy,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      max_sequence_length=int(flags.get("seq_length") or 0) or None)
    result["prompt_ids"] = ids
    result["layout"] = {"tp": state.tp_size, "pp": state.pp_size, "ep": state.ep_size, "etp": state.etp_size}
    result["text"] = tokenizer.decode(ids + result["tokens"]) if tokenizer is not None else None
    return result


def _run(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":  # CUDA-only path
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    result = run(args)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(result["text"] if result["text"] is not None
              else " ".join(map(str, result["prompt_ids"] + result["tokens"])))
        if args.output_json:
            payload = {k: result[k] for k in ("prompt_ids", "tokens", "prompt_logprobs", "generated_logprobs",
                                              "layout")}
            atomic_write(args.output_json, json.dumps(payload, indent=1).encode())
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the tool; returns 0, or 2 for bad input / 1 for the environment after one ``generate.py: error:``
    paragraph on stderr (with the traceback under ``--debug``)."""
    return run_tool(PROG, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
