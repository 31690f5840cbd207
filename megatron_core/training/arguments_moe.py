"""Megatron-LM's mixture-of-experts flags (``--num-experts``, ``--moe-*``, ``--expert-*-parallel-size``) and
the ``MoEConfig`` they describe. MoE flags not listed here are refused by name (``arguments_megatron``)."""
from __future__ import annotations

import argparse
import ast
from typing import Optional, Union

from megatron_core.transformer.moe.config import (
    DISPATCHERS,
    DROP_POLICIES,
    LOAD_BALANCING_TYPES,
    SCORE_FUNCTIONS,
    MoEConfig,
)


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (default: dense)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="1 (experts whole on each rank) or the tp size (each expert's fc1/fc2 split over the tp "
                        "group; the default, as in Megatron-LM)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES, default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing (sigmoid scores): a per-expert selection bias updated each step")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing (DeepSeek): experts in this many groups of consecutive ids")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="groups each token may route to")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="multiply the chosen experts' weights (DeepSeek's routed_scaling_factor)")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
    g.add_argument("--moe-token-dispatcher-type", choices=[*DISPATCHERS, "flex"], default="allgather",
                   help="flex (Megatron's DeepEP/HybridEP fused all-to-all) runs our alltoall: the same tokens reach "
                        "the same experts")
    g.add_argument("--moe-flex-dispatcher-backend", choices=["deepep", "hybridep", "ncclep"], default="deepep",
                   help="accepted: the backend of flex, which runs as alltoall here")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="benchmarking only (as Megatron-LM): random router logits, so every expert gets a fair "
                        "share; gradients pass straight through")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="local experts as one batched GEMM")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None, help="default: dropless")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", choices=DROP_POLICIES, default="probs")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-layer-freq", type=_layer_freq, default=1,
                   help="every N-th layer is MoE, or a per-layer 0/1 list such as '([0]*1+[1]*3)*2'")
    g.add_argument("--moe-per-layer-logging", action="store_true", help="log each MoE layer's losses")
    g.add_argument("--moe-permute-fusion", action="store_true", help="accepted, no effect (no fused permute)")


def _literal(node: ast.AST) -> Union[int, list]:
    """Evaluates int / list literals combined with + and * (Megatron's ``--moe-layer-freq`` expressions)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _literal(node.left), _literal(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported element {ast.dump(node)}")


def _layer_freq(text: str) -> Union[int, list[int]]:
    try:
        value = _literal(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} is neither an integer nor a 0/1 list "
                                         f"expression like '([0]*1+[1]*3)*2': {error}") from error
    return value


def moe_config(args: argparse.Namespace) -> Optional[MoEConfig]:
    """The MoE settings of the flags, or None without ``--num-experts`` (raises ValueError naming values)."""
    if args.num_experts is None:
        return None
    return MoEConfig(
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff, moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate, moe_router_dtype=args.moe_router_dtype,
        moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_token_dispatcher_type="alltoall" if args.moe_token_dispatcher_type == "flex" else
        args.moe_token_dispatcher_type, moe_grouped_gemm=args.moe_grouped_gemm,
        moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_layer_freq=args.moe_layer_freq, moe_per_layer_logging=args.moe_per_layer_logging)


def validate_moe_flags(args: argparse.Namespace) -> None:
    """Checks that need no process group (ValueError naming the values and the fix); the world-size checks
    run in ``initialize_model_parallel`` and the MoE layer."""
    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    given_etp = args.expert_tensor_parallel_size
    # Megatron-LM's default: experts split over the tp group (etp = tp); without experts, 1
    etp = given_etp if given_etp is not None else (tp if args.num_experts is not None else 1)
    if args.num_experts is None and etp != 1:  # Megatron accepts it: it only shapes the (unused) expert groups
        from megatron_core.training.arguments_megatron import warn_rank_0
        warn_rank_0(f"--expert-tensor-parallel-size {etp} has no effect without --num-experts (a dense model)")
        etp = 1
    args.expert_tensor_parallel_size = etp
    if ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if etp < 1:  # any other size is Megatron-LM's: ep x etp must divide tp x cp x dp (initialize_model_parallel)
        raise ValueError(f"--expert-tensor-parallel-size must be >= 1, got {etp}")
    if args.num_experts is None:
        given = [f for f, v in (("--expert-model-parallel-size", ep != 1),
                                ("--moe-grouped-gemm", args.moe_grouped_gemm),
                                ("--expert-tensor-parallel-size", etp != 1),
                                ("--moe-expert-capacity-factor", args.moe_expert_capacity_factor is not None)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} need a mixture-of-experts model: add --num-experts")
        return
    if args.num_experts % ep != 0:
        raise ValueError(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}: "
                         "every expert-parallel rank holds the same number of experts")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ValueError(f"--num-experts with --tensor-model-parallel-size {args.tensor_model_parallel_size} needs "
                         "--sequence-parallel (as Megatron-LM): each tp rank routes its own chunk of the sequence")
    config = moe_config(args)  # topk, choices, capacity (ValueError naming them, in flag terms)
    config.is_moe_layer(1, args.num_layers)
