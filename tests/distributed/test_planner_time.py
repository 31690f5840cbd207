"""The planner's step time, calibrated on this machine (``--calibrate``: GEMM curve, layer overhead,
element-wise rate, gloo all-reduce), against real training steps at 12 layouts covering every axis: dp with
none / selective / full recompute, tp (with and without SP), pp (1F1B, interleaved), cp, ZeRO 1-3 and MoE ep;
each within 20%. Fresh ranks of their own: the suite's shared ranks carry the state of every earlier test."""
import json

from megatron_core.planning.calibrate import calibrate
from megatron_core.planning.hardware import Hardware, hardware_from_profile, save_profile
from megatron_core.planning.time_validation import LAYOUTS, validate
from megatron_core.testing import PoolCache


def test_predicted_step_time_within_20_percent_on_this_machine(tmp_path):
    with PoolCache() as pools:
        def distributed(world_size, fn, *args, **kwargs):
            return pools.get(world_size).run(fn, *args, **kwargs)

        profile = calibrate(2, distributed=distributed)
        rows = validate(distributed, profile, rounds=2)
    path = tmp_path / "cpu.json"
    save_profile(Hardware(num_devices=2, **profile), str(path))
    assert hardware_from_profile(str(path), num_devices=2).peak_tflops == profile["peak_tflops"]
    assert json.loads(path.read_text())["name"] == "calibrated-cpu-2ranks"
    assert len(rows) == len(LAYOUTS) >= 8
    report = "\n".join(f"{name}: predicted {1e3 * p:.1f} ms, measured {1e3 * m:.1f} ms ({p / m:.2f})"
                       for name, p, m in rows)
    assert all(abs(p / m - 1) <= 0.20 for _, p, m in rows), report
