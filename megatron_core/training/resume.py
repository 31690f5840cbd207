"""Strict resume: a checkpoint is loaded only into the model and tokenizer it was written for.

``check_resume`` compares what ``metadata.json`` records with this run before any tensor is read: the
architecture flags (layers, heads, hidden, kv groups, ffn, experts, norms, position embedding, tying), the
true vocab size and the tokenizer's identity (its type and the sha256 of its files). Every mismatch is named
with both values; ``--finetune --ignore-mismatched-sizes`` is the way to change a shape on purpose. The
tensors themselves are compared too (``checkpointing/compatibility.py``): missing or extra ones are listed.
``load(run)`` is the training loop's ``--load``: these checks, then weights, optimizer, RNG and scheduler.
"""
from __future__ import annotations

import argparse
import hashlib
import os
from typing import Optional

from megatron_core.checkpointing import load_model_weights, load_rng, read_metadata
from megatron_core.training.elastic import layout_change_notice

ARCHITECTURE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
                      "num_query_groups", "kv_channels", "num_experts", "moe_ffn_hidden_size",
                      "moe_shared_expert_intermediate_size", "normalization", "position_embedding_type", "swiglu",
                      "untie_embeddings_and_output_weights", "disable_bias_linear", "add_qkv_bias", "qk_layernorm",
                      "add_position_embedding", "use_rope_scaling", "rope_scaling_factor")
TOKENIZER_FILE_FLAGS = ("vocab_file", "merge_file", "tokenizer_model")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_identity(args: argparse.Namespace, vocab_size: int) -> dict:
    """What identifies the run's tokenizer: its type, vocab size and the sha256 of each file it was built from
    (metadata.json records it as ``tokenizer``)."""
    files = {flag: _sha256(getattr(args, flag)) for flag in TOKENIZER_FILE_FLAGS
             if getattr(args, flag, None) and os.path.isfile(getattr(args, flag))}
    return {"type": args.tokenizer_type or "ByteTokenizer", "vocab_size": vocab_size, "files_sha256": files}


def resume_mismatches(metadata: dict, args: argparse.Namespace, tokenizer: dict) -> list[str]:
    """``"<what>: <checkpoint value> in the checkpoint, <run value> in this run"`` for each difference."""
    recorded = metadata.get("config") or {}
    found = []
    for flag in ARCHITECTURE_FLAGS:
        if flag in recorded and hasattr(args, flag) and recorded[flag] != getattr(args, flag):
            found.append(f"--{flag.replace('_', '-')}: {recorded[flag]!r} in the checkpoint, "
                         f"{getattr(args, flag)!r} in this run")
    if metadata["true_vocab_size"] != tokenizer["vocab_size"]:
        found.append(f"vocab size: {metadata['true_vocab_size']} in the checkpoint, {tokenizer['vocab_size']} with "
                     f"this run's tokenizer ({tokenizer['type']})")
    saved: Optional[dict] = metadata.get("tokenizer")
    if saved:
        if saved.get("type") != tokenizer["type"]:
            found.append(f"tokenizer type: {saved.get('type')!r} in the checkpoint, {tokenizer['type']!r} in this run")
        for flag, digest in (saved.get("files_sha256") or {}).items():
            ours = tokenizer["files_sha256"].get(flag)
            if ours is not None and ours != digest:
                found.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}: another file than the checkpoint's "
                             f"tokenizer was built from (sha256 {ours[:12]} vs {digest[:12]})")
    return found


def check_resume(folder: str, metadata: dict, args: argparse.Namespace, tokenizer: dict) -> None:
    """Raises ValueError naming every difference between the checkpoint and the run, unless
    ``--ignore-mismatched-sizes`` (with ``--finetune``) asks to load what fits."""
    found = resume_mismatches(metadata, args, tokenizer)
    if found and not args.ignore_mismatched_sizes:
        raise ValueError(f"checkpoint {folder} was written for another model or tokenizer: {'; '.join(found)}. "
                         "Resume with the flags and tokenizer it was written with, or pass --finetune "
                         "--ignore-mismatched-sizes to load what fits on purpose")


def holds_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds anything a checkpoint reader should look at: the pointer file, an ``iter_*``
    entry (complete, partial or damaged) or a checkpoint of another framework. A missing folder, an empty one
    or one with only other files (Megatron-LM's CI points --load at its data folder) holds none."""
    from megatron_core.checkpointing.checkpoint import LATEST
    from megatron_core.checkpointing.megatron_lm_io import describe_foreign
    if not os.path.isdir(directory):
        return False
    entries = os.listdir(directory)
    return LATEST in entries or any(e.startswith("iter_") for e in entries) or describe_foreign(directory) is not None


def load(run) -> int:
    """Loads ``--load``; returns the iteration to continue from (0 with --finetune). A folder without a
    checkpoint (``holds_checkpoint``) starts from scratch with a warning, as in Megatron-LM (its scripts pass
    --save and --load alike), or exits with --exit-on-missing-checkpoint; a damaged checkpoint stops the run."""
    args = run.args
    if not holds_checkpoint(args.load):
        if args.exit_on_missing_checkpoint:
            raise ValueError(f"--exit-on-missing-checkpoint: no checkpoint in {args.load} (no "
                             "latest_checkpointed_iteration.txt, no iter_* folder)")
        if run.is_logging_rank:
            print(f" WARNING: no checkpoint to load in {args.load} (no latest_checkpointed_iteration.txt, no iter_* "
                  "folder): starting from scratch", flush=True)
        return 0
    checksums = not args.allow_missing_checksums
    folder, metadata = read_metadata(args.load, fallback=args.load_fallback, require_checksums=checksums)
    check_resume(folder, metadata, args, tokenizer_identity(args, run.tokenizer.vocab_size))
    load_optim = not (args.finetune or args.no_load_optim)
    # every rank loads: each file is hashed by one of them (--load-fallback has verified them all already)
    load_model_weights(folder, metadata, model_chunks=run.chunks, config=run.config, state=run.state,
                       optimizer=run.optimizer if load_optim else None, shared_verify=not args.load_fallback,
                       require_checksums=checksums, strict=not args.ignore_mismatched_sizes,
                       true_vocab_size=run.tokenizer.vocab_size)
    if not load_optim:
        run.optimizer.reload_model_params()
    if args.finetune:
        if run.is_logging_rank:
            print(f" loaded checkpoint {folder} weights only (--finetune: from iteration 0, a fresh optimizer)",
                  flush=True)
        return 0
    if not args.no_load_rng:
        load_rng(folder, metadata, state=run.state, layout_extra={"zero_stage": args.zero_stage},
                 require_checksums=checksums)
    if metadata.get("scheduler"):
        run.scheduler.load_state_dict(metadata["scheduler"])
    run.consumed_samples = metadata["consumed_samples"]
    if run.is_logging_rank:
        print(f" loaded checkpoint {folder} (iteration {metadata['iteration']})", flush=True)
        notice = layout_change_notice(metadata, run.state, run.num_microbatches)
        if notice:
            print(notice, flush=True)
    return metadata["iteration"]


__all__ = ["tokenizer_identity", "resume_mismatches", "check_resume", "load", "ARCHITECTURE_FLAGS"]
