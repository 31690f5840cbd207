"""Megatron-LM's FP8 flags (``--fp8-format``, ``--fp8-recipe``, ...) and the ``Fp8Config`` they describe.

On a device without FP8 tensor cores (a CPU, or a GPU below compute capability 8.9) FP8 runs emulated with
the same quantization (``megatron_core.fp8``): a warning, never a refusal. FP4 and Transformer Engine's own
quantizer factories stay refused (``megatron_table``)."""
from __future__ import annotations

import argparse
from typing import Optional

from megatron_core.fp8.config import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES, Fp8Config


def add_fp8_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fp8 training")
    g.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                   help="train the transformer layers' linears in FP8: hybrid (E4M3 forward, E5M2 gradients) or "
                        "e4m3; emulated exactly where the device has no FP8 tensor cores")
    g.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="delayed",
                   help="delayed (amax history), tensorwise (current scaling), blockwise (1x128 / 128x128 blocks) "
                        "or mxfp8 (32-element blocks, E8M0 scales)")
    g.add_argument("--fp8-margin", type=int, default=0, help="scale = fp8_max / amax / 2**margin")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="delayed scaling: amax history length")
    g.add_argument("--fp8-amax-compute-algo", choices=AMAX_COMPUTE_ALGOS, default="most_recent",
                   help="delayed scaling: the scale from the newest amax or the history's max")
    g.add_argument("--fp8-interval", type=int, default=1,
                   help="deprecated in Megatron-LM (no effect there either): scales update every step")
    g.add_argument("--fp8-param-gather", action="store_true", help="ZeRO-1/3 gather the weights in FP8")
    g.add_argument("--no-fp8-wgrad", "--disable-fp8-wgrad", action="store_false", dest="fp8_wgrad",
                   help="weight gradients from the high-precision operands")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first / last layers' linears out of FP8 (see the next two flags)")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)


def fp8_config(args: argparse.Namespace) -> Optional[Fp8Config]:
    """The FP8 settings of the flags, or None without ``--fp8-format`` (raises ValueError naming values)."""
    if args.fp8_format is None:
        return None
    return Fp8Config(fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                     fp8_amax_history_len=args.fp8_amax_history_len,
                     fp8_amax_compute_algo=args.fp8_amax_compute_algo, fp8_wgrad=args.fp8_wgrad,
                     fp8_param_gather=args.fp8_param_gather, first_last_layers_bf16=args.first_last_layers_bf16,
                     num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
                     num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16)


def validate_fp8_flags(args: argparse.Namespace) -> None:
    """ValueError naming the values; a warning when FP8 runs emulated on this device."""
    fp8_only = [flag for flag, given in (("--fp8-param-gather", args.fp8_param_gather),
                                         ("--first-last-layers-bf16", args.first_last_layers_bf16)) if given]
    if args.fp8_format is None:
        if fp8_only:
            raise ValueError(f"{', '.join(fp8_only)} need FP8 training: add --fp8-format hybrid (or e4m3)")
        return
    fp8_config(args)  # the recipe's own checks, in flag terms
    if args.first_last_layers_bf16 and (args.num_layers_at_start_in_bf16 + args.num_layers_at_end_in_bf16
                                        >= args.num_layers):
        raise ValueError(f"--num-layers-at-start-in-bf16 {args.num_layers_at_start_in_bf16} + "
                         f"--num-layers-at-end-in-bf16 {args.num_layers_at_end_in_bf16} leave none of the "
                         f"{args.num_layers} layers in FP8; lower them or drop --first-last-layers-bf16")
    from megatron_core.fp8.config import fp8_runs_emulated
    reason = fp8_runs_emulated()
    if reason:
        from megatron_core.training.arguments_megatron import warn_rank_0
        warn_rank_0(f"--fp8-format {args.fp8_format} runs emulated ({reason}): the same quantization, "
                    "dequantized for an fp32-accumulated matmul; no FP8 speed-up")


__all__ = ["add_fp8_flags", "fp8_config", "validate_fp8_flags"]
