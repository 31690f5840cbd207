"""Megatron-LM's command-line flags, parsed once and validated, then turned into the typed configs.

Defaults train a tiny GPT on the built-in corpus in about a minute on a CPU, so ``python pretrain_gpt.py``
works with no flags. An unknown flag exits with the closest known flag suggested.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from typing import Optional, Sequence

import torch

from megatron_core.config import TransformerConfig


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true", help="GeLU with the tanh approximation (GPT-2)")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="ZeRO stage 1")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None)
    g.add_argument("--data-parallel-sharding-strategy", default=None,
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)


def _training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x dp")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--skip-train", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit once the run has lasted this long")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="stop with an error naming the iteration and rank when the loss or grad norm is not finite")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=100,
                   help="abort when this many optimizer steps in a row were skipped (fp16 overflow)")


def _io_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data, checkpoints and logging")
    g.add_argument("--data-path", nargs="*", default=None, help="prefixes, optionally weighted: 0.3 a 0.7 b")
    g.add_argument("--split", default="949,50,1")
    g.add_argument("--tokenizer-type", default=None, help="default: ByteTokenizer (no file needed)")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--load-fallback", action="store_true",
                   help="if the newest checkpoint is missing a file or corrupt, load the newest older one that is not")
    g.add_argument("--finetune", action="store_true", help="load weights only; start at iteration 0")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-file", default=None, help="JSON lines: one object per iteration and evaluation")
    g.add_argument("--loss-curve-png", default=None, help="write the training loss curve as a PNG at the end")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak TFLOP/s of one device for MFU (default: from a table of known accelerators)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", description="3D-parallel GPT pretraining",
                                     allow_abbrev=False)
    for add in (_model_flags, _parallel_flags, _training_flags, _io_flags):
        add(parser)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and validates Megatron-style flags; exits with a message naming the problem."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        known = [opt for action in parser._actions for opt in action.option_strings]
        hints = []
        for flag in unknown:
            if flag.startswith("--"):
                close = difflib.get_close_matches(flag.split("=")[0], known, n=1)
                hints.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
        parser.error(f"unrecognized arguments: {' '.join(hints or unknown)}")
    try:
        validate_args(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def zero_stage(args: argparse.Namespace) -> int:
    """The ZeRO stage from --zero-stage, --data-parallel-sharding-strategy or --use-distributed-optimizer."""
    strategies = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
    stages = set()
    if args.zero_stage is not None:
        stages.add(args.zero_stage)
    if args.data_parallel_sharding_strategy is not None:
        stages.add(strategies[args.data_parallel_sharding_strategy])
    if args.use_distributed_optimizer and not stages:
        stages.add(1)
    if len(stages) > 1:
        raise ValueError(f"--zero-stage {args.zero_stage} and --data-parallel-sharding-strategy "
                         f"{args.data_parallel_sharding_strategy} disagree; give one of them")
    return stages.pop() if stages else 0


def validate_args(args: argparse.Namespace) -> None:
    """Fills derived defaults and rejects invalid combinations (ValueError naming the values)."""
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    for name in ("micro_batch_size", "train_iters", "log_interval", "eval_interval", "seq_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ValueError(f"--seq-length {args.seq_length} is longer than --max-position-embeddings "
                         f"{args.max_position_embeddings}; raise the latter or use --position-embedding-type rope")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ValueError(f"--num-query-groups {args.num_query_groups} needs --group-query-attention")
    if args.save_interval is not None and args.save is None:
        raise ValueError("--save-interval needs --save DIR")
    if args.num_layers_per_virtual_pipeline_stage is not None and args.pipeline_model_parallel_size == 1:
        raise ValueError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    args.zero_stage = zero_stage(args)
    if args.lr_warmup_iters > args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} is larger than --lr-decay-iters "
                         f"{args.lr_decay_iters} (default: --train-iters); shorten the warmup")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")


def virtual_pipeline_size(args: argparse.Namespace) -> Optional[int]:
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return None
    pp = args.pipeline_model_parallel_size
    if args.num_layers % (pp * per_stage) != 0:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                         f"--num-layers-per-virtual-pipeline-stage {per_stage}")
    return args.num_layers // (pp * per_stage)


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """The model config the flags describe (raises ValueError naming invalid values)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        normalization=args.normalization, activation="swiglu" if args.swiglu else "gelu",
        openai_gelu=args.openai_gelu,
        add_bias_linear=not args.disable_bias_linear, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, max_position_embeddings=args.max_position_embeddings,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.layernorm_epsilon, init_method_std=args.init_method_std,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args), sequence_parallel=args.sequence_parallel,
        params_dtype=dtype, bf16=args.bf16, fp16=args.fp16)


def exit_with_config_error(error: Exception, status: int = 2) -> None:
    """Prints ``pretrain_gpt.py: error: <message>`` (one paragraph, no traceback) and exits."""
    print(f"pretrain_gpt.py: error: {error}", file=sys.stderr)
    raise SystemExit(status)
