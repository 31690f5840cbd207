"""Every flag of Megatron-LM's pretraining parser, recognized from one table.

``megatron_lm_flags.json`` is Megatron-LM's own parser read off (``scripts/extract_megatron_flags.py``): each
flag's argparse kind, choices and default. ``pretrain_gpt.py`` defines the flags it implements itself; every
other one is classified here by ``RULES`` (ordered patterns, the first that matches wins):

- ``NO_OP``: accepted, with no effect here, listed in ``--help`` with the reason (switches our design makes
  moot: checkpoint workers and fully-parallel save/load that our format does anyway, Transformer Engine and
  CUDA stream tunings, NVIDIA's cluster services, inference-engine options a pretraining run never reads);
  a run that gives some prints them once.
- ``REFUSE``: a feature that is not built or cannot run here; given with a value other than Megatron's
  default, the run exits 2 with one paragraph naming the flag and the reason. A flag no rule matches is
  refused as not built, so a new Megatron flag is never silently ignored.

Values of our own flags that Megatron accepts but we do not build (``--optimizer lion``) parse, then are
refused the same way (``refused_values``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from functools import lru_cache
from types import MappingProxyType
from typing import Optional

from megatron_core.training.arguments_megatron import REFUSED_FLAGS, REFUSED_PREFIXES

NO_OP, REFUSE = "no-op", "refuse"

_CKPT = "our checkpoints are always written and read in parallel by every rank, in one layout-independent format"
_CUDA = "a CUDA communication or kernel tuning (Transformer Engine, NCCL, CUDA streams) with no effect on results"
_INFRA = "an NVIDIA cluster service (logging, fault tolerance, straggler detection) this framework does not use"
_INFER = "an inference-engine option: a pretraining run never reads it (as Megatron-LM's pretrain_gpt.py)"
_LOG = "an extra log or profiler detail; the log line, TensorBoard and --profile keep their own"
_OTHER_MODEL = "another model family (BERT, T5, vision, retrieval, Mamba/hybrid, RL): pretrain_gpt.py trains GPT"
_FP8 = ("fp4 training and Transformer Engine's quantizer factories / precision files need Transformer Engine, which "
        "this framework does not use (the --fp8-* recipes are built: emulated on CPU, torch._scaled_mm on GPUs)")
_OPT = "this optimizer option is not built (adam, sgd and muon with fp32 master weights are)"
_OFFLOAD = ("fine-grained activation/CPU offloading of modules is not built; --optimizer-cpu-offload and "
            "--param-offload are")
_DATA = "this data option is not built (--data-path with --split, or --mock-data, and --per-split data paths are)"
_RERUN = "Megatron's rerun state machine (re-running steps to attribute faults) is not built"
_DEBUG_DUMP = "saving activations, gradients or parameters for debugging is not built"
_NOT_BUILT = "a Megatron-LM option this framework has not built"

RULES: tuple[tuple[str, str, str], ...] = (
    # checkpointing that our format does anyway
    (r"--use-persistent-ckpt-worker|--ckpt-fully-parallel-.*|--no-ckpt-fully-parallel-save|"
     r"--ckpt-assume-constant-structure|--dist-ckpt-.*|--distrib-optim-fully-reshardable-mem-efficient|"
     r"--async-strategy|--async-ckpt-.*|--ckpt-pg-tensors-cache-.*|--ckpt-drop-redundant-extra-state|"
     r"--(disable|no)-ckpt-load-validate-sharding-integrity|--use-dist-ckpt|--(disable|no)-strict-fsdp-dtensor-load|"
     r"--(disable|no)-save-tokenizer-assets|--use-checkpoint-opt[-_]param-scheduler", NO_OP, _CKPT),
    (r"--verify-integrity", NO_OP, "every checkpoint file's sha256 is always verified on load"),
    # CUDA, NCCL and Transformer Engine tunings
    (r"--(disable-|no-)?tp-comm-.*|--te-.*|--use-te-activation-func|--use-transformer-engine-op-fuser|--nccl-.*|"
     r"--use-sharp|--sharp-enabled-group|--high-priority-.*|--symmetric-ar-type|--disable-symmetric-registration|"
     r"--flash-attention-version|--disable-jit-fuser|--no-gradient-reduce-div-fusion|--fused-residual-rmsnorm|"
     r"--use-fused-weighted-squared-relu|--ddp-pad-buckets-for-high-nccl-busbw|--gtp-.*|--disable-gloo-process-groups|"
     r"--pipeline-model-parallel-comm-backend|--create-all-gather-group|--use-ring-exchange-p2p|"
     r"--(disable|no)-align-grad-reduce|--no-align-param-gather|--overlap-param-gather-with-optimizer-step|"
     r"--defer-embedding-wgrad-compute|--wgrad-deferral-limit|--delay-wgrad-compute|"
     r"--overlap-p2p-communication-warmup-flush|--no-overlap-p2p-communication|--overlap-moe-expert-parallel-comm|"
     r"--overlap-dispatch-backward-with-experts-wgrad|--ep-overlap-early-attn-memory-release|--mla-down-proj-fusion|"
     r"--use-grouped-gemm-for-.*|--(disable|no)-flight-recorder-.*|--flight-recorder-.*|--suggested-communication-unit-size|"
     r"--no-pin-cpu-(grads|params)|--keep-fp8-transpose-cache|--disable-clone-scatter-output-in-embedding|"
     r"--no-clone-scatter-output-in-embedding|--ddp-average-in-collective|--use-cpu-initialization|--local-rank|"
     r"--megatron-fsdp-(enable-fine-grained-param-gather|max-pool-double-buffer|version)|--fsdp-db-use-persist-buf-on-alloc-fail|"
     r"--tensor-parallel-num-weight-shards|--expert-tensor-parallel-num-weight-shards|--distributed-timeout-seconds-after-init|"
     r"--use-tp-pp-dp-mapping|--batch-invariant-backend|--kitchen-attention-backend", NO_OP, _CUDA),
    # cluster services, logging and profiling extras
    (r"--one-logger-.*|--no-one-logger|--app-tag-.*|--enable-ft-package|--ft-.*|--calc-ft-timeouts|--straggler-.*|"
     r"--disable-straggler-on-startup|--run-workload-inspector-server|--config-logger-dir|--otel-.*|--enable-msc|"
     r"--disable-msc|--object-storage-cache-path|--gpu-sniff-test-interval|--adlr-autoresume(-interval)?",
     NO_OP, _INFRA),
    (r"--log-(energy|device-memory-used|progress|memory-interval|max-attention-logit)|--nvtx-ranges|--record-shapes|"
     r"--pytorch-profiler-collect-.*|--no-barrier-with-level-1-timing|--dump-param-to-param-group-map|"
     r"--disable-log-loss-scale-to-tensorboard|--disable-manual-gc-eval", NO_OP, _LOG),
    (r"--num-dataset-builder-threads|--dataloader-defer-npy-index-mmap|--dataloader-fast-cache-load|--no-data-sharding",
     NO_OP, "the dataset index is built once per node and memory-mapped; samples are read in the training process"),
    (r"--no-use-layer-wise-param-layout", NO_OP, "the parameter layout of Megatron's layer-wise distributed Muon: "
     "dist_muon here shards the states by ZeRO bucket, with the same updates"),
    (r"--apply-query-key-layer-scaling", NO_OP, "it rescales the attention scores by the layer number and back "
     "inside the softmax to avoid fp16 overflow; our softmax computes in fp32, so the result is the same"),
    (r"--fp16-lm-cross-entropy", NO_OP, "the cross entropy always computes in fp32"),
    (r"--test-mode", NO_OP, "Megatron's in-run self-checks of its own fused attention paths; ours are checked by "
     "the test suite and do not change a run's results"),
    (r"--inference-.*|--no-inference-.*|--flash-decode|--enable-chunked-prefill|--num-speculative-tokens|"
     r"--mlp-chunks-for-prefill|--nccl-all-reduce-for-prefill|--use-legacy-static-engine|--decode-only-cuda-graphs|"
     r"--cache-mla-latents|--use-same-sampling-seed-across-dp-ranks", NO_OP, _INFER),
    # not built, or not here
    (r"--fp8-quantizer-factory|--fp4.*|--reuse-grad-buf-for-mxfp8-param-ag|--te-precision-config-file", REFUSE, _FP8),
    (r"--bert-.*|--biencoder-.*|--ict-.*|--dino-.*|--vision-.*|--swin-.*|--img-[hw]|--patch-dim|--num-channels|"
     r"--num-classes|--classes-fraction|--data-per-class-fraction|--evidence-data-path|--titles-data-path|"
     r"--block-data-path|--query-in-block-prob|--use-one-sent-docs|--short-seq-prob|--retriever-.*|--indexer-.*|"
     r"--output-bert-embeddings|--embedding-path|--mamba-.*|--disable-mamba-mem-eff-path|--hybrid-.*|"
     r"--is-hybrid-model|--linear-.*|--gdp-.*|--dsa-.*|--(disable|no)-dsa-.*|--mhc-.*|--enable-mhc-connections|"
     r"--mrope-section|--encoder-.*|--decoder-num-layers|--decoder-seq-length|--relative-attention-.*|--mask-.*|"
     r"--vocab-extra-ids|--rl-.*|--no-rl-.*|--grpo-.*|--perform-rl-step|--langrl-env-config|--refit-method|"
     r"--logits-(save|load)-.*|--export-.*|--sft.*|--experimental-attention-variant|--attention-output-gate|"
     r"--heterogeneous-layers-.*|--spec|--sample-rate|--use-kitchen-attention", REFUSE, _OTHER_MODEL),
    (r"--lion-.*|--exp-avg(-sq)?-dtype|--main-(grads|params)-dtype|--use-precision-aware-optimizer|"
     r"--optimizer-offload-fraction|--use-torch-optimizer-for-cpu-offload|--overlap-cpu-optimizer-d2h-h2d|"
     r"--(start|end)-weight-decay|--weight-decay-incr-style|--head-lr-mult|--no-weight-decay-cond-type|"
     r"--apply-wd-to-qk-layernorm|--optimizer-cuda-graph|--qk-clip.*|--use-mup|--mup-.*|--megatron-fsdp-(main|grad).*",
     REFUSE, _OPT),
    (r"--cpu-offloading-.*|--activation-offload-fraction|--fine-grained-activation-offloading|--offload-modules|"
     r"--min-offloaded-tensor-size|--delay-offload-until-cuda-graph|--delta-offload-bytes-across-pp-ranks|"
     r"--fine-grained-offloading-max-inflight-offloads", REFUSE, _OFFLOAD),
    (r"--fim-.*|--dataloader-type|--dataloader-inter-document-masking|--data-args-path|--per-split-data-args-path|"
     r"--multiple-validation-sets|--validation-set-names|--full-validation|--mid-level-dataset-surplus|"
     r"--per-dataset-sequences-path|--iterations-to-skip|--phase-transition-iterations|--reset-attention-mask|"
     r"--allow-ambiguous-pad-tokens|--null-tokenizer-.*|--tokenizer-.*|--trust-remote-code|--chat-template|"
     r"--use-gigatoken|--padded-vocab-size|--(disable|no)-pad-vocab-size|--decrease-batch-size-if-needed",
     REFUSE, _DATA),
    (r"--rerun-mode|--error-injection-.*|--check-for-(large-grads|spiky-loss)|--result-rejected-tracker-filename",
     REFUSE, _RERUN),
    (r"--save-(activations|dgrads|params|wgrads|tokens-per-expert)-interval", REFUSE, _DEBUG_DUMP),
    (r"--trust-remote-code", REFUSE, "loading never executes code from a file"),
)

# values of refused flags that describe what happens here anyway
HARMLESS_VALUES = MappingProxyType({"--rerun-mode": ("disabled",), "--dataloader-type": ("single",),
                                    "--megatron-fsdp-main-grads-dtype": ("fp32",),  # our ZeRO-3 keeps and reduces
                                    "--megatron-fsdp-grad-comm-dtype": ("fp32",)})  # fp32 grads anyway


@lru_cache(maxsize=None)
def megatron_lm_flags() -> MappingProxyType:
    """``{option: {"dest", "action", "default", "nargs", "choices", "type"}}`` of Megatron-LM's parser."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm_flags.json")
    with open(path, encoding="utf-8") as handle:
        return MappingProxyType(json.load(handle)["flags"])


def classify(option: str) -> tuple[str, str]:
    """``(NO_OP or REFUSE, reason)`` of a Megatron-LM flag that pretrain_gpt.py does not define."""
    named = REFUSED_FLAGS.get(option) or next((why for prefix, why in REFUSED_PREFIXES.items()
                                               if option.startswith(prefix)), None)
    if named is not None:
        return REFUSE, named
    for pattern, kind, reason in RULES:
        if re.fullmatch(pattern, option):
            return kind, reason
    return REFUSE, _NOT_BUILT


def _add_like_megatron(group, option: str, spec: dict, **extra) -> None:
    kind = spec["action"]
    if kind in ("_StoreTrueAction", "_StoreFalseAction", "_StoreConstAction", "_CountAction",
                "BooleanOptionalAction"):  # (the table lists a BooleanOptionalAction's --x and --no-x apart)
        group.add_argument(option, action="store_true", **extra)
    else:
        nargs = spec["nargs"]
        group.add_argument(option, nargs=nargs if nargs not in (0,) else None,
                           action="append" if kind == "_AppendAction" else "store", **extra)


def _no_op_dest(option: str) -> str:
    return "megatron_no_op_" + option.lstrip("-").replace("-", "_")


def add_no_op_flags(parser: argparse.ArgumentParser) -> None:
    """Every Megatron-LM flag ``parser`` lacks that ``classify`` accepts as a no-op, in one ``--help`` group
    (their values are parsed and dropped: ``dest`` under ``megatron_no_op_``, present only when given)."""
    known = {option for action in parser._actions for option in action.option_strings}
    group = parser.add_argument_group("accepted for Megatron-LM compatibility, no effect here")
    for option, spec in sorted(megatron_lm_flags().items()):
        kind, reason = classify(option)
        if option in known or kind != NO_OP:
            continue
        _add_like_megatron(group, option, spec, dest=_no_op_dest(option), default=argparse.SUPPRESS, help=reason)


def given_no_ops(args: argparse.Namespace) -> list[str]:
    """The no-op flags (``add_no_op_flags``) a run gave."""
    given = vars(args)
    return sorted(option for option in megatron_lm_flags() if _no_op_dest(option) in given)


def refused_flag_parser(known: set[str]) -> argparse.ArgumentParser:
    """A parser of every Megatron-LM flag not in ``known`` that ``classify`` refuses (defaults suppressed: a
    parsed namespace holds only the flags given)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for option, spec in sorted(megatron_lm_flags().items()):
        if option not in known and classify(option)[0] == REFUSE:
            _add_like_megatron(parser, option, spec, dest="refused:" + option, default=argparse.SUPPRESS)
    return parser


def _is_default(value, default) -> bool:
    if isinstance(value, list) or isinstance(default, list):
        return isinstance(value, list) and isinstance(default, list) and [str(v) for v in value] == [
            str(d) for d in default]
    if str(value) == str(default):
        return True
    try:
        return float(value) == float(default)
    except (TypeError, ValueError):
        return False


def refused_given(unknown: list[str], known: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """``([(flag as given, reason)], tokens still unknown)`` for the refused Megatron-LM flags in ``unknown``;
    a value flag given with Megatron's default value (or a ``HARMLESS_VALUES`` one) is not listed."""
    namespace, rest = refused_flag_parser(known).parse_known_args(unknown)
    flags = megatron_lm_flags()
    refused = []
    for dest, value in vars(namespace).items():
        option = dest.split(":", 1)[1]
        if flags[option]["action"] == "_StoreAction" and (_is_default(value, flags[option]["default"])
                                                          or value in HARMLESS_VALUES.get(option, ())):
            continue
        text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        shown = option if value is True else f"{option} {text}"
        refused.append((shown, classify(option)[1]))
    return refused, rest


def widen_choices(parser: argparse.ArgumentParser) -> dict[str, tuple[str, tuple, tuple]]:
    """Lets our flags with choices parse every value Megatron-LM accepts; returns ``{dest: (option, values
    not built, values built)}`` for ``refused_values``."""
    flags, widened = megatron_lm_flags(), {}
    for action in parser._actions:
        for option in action.option_strings:
            spec = flags.get(option)
            if action.choices is None or spec is None or not spec["choices"]:
                continue
            built = tuple(action.choices)
            extra = tuple(c for c in spec["choices"] if c not in map(str, built) and "." not in c)
            if extra:
                action.choices = [*built, *extra]
                widened[action.dest] = (option, extra, built)
    return widened


def refused_values(args: argparse.Namespace, widened: dict) -> list[tuple[str, str]]:
    """``[(flag as given, reason)]`` for our flags given a value Megatron-LM has and we have not built."""
    out = []
    for dest, (option, extra, built) in widened.items():
        value = getattr(args, dest, None)
        if value in extra:
            out.append((f"{option} {value}", f"a {option} Megatron-LM has, not built here (built: "
                                             f"{', '.join(map(str, built))})"))
    return out


def markdown(ours: set[str]) -> str:
    """The docs' table of every Megatron-LM flag not in ``ours``: no-ops then refusals, grouped by reason."""
    groups: dict[tuple[str, str], list[str]] = {}
    for option in sorted(megatron_lm_flags()):
        if option not in ours:
            groups.setdefault(classify(option), []).append(option)
    lines = ["| | flags | why |", "| --- | --- | --- |"]
    for (kind, reason), options in sorted(groups.items(), key=lambda item: (item[0][0] != NO_OP, item[0][1])):
        shown = ", ".join(f"`{option}`" for option in options)
        lines.append(f"| {'accepted, no effect' if kind == NO_OP else 'refused'} | {shown} | {reason} |")
    return "\n".join(lines) + "\n"


def megatron_default(option: str) -> Optional[object]:
    spec = megatron_lm_flags().get(option)
    return None if spec is None else spec["default"]


__all__ = ["NO_OP", "REFUSE", "RULES", "megatron_lm_flags", "classify", "add_no_op_flags", "given_no_ops",
           "refused_flag_parser", "refused_given", "widen_choices", "refused_values", "markdown", "megatron_default"]
