"""The training loop behind pretrain_gpt.py: flags, learning-rate schedule, metrics, checkpoints."""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parses the flags and trains; configuration errors exit with status 2 and a message naming them."""
    import torch.distributed as dist

    from megatron_core.training.arguments import exit_with_config_error, parse_args
    from megatron_core.training.loop import pretrain

    args = parse_args(argv)
    try:
        pretrain(args)
    except ValueError as error:
        exit_with_config_error(error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
