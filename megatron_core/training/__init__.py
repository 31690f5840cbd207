"""The training loop behind pretrain_gpt.py: flags, learning-rate schedule, metrics, checkpoints."""
from __future__ import annotations

from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.errors import record


@record  # under torchrun, a rank's exception is written to the error file and reported with its rank
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parses the flags and trains. Bad input (flags, files) exits with status 2 and one paragraph naming it;
    the environment (disk full, read-only mount, a failed writer) and training failures (TrainingError)
    with status 1 (``megatron_core.utils.errors``); ``--debug`` adds the traceback."""
    import torch.distributed as dist

    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    from megatron_core.utils.errors import debug_requested, run_entry_point

    args = parse_args(argv)
    created_process_group = not dist.is_initialized()
    try:
        run_entry_point("pretrain_gpt.py", lambda: pretrain(args) and None, debug=debug_requested(argv))
    finally:
        if created_process_group and dist.is_initialized():
            dist.destroy_process_group()
    return 0
