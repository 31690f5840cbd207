"""Test-only entry point for torchrun: ``paced_pretrain.py SECONDS <pretrain_gpt.py flags>`` runs pretrain_gpt.py
with every training step lasting at least SECONDS (a sleep after the step), so that a loopback elastic test
has time to start a node while the job is still training. Nothing else changes: the numbers are the same."""
import sys
import time

import megatron_core.training.loop as loop
from megatron_core.training import main

PACE = float(sys.argv.pop(1))
_step = loop.train_step


def paced_train_step(run, batches):
    begin = time.monotonic()
    result = _step(run, batches)
    time.sleep(max(0.0, PACE - (time.monotonic() - begin)))
    return result


loop.train_step = paced_train_step

if __name__ == "__main__":
    sys.exit(main())
