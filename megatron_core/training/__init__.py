"""The training loop behind pretrain_gpt.py: flags, learning-rate schedule, metrics, checkpoints."""
from __future__ import annotations

from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.errors import record


@record  # under torchrun, a rank's exception is written to the error file and reported with its rank
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parses the flags and trains. Configuration and data errors exit with status 2 and a message naming
    them; errors during training (TrainingError) with status 1."""
    import torch.distributed as dist

    from megatron_core.training.arguments import exit_with_config_error, parse_args
    from megatron_core.training.loop import TrainingError, pretrain

    args = parse_args(argv)
    created_process_group = not dist.is_initialized()
    try:
        pretrain(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as error:
        exit_with_config_error(error)
    except TrainingError as error:
        exit_with_config_error(error, status=1)
    finally:
        if created_process_group and dist.is_initialized():
            dist.destroy_process_group()
    return 0
