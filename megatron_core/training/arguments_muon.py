"""Megatron-LM's Muon flags (``--optimizer muon`` / ``dist_muon`` and ``--muon-*``), defaults as Megatron-LM's
parser. ``dist_muon`` (Megatron's layer-wise distributed Muon) runs Muon with the optimizer states sharded over
dp (ZeRO-1 unless a stage is given): the same update, computed as ``megatron_core.optimizer.muon`` describes."""
from __future__ import annotations

import argparse

from megatron_core.optimizer.muon import COEFFICIENTS, MATMUL_PRECISIONS, SCALE_MODES, TP_MODES


def add_muon_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("muon optimizer (--optimizer muon)")
    g.add_argument("--muon-momentum", type=float, default=0.9, help="momentum EMA coefficient of the matrices")
    g.add_argument("--muon-nesterov", action="store_true", help="Nesterov momentum")
    g.add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false",
                   help="orthogonalize linear_qkv.weight whole (default: its q, k and v rows apart)")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations")
    g.add_argument("--muon-coefficient-type", choices=tuple(COEFFICIENTS), default="quintic",
                   help="the Newton-Schulz coefficient set")
    g.add_argument("--muon-scale-mode", choices=SCALE_MODES, default="spectral", help="the update's shape scale")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0, help="a further factor on the update")
    g.add_argument("--muon-fp32-matmul-prec", choices=MATMUL_PRECISIONS, default="medium",
                   help="low/medium: the Newton-Schulz GEMMs in bf16; high: in fp32")
    g.add_argument("--muon-tp-mode", choices=TP_MODES, default="duplicated",
                   help="a tp-split matrix: gathered whole (duplicated), Gram matrices all-reduced (distributed), "
                        "or each part alone (blockwise)")
    g.add_argument("--muon-scalar-optimizer", choices=("adam",), default="adam",
                   help="the optimizer of embeddings, output layer, norms and biases (adam; lion is not built)")
    g.add_argument("--muon-use-syrk", action="store_true",
                   help="accepted, no effect: Megatron's Triton SYRK kernel computes the same Gram matrices")


def resolve_muon_flags(args: argparse.Namespace) -> None:
    """``--optimizer dist_muon``: Muon with the states sharded over dp (ZeRO-1 unless a stage is set)."""
    if args.optimizer == "dist_muon":
        args.optimizer = "muon"
        args.use_distributed_optimizer = True


def muon_config_kwargs(args: argparse.Namespace) -> dict:
    """The ``OptimizerConfig`` keywords of the ``--muon-*`` flags."""
    return dict(muon_momentum=args.muon_momentum, muon_use_nesterov=args.muon_nesterov,
                muon_split_qkv=args.muon_split_qkv, muon_num_ns_steps=args.muon_num_ns_steps,
                muon_coefficient_type=args.muon_coefficient_type, muon_scale_mode=args.muon_scale_mode,
                muon_extra_scale_factor=args.muon_extra_scale_factor,
                muon_fp32_matmul_prec=args.muon_fp32_matmul_prec, muon_tp_mode=args.muon_tp_mode)


__all__ = ["add_muon_flags", "muon_config_kwargs", "resolve_muon_flags"]
