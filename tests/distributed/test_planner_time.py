"""The planner's step time, calibrated on this machine (``--calibrate``: GEMM curve, layer overhead,
element-wise rate, gloo all-reduce), against real training steps at 11 layouts covering every axis: dp with
and without full recompute, tp (with and without SP, and SP with --tp-comm-overlap), pp (1F1B, interleaved),
cp, ZeRO 1 and 3, MoE ep; each
within 20%. Fresh ranks of their own (the suite's shared ranks carry the state of every earlier test). This
2-core machine's speed drifts with its neighbours: a layout outside 20% is measured again (three times at
most, each after a 5 s pause and a fresh calibration), so that only a model error that persists fails the test
(a fresh-clone CI run on a Zen 4 EPYC read every layout 15-38% slow in its first pass and `tp 2 SP overlap`
0.78 in both retries, where the same code alone read 0.91-0.94). In bf16 where this CPU has
bf16 instructions, else in fp32 (``fastest_cpu_dtype``)."""
import json
import time

from megatron_core.planning.calibrate import calibrate, fastest_cpu_dtype
from megatron_core.planning.hardware import Hardware, hardware_from_profile, save_profile
from megatron_core.planning.time_validation import LAYOUTS, validate
from megatron_core.testing import PoolCache


def _outside(rows):
    return [name for name, p, m in rows if abs(p / m - 1) > 0.20]


def test_predicted_step_time_within_20_percent_on_this_machine(tmp_path):
    with PoolCache() as pools:
        def distributed(world_size, fn, *args, **kwargs):
            return pools.get(world_size).run(fn, *args, **kwargs)

        dtype = fastest_cpu_dtype()  # fp32 on a CPU whose bf16 GEMMs are emulated (~20x slower)
        profile = calibrate(2, distributed=distributed, dtype_name=dtype)
        rows = validate(distributed, profile, rounds=1, dtype_name=dtype)
        attempts = [rows]
        for _ in range(3):
            if not _outside(attempts[-1]):
                break
            time.sleep(5)  # let a neighbour's burst pass
            profile = calibrate(2, distributed=distributed, dtype_name=dtype)
            attempts.append(validate(distributed, profile, names=_outside(attempts[-1]), rounds=3, dtype_name=dtype))
    path = tmp_path / "cpu.json"
    save_profile(Hardware(num_devices=2, **profile), str(path))
    assert hardware_from_profile(str(path), num_devices=2).peak_tflops == profile["peak_tflops"]
    assert json.loads(path.read_text())["name"] == "calibrated-cpu-2ranks"
    assert len(rows) == len(LAYOUTS) >= 8
    report = "\n\n".join("\n".join(f"{name}: predicted {1e3 * p:.1f} ms, measured {1e3 * m:.1f} ms ({p / m:.2f})"
                                   for name, p, m in attempt) for attempt in attempts)
    assert not _outside(attempts[-1]), report
