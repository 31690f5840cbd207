"""``--use-checkpoint-args`` (Megatron-LM's flag): the model's architecture and tokenizer come from the
``--load`` checkpoint's recorded run flags, so a checkpoint imported from Hugging Face (or trained here)
fine-tunes with no model flags: ``pretrain_gpt.py --load ckpt --use-checkpoint-args --finetune``.

Applied before the flags are validated. An architecture flag given on the command line that contradicts the
checkpoint is an error naming both values; the tokenizer flags are taken from the checkpoint only when the
command line names no tokenizer (``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` wins).
"""
from __future__ import annotations

import argparse
import os

from megatron_core.training.resume import ARCHITECTURE_FLAGS

CHECKPOINT_ARCHITECTURE = ARCHITECTURE_FLAGS + (
    "max_position_embeddings", "rotary_base", "rotary_percent", "rotary_seq_len_interpolation_factor",
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
    "layernorm_epsilon", "apply_layernorm_1p", "openai_gelu", "make_vocab_size_divisible_by", "moe_router_topk",
    "moe_layer_freq", "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk_scaling_factor")
TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def apply_checkpoint_args(args: argparse.Namespace, defaults: dict) -> list[str]:
    """Sets ``args``' architecture (and, when no tokenizer flag was given, tokenizer) flags to those the newest
    checkpoint of ``args.load`` records; ``defaults`` are the parser's. Raises ValueError naming a flag given
    with another value than the checkpoint's, or a ``--load`` without a checkpoint. Returns the flags taken."""
    from megatron_core.checkpointing import read_metadata

    if not args.load or not os.path.isdir(args.load) or not os.listdir(args.load):
        raise ValueError(f"--use-checkpoint-args needs --load with a checkpoint; {args.load!r} holds none")
    folder, metadata = read_metadata(args.load, require_checksums=not args.allow_missing_checksums)
    recorded = metadata.get("config") or {}
    taken, conflicts = [], []
    for flag in CHECKPOINT_ARCHITECTURE:
        if flag not in recorded or not hasattr(args, flag):
            continue
        given = getattr(args, flag)
        if given != defaults.get(flag) and given != recorded[flag]:
            conflicts.append(f"--{flag.replace('_', '-')} {given!r} (the checkpoint has {recorded[flag]!r})")
        elif given != recorded[flag]:
            setattr(args, flag, recorded[flag])
            taken.append(flag)
    if conflicts:
        raise ValueError(f"--use-checkpoint-args takes the architecture from {folder}, but the command line "
                         f"contradicts it: {'; '.join(conflicts)}. Drop those flags (or --use-checkpoint-args)")
    if all(getattr(args, flag) == defaults.get(flag) for flag in TOKENIZER_FLAGS):
        for flag in TOKENIZER_FLAGS:
            if recorded.get(flag) is not None:
                setattr(args, flag, recorded[flag])
                taken.append(flag)
    return taken


__all__ = ["apply_checkpoint_args", "CHECKPOINT_ARCHITECTURE"]
