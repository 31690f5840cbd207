"""utils.compile_guard: ``import megatron_core`` no longer imports ``torch._dynamo`` (2 s of every process
that never runs a step: ``--help``, the tools, a run refused for a bad flag), and the functions that must run
eagerly inside ``torch.compile`` still do. Both checks run in a fresh interpreter (this one may have imported
dynamo already)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_importing_the_framework_and_its_entry_points_leaves_dynamo_unimported():
    code = ("import sys, megatron_core, megatron_core.training, megatron_core.transformer, megatron_core.fp8, "
            "megatron_core.context_parallel, megatron_core.planning.planner\n"
            "print('torch._dynamo' in sys.modules)")
    assert _python(code) == "False"


def test_deferred_functions_run_eagerly_inside_torch_compile():
    code = """
import sys, torch
from megatron_core.utils.compile_guard import eager_when_compiled
from megatron_core.context_parallel import sinks
from megatron_core.fp8 import linear, param_gather
seen = []

@eager_when_compiled
def doubled(x):
    seen.append(("doubled", torch.compiler.is_compiling()))
    return x * 2

@eager_when_compiled
def shifted(x):
    seen.append(("shifted", torch.compiler.is_compiling()))
    return x + int(x.sum().item() > -1e9)  # a host sync: traced, it would break the graph here

assert "torch._dynamo" not in sys.modules
x = torch.arange(4.0)
compiled = torch.compile(lambda t: shifted(doubled(torch.sin(t))) * 3, backend="eager")
for _ in range(2):  # the first call is traced: nothing made before it
    assert torch.allclose(compiled(x), (torch.sin(x) * 2 + 1) * 3)
assert seen == [("doubled", False), ("shifted", False)] * 2, seen
assert torch.equal(shifted(doubled(x)), x * 2 + 1)
for f in (sinks.block_attention, linear._apply_eager, param_gather.gathered_weight, param_gather.gathered_experts):
    assert f.__wrapped__.__module__.startswith("megatron_core"), f  # deferred, not the plain decorator
print("ok")
"""
    assert _python(code) == "ok"
