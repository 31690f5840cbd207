"""A GPTModel built from what a checkpoint's metadata.json records (the run flags), at a chosen layout.

The flags are turned into a ``TransformerConfig`` by the training loop's own ``transformer_config``, so a
model built here is the one ``pretrain_gpt.py`` trained; only the layout (tp, pp) is the caller's.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

import torch

from megatron_core.checkpointing import load_model_weights, read_metadata
from megatron_core.config import TransformerConfig
from megatron_core.models import GPTModel
from megatron_core.parallel_state import ParallelState
from megatron_core.training.arguments import build_parser, transformer_config
from megatron_core.transformer.specs import layer_spec_for


def run_flags(flags: dict, **overrides) -> argparse.Namespace:
    """pretrain_gpt's defaults, then the recorded ``flags``, then ``overrides``."""
    values = vars(build_parser().parse_args([]))
    values.update(flags)
    values.update(overrides)
    if values.get("max_position_embeddings") is None:
        values["max_position_embeddings"] = values["seq_length"]
    return argparse.Namespace(**values)


def config_from_flags(flags: dict, *, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                      sequence_parallel: Optional[bool] = None) -> TransformerConfig:
    """The model config of recorded run ``flags`` at the given layout (virtual pipelining off).

    Raises ValueError naming the values when the layout is impossible (heads, groups or ffn not divisible by
    tp, layers by pp).
    """
    sp = bool(flags.get("sequence_parallel")) if sequence_parallel is None else sequence_parallel
    args = run_flags(flags, tensor_model_parallel_size=tensor_model_parallel_size,
                     pipeline_model_parallel_size=pipeline_model_parallel_size,
                     num_layers_per_virtual_pipeline_stage=None,
                     sequence_parallel=sp and tensor_model_parallel_size > 1)
    if args.num_layers < pipeline_model_parallel_size:
        raise ValueError(f"num_layers {args.num_layers} < pipeline_model_parallel_size {pipeline_model_parallel_size}:"
                         " every pipeline stage needs at least one layer")
    config = transformer_config(args)
    return dataclasses.replace(config, openai_gelu=bool(flags.get("openai_gelu", False)))


def load_gpt_from_checkpoint(load_dir: str, state: ParallelState, *, parallel_output: bool = False,
                             iteration: Optional[int] = None, require_checksums: bool = True,
                             sequence_parallel: bool = False) -> tuple[GPTModel, dict]:
    """This rank's stage of the checkpoint's model at ``state``'s tp/pp/ep, weights loaded, in eval mode.
    ``sequence_parallel`` (tp > 1; what MoE layers need there): the sequence length must divide by tp, and
    ``pipeline_forward`` runs such a model at pp 1 only (its stage-to-stage buffers are full-sequence).
    Returns ``(model, metadata)``."""
    folder, metadata = read_metadata(load_dir, iteration, require_checksums=require_checksums)
    flags = metadata.get("config") or {}
    config = config_from_flags(flags, tensor_model_parallel_size=state.tp_size,
                               pipeline_model_parallel_size=state.pp_size, sequence_parallel=sequence_parallel)
    args = run_flags(flags)
    torch.manual_seed(int(args.seed))
    model = GPTModel(config, parallel_state=state, vocab_size=metadata["true_vocab_size"],
                     max_sequence_length=args.seq_length, pre_process=state.is_pipeline_first_stage,
                     post_process=state.is_pipeline_last_stage, parallel_output=parallel_output,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     layer_spec=layer_spec_for(config))
    load_model_weights(folder, metadata, model_chunks=[model], config=config, state=state,
                       require_checksums=require_checksums)
    return model.eval(), metadata


__all__ = ["run_flags", "config_from_flags", "load_gpt_from_checkpoint"]
