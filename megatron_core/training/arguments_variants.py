"""Megatron-LM's flags of the frontier architectures (``config_variants.ArchitectureVariants``): multi-latent
attention, YaRN, gpt-oss's windowed attention with sinks and clamped GeGLU, multi-token prediction."""
from __future__ import annotations

import argparse

from megatron_core.config_variants import ROPE_TYPES, SOFTMAX_TYPES
from megatron_core.training.arguments_moe import _layer_freq


def _window(text: str) -> list[int]:
    """``--window-size 127,0`` (Megatron's ``tuple_type``; brackets and spaces allowed)."""
    try:
        parts = [int(p) for p in text.strip().strip("()[]").split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--window-size {text!r} must be two integers LEFT,RIGHT such as "
                                         "127,0") from error
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"--window-size {text!r} must be two integers LEFT,RIGHT such as 127,0")
    return parts


def add_variant_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-latent attention, YaRN, gpt-oss layers, multi-token prediction")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek's multi-latent attention (low-rank query and joint key/value compression)")
    g.add_argument("--q-lora-rank", type=int, default=None, help="MLA: query down-projection rank (default: none)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: key/value latent rank (what the cache stores)")
    g.add_argument("--qk-head-dim", type=int, default=128, help="MLA: per-head q/k channels without rope")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="MLA: per-head rotary channels")
    g.add_argument("--v-head-dim", type=int, default=128, help="MLA: per-head value channels")
    g.add_argument("--cache-mla-latents", action="store_true",
                   help="accepted: the MLA inference cache always stores the latents")
    g.add_argument("--rope-type", choices=ROPE_TYPES, default=None,
                   help="rope or yarn (default: yarn with --multi-latent-attention, else rope)")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN: context extension factor")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN: attention temperature term")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN: attention temperature term")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN: the pretraining context (default 4096)")
    g.add_argument("--yarn-beta-fast", type=float, default=None, help="YaRN (default 32)")
    g.add_argument("--yarn-beta-slow", type=float, default=None, help="YaRN (default 1)")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None)
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int")
    g.add_argument("--window-size", type=_window, default=None,
                   help="sliding-window attention LEFT,RIGHT (gpt-oss: 127,0 = 128 tokens)")
    g.add_argument("--window-attn-skip-freq", type=_layer_freq, default=None,
                   help="every N-th layer full attention, or a 0/1 list per layer (1 = windowed)")
    g.add_argument("--softmax-type", choices=SOFTMAX_TYPES, default="vanilla",
                   help="learnable: a trained sink logit per head (gpt-oss); off-by-one: a zero sink logit")
    g.add_argument("--quick-geglu", action="store_true", help="gated x * sigmoid(1.702 x) activation (gpt-oss)")
    g.add_argument("--glu-linear-offset", type=float, default=0.0, help="gated activations: act(gate) * (up + offset)")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="gated activations: clamp gate <= v and up to [-v, v] (gpt-oss: 7.0)")
    g.add_argument("--enable-gpt-oss", action="store_true",
                   help="accepted: the gpt-oss flags above (or an imported gpt_oss checkpoint) build its layers")
    g.add_argument("--mtp-num-layers", type=int, default=None, help="multi-token prediction depths (DeepSeek-V3)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="the MTP loss, averaged over depths, is added times this")


def variant_config_kwargs(args: argparse.Namespace) -> dict:
    """The ``TransformerConfig`` keyword arguments of these flags."""
    yarn = {}
    if args.yarn_beta_fast is not None:
        yarn["yarn_beta_fast"] = args.yarn_beta_fast
    if args.yarn_beta_slow is not None:
        yarn["yarn_beta_slow"] = args.yarn_beta_slow
    if args.yarn_correction_range_round_to_int is not None:
        yarn["yarn_correction_range_round_to_int"] = args.yarn_correction_range_round_to_int
    return dict(
        multi_latent_attention=args.multi_latent_attention, q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim, rope_type=args.rope_type, rotary_scaling_factor=args.rotary_scaling_factor,
        mscale=args.mscale, mscale_all_dim=args.mscale_all_dim,
        yarn_original_max_position_embeddings=args.yarn_original_max_position_embeddings, **yarn,
        window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
        softmax_type=args.softmax_type, glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value, mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)


__all__ = ["add_variant_flags", "variant_config_kwargs"]
