"""The pipeline layout flags: uneven stages (``--decoder-first/last-pipeline-num-layers``,
``--account-for-embedding/loss-in-pipeline-split``), virtual stages (``--num-layers-per-virtual-pipeline-stage``,
``--num-virtual-stages-per-pipeline-rank``), Megatron's flexible layout string (``--pipeline-model-parallel-layout``,
``pipeline_parallel.layout``) and ``--microbatch-group-size-per-virtual-pipeline-stage``; checked together, then
turned into the config's first/last stage counts or per-chunk counts. The flags are defined in ``arguments``."""
from __future__ import annotations

import argparse
from typing import Optional

from megatron_core.pipeline_parallel.layout import expand_layout, parse_layout, split_chunk_counts


def pipeline_split(args: argparse.Namespace) -> tuple[Optional[int], Optional[int]]:
    """``(first, last)`` stage layer counts (None: an even share). ``--account-for-embedding/loss-in-pipeline-
    split`` count the embedding / the loss as a layer: the stages then split ``num_layers`` plus those evenly
    and the first / last one holds one transformer layer fewer (Megatron-LM's rule)."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    embedding, loss = args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split
    pp = args.pipeline_model_parallel_size
    if not (embedding or loss) or pp == 1:
        return first, last
    if first is not None or last is not None:
        raise ValueError("--account-for-embedding/loss-in-pipeline-split and --decoder-first/last-pipeline-num-layers "
                         "are two ways to split the layers: give one of them")
    total = args.num_layers + int(embedding) + int(loss)
    if total % pp:
        raise ValueError(f"--num-layers {args.num_layers} plus the embedding and loss counted as layers ({total}) is "
                         f"not divisible by --pipeline-model-parallel-size {pp}")
    return (total // pp - 1 if embedding else None), (total // pp - 1 if loss else None)


def virtual_pipeline_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that set the virtual stages, as given."""
    flags = ("--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank",
             "--num-layers-per-virtual-pipeline-stage")
    return [f"{flag} {getattr(args, flag[2:].replace('-', '_'))}" for flag in flags
            if getattr(args, flag[2:].replace("-", "_"), None) is not None]


def check_pipeline_flags(args: argparse.Namespace) -> None:
    """The layout flags agree: one way to set the virtual stages, a layout string instead of the uneven-split
    flags, pp > 1 with virtual stages, a micro-batch group of at least pp (ValueError naming them)."""
    pp, virtual = args.pipeline_model_parallel_size, virtual_pipeline_flags(args)
    if len(virtual) > 1:
        raise ValueError(f"{' and '.join(virtual)} both set the virtual pipeline stages: give one of them")
    if args.pipeline_model_parallel_layout is not None:
        uneven = [f"--{name.replace('_', '-')}" for name in ("decoder_first_pipeline_num_layers",
                  "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                  "account_for_loss_in_pipeline_split") if getattr(args, name) not in (None, False)]
        if uneven:
            raise ValueError(f"{virtual[0]} gives every stage's layers; drop {', '.join(uneven)}")
    if args.num_layers_per_virtual_pipeline_stage is not None and pp == 1:
        raise ValueError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    vpp = virtual_pipeline_size(args)
    if vpp and pp == 1:
        raise ValueError(f"{virtual[0]} needs --pipeline-model-parallel-size > 1: it sets {vpp} virtual stages")
    pipeline_layout(args)  # raises for a bad layout string or an uneven split the chunks cannot take
    group = args.microbatch_group_size_per_vp_stage
    if group is not None and (group < 1 or (vpp and group < pp)):
        raise ValueError(f"--microbatch-group-size-per-virtual-pipeline-stage {group} must be at least "
                         f"--pipeline-model-parallel-size {pp} (each virtual stage runs a group of micro-batches)")


def pipeline_layout(args: argparse.Namespace) -> Optional[list[int]]:
    """The transformer layers of every model chunk (``TransformerConfig.pipeline_model_parallel_layout``) for
    ``--pipeline-model-parallel-layout``, or for uneven stages with virtual stages (``layout.split_chunk_counts``);
    None where ``pipeline_split``'s first/last counts (or an even split) describe the layout."""
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout is not None:
        return parse_layout(args.pipeline_model_parallel_layout, pipeline_model_parallel_size=pp,
                            num_layers=args.num_layers, mtp_num_layers=args.mtp_num_layers)
    vpp = virtual_pipeline_size(args)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    embedding, loss = args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split
    if not vpp or (first is None and last is None and not embedding and not loss):
        return None
    if (embedding or loss) and (first is not None or last is not None):
        pipeline_split(args)  # raises: two ways to split the layers
    return split_chunk_counts(args.num_layers, pp, vpp, first=first, last=last, embedding=embedding, loss=loss)


def virtual_pipeline_size(args: argparse.Namespace) -> Optional[int]:
    """vpp from ``--pipeline-model-parallel-layout`` (its chunks / pp), ``--num-virtual-stages-per-pipeline-rank``
    or ``--num-layers-per-virtual-pipeline-stage``; None for one chunk per rank."""
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout is not None:
        chunks = len(expand_layout(args.pipeline_model_parallel_layout))
        return chunks // pp if chunks % pp == 0 and chunks > pp else None  # (parse_layout names a bad count)
    stages = args.num_virtual_stages_per_pipeline_rank
    if stages is not None:
        if stages < 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {stages}")
        uneven = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) != (None, None) or (
            args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split)
        if not uneven and args.num_layers % (pp * stages):
            raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} "
                             f"x --num-virtual-stages-per-pipeline-rank {stages}")
        return stages if stages > 1 else None
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return None
    if args.num_layers % (pp * per_stage) != 0:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                         f"--num-layers-per-virtual-pipeline-stage {per_stage}")
    return args.num_layers // (pp * per_stage)


__all__ = ["check_pipeline_flags", "pipeline_layout", "pipeline_split", "virtual_pipeline_flags",
           "virtual_pipeline_size"]
