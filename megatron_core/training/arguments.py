"""Megatron-LM's command-line flags, parsed once and validated, then turned into the typed configs.

Defaults train a tiny GPT on the built-in corpus in about a minute on a CPU, so ``python pretrain_gpt.py``
works with no flags; the defaults that Megatron-LM also has (schedule, evaluation, split, NaN check) are
Megatron's. The flags of Megatron-LM's example scripts are all recognized: the ones this framework implements
act, the ones that do not apply here are accepted and documented, and features that are not built exit with
status 2 and a paragraph naming the flag (``arguments_megatron.py``). An unknown flag exits with the closest
known flag of the same polarity suggested.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn, Optional, Sequence

import torch

from megatron_core.config import TransformerConfig
from megatron_core.training import arguments_megatron as megatron_flags
from megatron_core.training import megatron_table
from megatron_core.training.arguments_fp8 import add_fp8_flags, fp8_config, validate_fp8_flags
from megatron_core.training.arguments_moe import add_moe_flags, moe_config, validate_moe_flags
from megatron_core.training.arguments_muon import add_muon_flags, resolve_muon_flags
from megatron_core.training.arguments_pipeline import (  # noqa: F401 (pipeline_split: re-exported)
    check_pipeline_flags,
    pipeline_layout,
    pipeline_split,
    virtual_pipeline_flags,
    virtual_pipeline_size,
)
from megatron_core.training.arguments_variants import add_variant_flags, variant_config_kwargs
from megatron_core.training.elastic import add_elastic_flags, validate_elastic_flags
from megatron_core.training.schedule import validate_schedule_flags

logger = logging.getLogger(__name__)


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1, help="with --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "yarn", "none"],
                   default="learned_absolute", help="yarn: rope with YaRN scaling (= rope --rope-type yarn)")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="no learned position embedding: with rope a no-op, else --position-embedding-type none")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0, help="share of each head's channels rotated")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated in Megatron-LM: the same as --position-embedding-type rope")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="rope pairs channels (2i, 2i+1) (the paper's and GPT-J's layout), not (i, i+d/2)")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="divide positions by this factor (linear position interpolation)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama-3.1's rope frequency scaling (transformers' rope type llama3)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0, help="with --use-rope-scaling")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0, help="with --use-rope-scaling")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="with --use-rope-scaling: the context length the model was pretrained at")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights stored zero-centered: the norm multiplies by (1 + weight)")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize each head's query and key")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true", help="GeLU with the tanh approximation (GPT-2)")
    g.add_argument("--squared-relu", action="store_true", help="relu(x)^2 as the MLP activation (Primer)")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="bias on the fused QKV projection even with --disable-bias-linear (Qwen2)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--recompute-activations", action="store_true", help="= --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="selective recompute of: core_attn (default), mlp, layernorm, mla_up_proj, moe")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers of the first pipeline stage (the other stages share the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers of the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the input embedding as one layer of the first stage when splitting the layers")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as one layer of the last stage when splitting the layers")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved 1F1B): --num-layers split evenly over pp x N")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help="the model's chunks in order, split by '|': E embedding, t transformer layer, m MTP layer, "
                        "L loss; X*N and (...)*N repeat, e.g. 'Et*3|(tt|)*6tmL'; pp x vpp chunks set vpp "
                        "(docs/pipeline_parallel.md)")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage",
                   help="interleaved schedule: micro-batches each virtual stage runs before the next (default pp)")
    g.add_argument("--enable-zero-bubble", action="store_true",
                   help="the zero-bubble ZB-H1 pipeline schedule (input and weight gradients in separate passes): "
                        "1F1B's memory, a third of its bubble; needs pp > 1, no virtual stages, ZeRO 0-2 (the flag "
                        "of the zero-bubble Megatron-LM fork)")
    g.add_argument("--zero-bubble-defer", choices=["all", "cooldown"], default=None,
                   help="which backwards zero bubble splits: all (ZB-H1) or each stage's last r (cooldown); default "
                        "all on GPUs, cooldown on CPU (docs/pipeline_parallel.md)")
    g.add_argument("--sequence-parallel", action="store_true", help="turned off with a warning at tp 1")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="overlap the sequence-parallel all-gather / reduce-scatter with the linear layers' GEMMs "
                        "(needs --sequence-parallel; turned off with a warning at tp 1)")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="ZeRO stage 1")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1, metavar="N",
                   help="partial distributed optimizer: cut the dp x cp ranks into N instances of consecutive ranks, "
                        "each holding a full copy of the optimizer state sharded over its own ranks; grads are "
                        "reduce-scattered in the instance and all-reduced across instances (N must divide dp x cp; "
                        "needs --use-distributed-optimizer, ZeRO 1-2; docs/zero.md)")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None)
    g.add_argument("--data-parallel-sharding-strategy", default=None,
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="ZeRO stage 3 (default --data-parallel-sharding-strategy optim_grads_params)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="runs this framework's ZeRO-3 (parameters, gradients and optimizer states sharded over dp, "
                        "as torch's fully_shard), not torch's FSDP2 itself")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="ZeRO 1-2: overlap the all-gather of updated parameters with the next forward (each "
                        "module waits for its bucket); ZeRO-3 always prefetches")
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="build the model on the meta device and materialize only this rank's shards (ZeRO-3)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce grads in the parameters' 16-bit dtype (default: fp32)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce grads in fp32 (the default here)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--bind-cores-to-rank", action="store_true",
                   help="CPU runs: pin each rank of a host to its own share of the cores (DeepSpeed's "
                        "--bind_cores_to_rank), so its gloo threads compete with its own compute only; measured "
                        "faster for dp and pp on gloo, slower for tp (docs/performance.md)")


def _training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x dp")
    g.add_argument("--step-batch-size-schedule", default=None,
                   help='global batch by consumed tokens: "0:16 2.4B:320 12B:1536" (K, M, B, T suffixes)')
    g.add_argument("--train-iters", type=int, default=None, help="default: 100 (unless --train-samples)")
    g.add_argument("--train-samples", type=int, default=None, help="sample-based training")
    g.add_argument("--eval-interval", type=int, default=None, help="default: no evaluation during training")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (regional; inductor: C++ on CPU, Triton on CUDA)")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--optimizer", choices=["adam", "sgd", "muon", "dist_muon"], default="adam",
                   help="muon: Muon for the weight matrices, AdamW for the rest (see --muon-*); dist_muon: the same "
                        "with the optimizer states sharded over dp")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None, help="lr of the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warmup as a share of the decay")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="lr at the start of the warmup")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default: --train-samples")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over all tokens of the global batch, not per micro-batch")
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--optimizer-nvme-offload-dir", default=None, metavar="DIR",
                   help="keep this rank's fp32 masters and Adam states in files under DIR, streamed in chunks")
    g.add_argument("--optimizer-nvme-chunk-elements", type=int, default=4 * 2 ** 20,
                   help="elements per streamed chunk of --optimizer-nvme-offload-dir")
    g.add_argument("--optimizer-host-adam", choices=("exact", "fused"), default="exact",
                   help="host Adam kernel with CPU/NVMe offload: torch AdamW's exact math or the fused CPU kernel")
    g.add_argument("--no-fused-adam", dest="fused_adam", action="store_false",
                   help="in-memory Adam: torch AdamW's per-op update (bit-identical to --optimizer-host-adam exact) "
                        "instead of its fused kernel")
    g.add_argument("--param-offload", choices=("none", "cpu", "nvme"), default="none",
                   help="ZeRO-3: keep parameter shards on the host or in NVMe files between uses")
    g.add_argument("--param-nvme-offload-dir", default=None, metavar="DIR",
                   help="folder of --param-offload nvme (default: --optimizer-nvme-offload-dir)")
    g.add_argument("--skip-train", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit once the run has lasted this long")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   help="(default) stop with an error naming the iteration and rank on a non-finite loss or grad norm")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=100,
                   help="abort when this many optimizer steps in a row were skipped (fp16 overflow)")


def _io_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data, checkpoints and logging")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefixes, weighted (0.3 a 0.7 b) or not (a b: blended by their sizes)")
    g.add_argument("--mock-data", action="store_true", help="synthetic documents, no files")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None, help="where sample indices are cached")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss where the input token is eod")
    g.add_argument("--reset-position-ids", action="store_true", help="position ids restart after each eod")
    g.add_argument("--tokenizer-type", default=None,
                   help="default: GPT2BPETokenizer with --vocab-file/--merge-file, else ByteTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--save", default=None)
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="keep every N-th checkpoint and the newest; remove the others after each save")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None, help="a folder without a checkpoint starts from scratch (with a warning)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="exit (status 2) when --load holds no checkpoint, instead of starting from scratch")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--load-fallback", action="store_true",
                   help="if the newest checkpoint is missing a file or corrupt, load the newest older one that is not")
    g.add_argument("--finetune", action="store_true", help="load weights only; start at iteration 0")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model architecture and tokenizer from the --load checkpoint's recorded flags (a "
                        "flag given here that contradicts it is an error)")
    g.add_argument("--ignore-mismatched-sizes", action="store_true",
                   help="with --finetune: load what fits from a checkpoint of another shape or vocab (tensors of "
                        "another shape or absent keep their initialization, extra ones are ignored; each listed)")
    g.add_argument("--allow-missing-checksums", action="store_true",
                   help="load a checkpoint whose metadata.json lacks the sha256 of some file (older or hand-made "
                        "ones); by default every file must have one")
    g.add_argument("--debug", action="store_true",
                   help="show the traceback of a handled error (bad input, a failed save) before its message")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-file", default=None, help="JSON lines: one object per iteration and evaluation")
    g.add_argument("--loss-curve-png", default=None, help="write the training loss curve as a PNG at the end")
    g.add_argument("--kernel-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="fused ops (norms, softmax, cross-entropy): auto = compiled Triton on CUDA, torch on the CPU; "
                        "torch everywhere; or triton (on the CPU: the Triton interpreter, TRITON_INTERPRET=1)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar for evaluations of 10 or more iterations (drawn only on a terminal)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak TFLOP/s of one device for MFU (default: from a table of known accelerators)")


class _Parser(argparse.ArgumentParser):
    """A usage error is one paragraph naming the problem, not the whole usage text."""

    def error(self, message: str) -> NoReturn:
        exit_with_config_error(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pretrain_gpt.py", description="3D-parallel GPT pretraining", allow_abbrev=False)
    for add in (_model_flags, _parallel_flags, _training_flags, _io_flags):
        add(parser)
    megatron_flags.add_megatron_flags(parser)
    add_moe_flags(parser)
    add_variant_flags(parser)
    add_fp8_flags(parser)
    add_muon_flags(parser)
    add_elastic_flags(parser)
    megatron_table.add_no_op_flags(parser)
    parser.widened_choices = megatron_table.widen_choices(parser)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and validates Megatron-style flags; exits (status 2) with one paragraph naming the problem."""
    parser = build_parser()
    argv = megatron_flags.strip_shell_quotes(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    known = [opt for action in parser._actions for opt in action.option_strings]
    refused, unknown = megatron_table.refused_given(unknown, set(known))
    refused += megatron_table.refused_values(args, parser.widened_choices)
    refusal = megatron_flags.refusal(args, unknown, refused)
    if refusal:
        exit_with_config_error(refusal)
    if unknown:
        parser.error(megatron_flags.unrecognized_message(unknown, known))
    no_ops = megatron_table.given_no_ops(args)
    if no_ops:
        megatron_flags.warn_rank_0(f"accepted for Megatron-LM compatibility, no effect here: {', '.join(no_ops)} "
                                   "(pretrain_gpt.py --help says why for each)")
    try:
        if args.use_checkpoint_args:
            from megatron_core.training.checkpoint_args import apply_checkpoint_args
            apply_checkpoint_args(args, vars(parser.parse_args([])))
        validate_args(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def _activation(args: argparse.Namespace) -> str:
    given = [flag for flag in ("swiglu", "squared_relu", "quick_geglu") if getattr(args, flag, False)]
    if len(given) > 1:
        raise ValueError(f"{' and '.join('--' + g.replace('_', '-') for g in given)} are MLP activations: give one "
                         "of them")
    return given[0] if given else "gelu"


def _one_cp_comm_type(value) -> str:
    """--cp-comm-type parses as a list (Megatron allows one per layer); validated args hold one value already,
    tools that build a config from unvalidated args (the converter) pass the list."""
    return value if isinstance(value, str) else value[0]


def zero_stage(args: argparse.Namespace) -> int:
    """The ZeRO stage from --zero-stage, --data-parallel-sharding-strategy, --use-megatron-fsdp or
    --use-torch-fsdp2 (stage 3 unless a strategy says otherwise: this framework's ZeRO-3, which shards
    parameters, gradients and optimizer states over dp as both do) or --use-distributed-optimizer (stage 1)."""
    strategies = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
    stages = set()
    if args.zero_stage is not None:
        stages.add(args.zero_stage)
    if args.data_parallel_sharding_strategy is not None:
        stages.add(strategies[args.data_parallel_sharding_strategy])
    if (args.use_megatron_fsdp or args.use_torch_fsdp2) and not stages:
        stages.add(3)
    if args.use_distributed_optimizer and not stages:
        stages.add(1)
    if len(stages) > 1:
        raise ValueError(f"--zero-stage {args.zero_stage} and --data-parallel-sharding-strategy "
                         f"{args.data_parallel_sharding_strategy} disagree; give one of them")
    return stages.pop() if stages else 0


def _resolve_model_flags(args: argparse.Namespace) -> None:
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.use_rotary_position_embeddings:  # Megatron-LM's deprecated spelling
        args.position_embedding_type = "rope"
    if args.position_embedding_type == "yarn":  # Megatron's GPT builds YaRN rope for it
        if args.rope_type == "rope":
            raise ValueError("--position-embedding-type yarn and --rope-type rope disagree; give one of them")
        args.position_embedding_type, args.rope_type = "rope", "yarn"
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise ValueError("--recompute-activations (selective recompute) and --recompute-granularity full "
                             "disagree; give one of them")
        args.recompute_granularity = "selective"
    if args.recompute_modules is not None and args.recompute_granularity != "selective":
        raise ValueError(f"--recompute-modules {' '.join(args.recompute_modules)} needs selective recompute "
                         "(--recompute-activations or --recompute-granularity selective)")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        megatron_flags.warn_rank_0("--sequence-parallel is turned off: tensor model parallelism is 1")
        args.sequence_parallel = False
    if args.tp_comm_overlap and args.tensor_model_parallel_size == 1:
        megatron_flags.warn_rank_0("--tp-comm-overlap is turned off: tensor model parallelism is 1")
        args.tp_comm_overlap = False
    if args.tp_comm_overlap and not args.sequence_parallel:
        raise ValueError("--tp-comm-overlap needs --sequence-parallel: it overlaps the sequence-parallel "
                         "all-gather / reduce-scatter with the GEMMs")


def _check_zero_bubble(args: argparse.Namespace) -> None:
    if args.zero_bubble_defer is not None and not args.enable_zero_bubble:
        raise ValueError(f"--zero-bubble-defer {args.zero_bubble_defer} needs --enable-zero-bubble")
    if not args.enable_zero_bubble:
        return
    if args.pipeline_model_parallel_size == 1:
        raise ValueError("--enable-zero-bubble needs --pipeline-model-parallel-size > 1 (got 1): it is a pipeline "
                         "schedule")
    if virtual_pipeline_size(args):
        raise ValueError(f"--enable-zero-bubble runs without virtual stages: drop {virtual_pipeline_flags(args)[0]}")
    if args.zero_stage == 3:
        raise ValueError("--enable-zero-bubble cannot run with ZeRO-3 (its parameter gathering follows the backward, "
                         "and the weight gradients come later): use --zero-stage 0-2")


def validate_args(args: argparse.Namespace) -> None:
    """Fills derived defaults and rejects invalid combinations (ValueError naming the values)."""
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    _resolve_model_flags(args)
    validate_schedule_flags(args)
    for name in ("micro_batch_size", "log_interval", "eval_interval", "seq_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ValueError(f"--seq-length {args.seq_length} is longer than --max-position-embeddings "
                         f"{args.max_position_embeddings}; raise the latter or use --position-embedding-type rope")
    if args.num_query_groups not in (None, 1) and not args.group_query_attention:
        raise ValueError(f"--num-query-groups {args.num_query_groups} needs --group-query-attention")
    if not args.group_query_attention:
        args.num_query_groups = None  # (Megatron-LM's default 1 applies with --group-query-attention only)
    if args.save_interval is not None and args.save is None:  # Megatron-LM saves nothing then, too
        megatron_flags.warn_rank_0(f"--save-interval {args.save_interval} without --save: no checkpoints are written")
    for flag in ("save_retain_interval", "check_weight_hash_across_dp_replicas_interval"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.ignore_mismatched_sizes and not args.finetune:
        raise ValueError("--ignore-mismatched-sizes changes shapes on purpose and needs --finetune (a resumed run "
                         "must match its checkpoint)")
    check_pipeline_flags(args)
    resolve_muon_flags(args)
    args.zero_stage = zero_stage(args)
    _check_zero_bubble(args)
    instances = args.num_distributed_optimizer_instances
    if instances < 1:
        raise ValueError(f"--num-distributed-optimizer-instances must be >= 1 (1: one instance), got {instances}")
    if instances > 1 and args.zero_stage not in (1, 2):
        raise ValueError(f"--num-distributed-optimizer-instances {instances} needs the distributed optimizer: add "
                         f"--use-distributed-optimizer (or --zero-stage 2); got ZeRO stage {args.zero_stage}")
    if args.overlap_param_gather and args.zero_stage == 0:
        raise ValueError("--overlap-param-gather needs the distributed optimizer: add --use-distributed-optimizer "
                         "(or --zero-stage 1-3)")
    if args.init_model_with_meta_device and args.zero_stage != 3:
        raise ValueError(f"--init-model-with-meta-device needs ZeRO-3 (--use-megatron-fsdp or --zero-stage 3), got "
                         f"ZeRO stage {args.zero_stage}: only ZeRO-3 materializes each rank's shard alone")
    if args.param_offload != "none" and args.zero_stage != 3:
        raise ValueError(f"--param-offload {args.param_offload} needs ZeRO-3 (--zero-stage 3 or --use-megatron-fsdp), "
                         f"got ZeRO stage {args.zero_stage}: only ZeRO-3 shards the parameters")
    if args.param_offload == "nvme" and args.param_nvme_offload_dir is None:
        if args.optimizer_nvme_offload_dir is None:
            raise ValueError("--param-offload nvme needs a folder: pass --param-nvme-offload-dir DIR "
                             "(or --optimizer-nvme-offload-dir DIR)")
        args.param_nvme_offload_dir = args.optimizer_nvme_offload_dir
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise ValueError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 disagree; give one of them")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path disagree: synthetic data or files, give one of them")
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"  # Megatron's default tokenizer
    megatron_flags.validate_megatron_flags(args)
    validate_moe_flags(args)
    validate_fp8_flags(args)
    validate_elastic_flags(args)


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """The model config the flags describe (raises ValueError naming invalid values)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    layout = pipeline_layout(args)
    first_stage_layers, last_stage_layers = pipeline_split(args) if layout is None else (None, None)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        normalization=args.normalization, activation=_activation(args),
        openai_gelu=args.openai_gelu,
        add_bias_linear=not args.disable_bias_linear, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
        rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        rotary_interleaved=args.rotary_interleaved,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        rope_scaling_low_freq_factor=args.rope_scaling_low_freq_factor,
        rope_scaling_high_freq_factor=args.rope_scaling_high_freq_factor,
        rope_scaling_original_max_position_embeddings=args.rope_scaling_original_max_position_embeddings,
        add_qkv_bias=True if args.add_qkv_bias else None,
        max_position_embeddings=args.max_position_embeddings,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.layernorm_epsilon, layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm=args.qk_layernorm, init_method_std=args.init_method_std,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=tuple(args.recompute_modules) if args.recompute_modules else ("core_attn",),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        first_pipeline_num_layers=first_stage_layers, last_pipeline_num_layers=last_stage_layers,
        pipeline_model_parallel_layout=layout,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        context_parallel_size=args.context_parallel_size, cp_comm_type=_one_cp_comm_type(args.cp_comm_type),
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args), sequence_parallel=args.sequence_parallel,
        tp_comm_overlap=args.tp_comm_overlap, params_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        moe=moe_config(args), fp8=fp8_config(args), compile=args.compile, **variant_config_kwargs(args))


def exit_with_config_error(error: object, status: int = 2) -> NoReturn:
    """Prints ``pretrain_gpt.py: error: <message>`` (one paragraph, no traceback) and exits."""
    print(f"pretrain_gpt.py: error: {error}", file=sys.stderr)  # the command-line's error channel
    raise SystemExit(status)
