"""``planning.calibrate.calibrate``: a measurement that contradicts itself because a neighbour's burst changed
the machine's speed mid-calibration (``BusyMachineError``) is measured once more; a second one propagates. The
rank error crosses the process boundary as itself (the suite's pool pickles it)."""
import pickle

import pytest

from megatron_core.planning.calibrate import BusyMachineError, calibrate


class _Ranks:
    """A ``run_distributed``-like callable whose first ``failures`` calls raise, then two ranks' fields."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def __call__(self, world_size, fn, *args):
        self.calls += 1
        if self.calls <= self.failures:
            raise BusyMachineError("calibration: one layer took 39.2 ms ... the machine was busy")
        return [{"peak_tflops": 0.03 + 0.01 * rank, "name": "calibrated-cpu-2ranks"} for rank in range(world_size)]


def test_a_busy_measurement_is_taken_again_once():
    ranks = _Ranks(failures=1)
    fields = calibrate(2, distributed=ranks, memory_per_device_gb=1.0)
    assert ranks.calls == 2 and fields["peak_tflops"] == pytest.approx(0.035)
    with pytest.raises(BusyMachineError):
        calibrate(2, distributed=_Ranks(failures=2), memory_per_device_gb=1.0)
    assert isinstance(pickle.loads(pickle.dumps(BusyMachineError("x"))), BusyMachineError)
