"""The rest of Megatron-LM's flags: runtime and logging switches this framework implements, switches that
do not apply here (accepted, documented in ``ACCEPTED_NO_OPS`` and the README), and features that are not
built (``refusal``: exit status 2 with one paragraph naming the flags and why).

Nothing here reads a flag that ``pretrain_gpt.py`` does not pass: every flag of Megatron-LM's example
scripts (examples/gpt3, llama, mixtral, gptoss, megatron_fsdp) either acts, is accepted, or is refused by name.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
from types import MappingProxyType
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

_FUSION = "fusion switch: the kernels in kernels/ pick their own fused or reference path, with the same numerics"
ACCEPTED_NO_OPS: dict[str, str] = MappingProxyType({
    "--use-mcore-models": "the models are always megatron-core style",
    "--transformer-impl": "one implementation (this framework's own modules, no Transformer Engine)",
    "--attention-backend": "attention runs the fused Triton softmax or PyTorch SDPA, chosen per device",
    "--use-flash-attn": "attention runs the fused Triton softmax or PyTorch SDPA, chosen per device",
    "--attention-softmax-in-fp32": "the softmax always computes in fp32",
    "--no-masked-softmax-fusion": _FUSION, "--no-bias-gelu-fusion": _FUSION, "--no-bias-swiglu-fusion": _FUSION,
    "--no-bias-dropout-fusion": _FUSION, "--no-rope-fusion": _FUSION, "--no-gradient-accumulation-fusion": _FUSION,
    "--no-persist-layer-norm": _FUSION, "--cross-entropy-loss-fusion": _FUSION, "--cross-entropy-fusion-impl": _FUSION,
    "--use-nccl-ub": "NCCL user buffers: a CUDA allocator tuning", "--fsdp-double-buffer": "a buffer tuning of "
    "Megatron-FSDP", "--fsdp-manual-registration": "a buffer tuning of Megatron-FSDP",
    "--no-async-tensor-model-parallel-allreduce": "a CUDA stream overlap switch",
    "--export-force-local-attention": "an export switch", "--enable-experimental": "nothing here is gated",
    "--num-workers": "samples are read in the training process from the memory-mapped files",
    "--no-create-attention-mask-in-dataloader": "no mask is built: attention is causal inside the kernel",
    "--no-mmap-bin-files": "the .bin files are always memory-mapped read-only",
    "--use-pytorch-profiler": "--profile always records a torch.profiler trace",
    "--ckpt-format": "checkpoints are always this framework's layout-independent safetensors format; "
    "tools/checkpoint_convert.py converts",
    "--auto-detect-ckpt-format": "the checkpoint format is always detected",
    "--dist-ckpt-strictness": "loading is always strict: a missing or unexpected tensor is an error",
    "--log-throughput": "tokens/s and TFLOP/s per rank are always in the log line",
    "--timing-log-level": "the log line always has the iteration time", "--timing-log-option": "as --timing-log-level",
    "--tensorboard-log-interval": "TensorBoard gets every iteration", "--tensorboard-queue-size": "a TensorBoard "
    "writer tuning", "--log-timers-to-tensorboard": "TensorBoard gets ms_per_iter anyway",
    "--log-memory-to-tensorboard": "TensorBoard gets mem_bytes anyway", "--log-validation-ppl-to-tensorboard":
    "TensorBoard gets the validation ppl anyway", "--log-throughput-to-tensorboard": "TensorBoard gets tokens/s anyway",
    "--log-l2-norm-grad-to-tensorboard": "TensorBoard gets grad_norm anyway",
    "--disable-bf16-reduced-precision-matmul": "acts on CUDA only (bf16 matmuls reduce in fp32)",
    "--rampup-batch-size": "deprecated and ignored by Megatron-LM too: use --step-batch-size-schedule",
})
_VALUE_NO_OPS = MappingProxyType({"--transformer-impl": ["local", "transformer_engine", "inference_optimized"],
                 "--attention-backend": ["auto", "flash", "fused", "unfused", "local"],
                 "--cross-entropy-fusion-impl": ["native", "te"],
                 "--ckpt-format": ["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
                 "--dist-ckpt-strictness": ["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                                            "raise_all", "return_unexpected", "return_all", "ignore_all"],
                 "--num-workers": int, "--timing-log-level": int, "--timing-log-option": ["max", "minmax", "all"],
                 "--tensorboard-log-interval": int, "--tensorboard-queue-size": int, "--rampup-batch-size": 3})

_MOE = ("this mixture-of-experts option is not built (the --moe-* flags of pretrain_gpt.py --help are); drop "
        "it")
_FP8 = "this FP8 option is not built (--fp8-format, --fp8-recipe, --fp8-amax-*, --fp8-margin, --fp8-param-gather are)"
_FP4 = ("fp4 training needs Transformer Engine's NVFP4 kernels on a Blackwell GPU, which this framework does not "
        "use; drop these flags (--fp8-format hybrid is the closest supported precision)")
_MTP = "this multi-token prediction option is not built (--mtp-num-layers and --mtp-loss-scaling-factor are); drop it"
_CUDA_GRAPH = "CUDA graphs are not built; drop these flags"
_MODELOPT = ("Model Optimizer's export and distillation flags (its own extra arguments of pretrain_gpt.py) are not "
             "built; drop them")
REFUSED_PREFIXES: dict[str, str] = MappingProxyType({"--moe-": _MOE, "--fp8": _FP8, "--fp4": _FP4, "--mtp-": _MTP,
                                                     "--cuda-graph": _CUDA_GRAPH, "--export-": _MODELOPT})
REFUSED_FLAGS: dict[str, str] = MappingProxyType({
    "--enable-cuda-graph": _CUDA_GRAPH, "--external-cuda-graph": _CUDA_GRAPH,
    "--recompute-modules": "selective recompute of these modules is not built; use core_attn, mlp, layernorm, "
    "mla_up_proj, moe",
})
_SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm", "mla_up_proj", "moe")


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Runtime, logging and compatibility flags (the core model/parallel/training flags live in arguments.py)."""
    g = parser.add_argument_group("Megatron-LM runtime and logging")
    g.add_argument("--log-params-norm", action="store_true", help="log the global L2 norm of the parameters")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="log the number of zero grad elements")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-loss-scale-to-tensorboard", action="store_true", default=True)
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false", dest="log_loss_scale_to_tensorboard")
    g.add_argument("--logging-level", type=int, default=None, help="Python logging level (10 debug ... 40 error)")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every N iterations, compare a hash of the weights across data-parallel replicas")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise-repeatable runs: deterministic algorithms (CUDA: cuBLAS workspace, NCCL ring)")
    g.add_argument("--manual-gc", action="store_true", help="disable automatic garbage collection; collect manually")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: collect every N iterations")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: no collection around evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                   help="CUDA: release cached blocks after each step (1) and evaluation (2)")
    g.add_argument("--profile", action="store_true", help="torch.profiler trace of --profile-step-start..end")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[], help="default: every rank")
    g.add_argument("--record-memory-history", action="store_true", help="CUDA: dump a memory snapshot")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle")
    g.add_argument("--wandb-project", default=None, help="log to Weights & Biases (needs the wandb package)")
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--wandb-entity", default=None)
    g.add_argument("--tiktoken-pattern", default=None, help="TikTokenizer: v1 or v2")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="samples per evaluation step (default: --global-batch-size)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks (load-balanced causal split)")
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"], metavar="{p2p,a2a,allgather,a2a+p2p}",
                   help="context-parallel attention: p2p (ring attention, default), a2a (Ulysses all-to-all), "
                        "allgather (K/V all-gathered) or a2a+p2p (all-to-all inside the first level of "
                        "--hierarchical-context-parallel-sizes, ring across the second); one value for every layer")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=_int_list, default=None,
                   metavar="SIZE", help="levels of each cp group for --cp-comm-type a2a+p2p, innermost first, "
                   "product --context-parallel-size (e.g. 2 4: all-to-all over 2 ranks, a ring of 4 such groups)")
    g = parser.add_argument_group("accepted for Megatron-LM compatibility, no effect here (see README)")
    for flag, why in ACCEPTED_NO_OPS.items():
        kind = _VALUE_NO_OPS.get(flag)
        if kind is None:
            g.add_argument(flag, action="store_true", help=why)
        elif kind is int:
            g.add_argument(flag, type=int, default=None, help=why)
        elif isinstance(kind, int):
            g.add_argument(flag, nargs=kind, default=None, help=why)
        else:
            g.add_argument(flag, choices=kind, default=None, help=why)


def strip_shell_quotes(argv: Sequence[str]) -> list[str]:
    """``'99,1,0'`` -> ``99,1,0``: Megatron's scripts put quotes inside array items (``"--split '99,1,0'"``)
    that bash passes through literally when the array is expanded unquoted."""
    out = []
    for token in argv:
        token = str(token)
        if len(token) >= 2 and token[0] == token[-1] and token[0] in "'\"":
            token = token[1:-1]
        out.append(token)
    return out


def _flag_with_value(tokens: Sequence[str], i: int) -> str:
    flag = tokens[i]
    if "=" not in flag and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
        return f"{flag} {tokens[i + 1]}"
    return flag.replace("=", " ", 1)


def _refused_on_known(args: argparse.Namespace) -> list[tuple[str, str]]:
    given = []
    extra = sorted(set(args.recompute_modules or ()) - set(_SELECTIVE_MODULES))
    if extra:
        given.append((f"--recompute-modules {' '.join(extra)}", "--recompute-modules"))
    return given


def refusal(args: argparse.Namespace, unknown: Sequence[str],
            refused: Sequence[tuple[str, str]] = ()) -> Optional[str]:
    """One paragraph naming every given flag of a feature that is not built, and why (``refused``: more
    ``(flag as given, reason)`` pairs, from Megatron-LM's flag table); None if there is none."""
    by_reason: dict[str, list[str]] = {}
    for shown, why in refused:
        by_reason.setdefault(why, []).append(shown)
    for shown, key in _refused_on_known(args):
        by_reason.setdefault(REFUSED_FLAGS[key], []).append(shown)
    for i, token in enumerate(unknown):
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        reason = REFUSED_FLAGS.get(name) or next(
            (why for prefix, why in REFUSED_PREFIXES.items() if name.startswith(prefix)), None)
        if reason is not None:
            by_reason.setdefault(reason, []).append(_flag_with_value(unknown, i))
    if not by_reason:
        return None
    sentences = [f"{', '.join(flags)}: {why}." for why, flags in by_reason.items()]
    return "not supported by this framework: " + " ".join(sentences)


def _is_negative(flag: str) -> bool:
    return flag.startswith("--no-") or flag.startswith("--disable-")


def unrecognized_message(unknown: Sequence[str], known: Sequence[str]) -> str:
    """``unrecognized arguments: --x (did you mean --y?)``; a suggestion never flips the flag's polarity
    (``--no-check-...`` is never answered with ``--check-...``)."""
    hints = []
    for flag in unknown:
        if not flag.startswith("--"):
            continue
        name = flag.split("=")[0]
        same_polarity = [k for k in known if k.startswith("--") and _is_negative(k) == _is_negative(name)]
        close = difflib.get_close_matches(name, same_polarity, n=1)
        hints.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    return f"unrecognized arguments: {' '.join(hints or unknown)}"


def warn_rank_0(message: str) -> None:
    """A warning from the first rank only (before the process group exists: RANK from the environment)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.warning(message)


def _validate_context_parallel(args: argparse.Namespace) -> None:
    """--context-parallel-size and --cp-comm-type; replaces the list of --cp-comm-type with its one value."""
    from megatron_core.config import CP_COMM_TYPES

    cp, kinds = args.context_parallel_size, args.cp_comm_type
    if cp < 1:
        raise ValueError(f"--context-parallel-size must be >= 1, got {cp}")
    unknown = [kind for kind in kinds if kind not in CP_COMM_TYPES]
    if unknown:
        raise ValueError(f"--cp-comm-type {' '.join(unknown)}: choose from {', '.join(CP_COMM_TYPES)}")
    if len(set(kinds)) > 1:
        raise ValueError(f"--cp-comm-type {' '.join(kinds)}: a different communication type per layer is not built; "
                         "give one value for every layer")
    args.cp_comm_type = kinds[0]
    _validate_hierarchical_cp(args)
    if cp > 1 and args.seq_length % (2 * cp):
        raise ValueError(f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size {cp} = "
                         f"{2 * cp}: the load-balanced causal split cuts each sequence into {2 * cp} equal chunks; "
                         "change --seq-length or --context-parallel-size")


def _int_list(value: str) -> list[int]:
    """One argv token of sizes: ``"2"``, or ``"2 2"`` as Megatron-LM's CI runner passes a YAML list."""
    try:
        return [int(part) for part in value.split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {value!r}") from None


def _validate_hierarchical_cp(args: argparse.Namespace) -> None:
    """--hierarchical-context-parallel-sizes (flattened to a tuple): its product is --context-parallel-size, and
    --cp-comm-type a2a+p2p needs two levels whose first divides every tp rank's heads."""
    cp, sizes = args.context_parallel_size, args.hierarchical_context_parallel_sizes
    if sizes is not None:
        sizes = args.hierarchical_context_parallel_sizes = tuple(n for part in sizes for n in part)
        if any(n < 1 for n in sizes) or math.prod(sizes) != cp:
            raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: the sizes must be "
                             f">= 1 with product --context-parallel-size {cp}")
    if args.cp_comm_type != "a2a+p2p" or cp == 1:
        return
    if sizes is None or len(sizes) != 2:
        raise ValueError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (two levels, A x P = "
                         f"--context-parallel-size {cp}: A ranks all-to-all inside a node, P in the ring across), "
                         f"got {'none' if sizes is None else ' '.join(map(str, sizes))}")
    tp, a2a = args.tensor_model_parallel_size, sizes[0]
    heads = args.num_attention_heads
    groups = (args.num_query_groups or heads) if getattr(args, "group_query_attention", False) else heads
    if heads % (tp * a2a) or groups % (tp * a2a):
        raise ValueError(f"--cp-comm-type a2a+p2p splits each tensor-parallel rank's heads over the first "
                         f"--hierarchical-context-parallel-sizes level {a2a}: --num-attention-heads {heads} and "
                         f"--num-query-groups {groups} must be divisible by tp {tp} x {a2a}; choose a smaller first "
                         "level or use --cp-comm-type p2p")


def validate_megatron_flags(args: argparse.Namespace) -> None:
    """Checks of the runtime flags (ValueError naming the values) and warnings for ignored ones."""
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        raise ValueError(f"--profile-step-start {args.profile_step_start} must be >= 0 and below "
                         f"--profile-step-end {args.profile_step_end}")
    _validate_context_parallel(args)
    if args.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.rotary_scaling_factor != 1.0 and (args.rope_type or ("yarn" if args.multi_latent_attention else
                                                                 "rope")) != "yarn":
        warn_rank_0(f"--rotary-scaling-factor {args.rotary_scaling_factor} has no effect without YaRN "
                    "(--rope-type yarn), as in Megatron-LM")
    if args.rampup_batch_size is not None:
        warn_rank_0("--rampup-batch-size is ignored (deprecated in Megatron-LM): use --step-batch-size-schedule")
