"""Draws what each pipeline rank did during one training step: 1F1B (interleaved 1F1B with --vpp, zero bubble
with --zero-bubble all|cooldown) on a small GPT over gloo ranks on this machine; writes the PNG (one row per
rank, forward blue / backward green / weight purple, measured bubble in the title) and a Chrome trace next to it.

    python scripts/pipeline_timeline.py [--pp 4 --microbatches 8 --vpp 2 --png scripts/figures/pipeline_timeline.png]
    python scripts/pipeline_timeline.py --zero-bubble all --png scripts/figures/pipeline_timeline_zero_bubble.png
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.models import GPTModel
from megatron_core.pipeline_parallel import Timeline, get_forward_backward_func
from megatron_core.pipeline_parallel.schedule_plan import bubble_fraction_formula
from megatron_core.pipeline_parallel.timeline import gather_timelines, summarize, write_chrome_trace, write_png
from megatron_core.testing import run_distributed

VOCAB, SEQ, MICRO_BATCH, HIDDEN = 512, 256, 2, 256


def _one_step(args) -> str:
    vpp = args.vpp if args.vpp > 1 else None
    state = initialize_model_parallel(pipeline_model_parallel_size=dist.get_world_size(),
                                      virtual_pipeline_model_parallel_size=vpp)
    config = TransformerConfig(num_layers=2 * args.pp * (vpp or 1), hidden_size=HIDDEN, num_attention_heads=4,
                               max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                               pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=vpp)
    chunks = []
    for vp in range(vpp or 1):
        first = state.is_first_model_chunk(vp) if vpp else state.is_pipeline_first_stage
        last = state.is_last_model_chunk(vp) if vpp else state.is_pipeline_last_stage
        chunks.append(GPTModel(config, parallel_state=state, vocab_size=VOCAB, max_sequence_length=SEQ,
                               pre_process=first, post_process=last, vp_stage=vp if vpp else None,
                               share_embeddings_and_output_weights=False))
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH * args.microbatches, SEQ + 1),
                           generator=torch.Generator().manual_seed(1))
    micro = list(zip(tokens[:, :-1].split(MICRO_BATCH), tokens[:, 1:].split(MICRO_BATCH)))
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)

    def forward_step(iterator, model):
        t, lab = next(iterator)
        return model(t, positions, labels=lab), lambda loss: (loss.mean(), {"lm loss": loss.mean().detach()})

    schedule = get_forward_backward_func(args.pp, vpp, zero_bubble=args.zero_bubble is not None,
                                         zero_bubble_defer=args.zero_bubble)
    for step in range(2):  # the first step warms up; the second is drawn
        timeline = Timeline()
        schedule(forward_step_func=forward_step, data_iterator=[iter(micro) for _ in chunks] if vpp else iter(micro),
                 model=chunks if vpp else chunks[0], num_microbatches=args.microbatches, seq_length=SEQ,
                 micro_batch_size=MICRO_BATCH, parallel_state=state, timeline=timeline)
    per_rank = gather_timelines(timeline, state.pp_group)
    formula = bubble_fraction_formula(args.pp, args.microbatches, vpp or 1, zero_bubble=args.zero_bubble == "all")
    if state.pp_rank == 0:
        name = "interleaved 1F1B" if vpp else "1F1B"
        if args.zero_bubble:
            name = "zero bubble ZB-H1" if args.zero_bubble == "all" else "zero bubble (cooldown split)"
        write_png(per_rank, args.png, formula=formula, formula_label="(p-1)/(3m)" if args.zero_bubble == "all"
                  else "(p-1)/(v*m)",
                  title=f"{name}, pp {args.pp}{f' x vpp {vpp}' if vpp else ''}, {args.microbatches} micro-batches")
        write_chrome_trace(per_rank, os.path.splitext(args.png)[0] + ".trace.json")
    destroy_model_parallel(state)
    return summarize(per_rank, formula)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--vpp", type=int, default=1, help="virtual stages per rank (interleaved 1F1B when > 1)")
    parser.add_argument("--zero-bubble", choices=["all", "cooldown"], default=None,
                        help="the zero-bubble schedule, splitting all backwards (ZB-H1) or the cooldown's")
    parser.add_argument("--png", default="outputs/pipeline_timeline.png")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    torch.set_num_threads(1)
    print(run_distributed(args.pp, _one_step, args)[0])
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
