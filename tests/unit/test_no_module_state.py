"""No hidden state: no module of megatron_core/ or kernels/ keeps mutable state at module level (dicts, lists,
sets, counters, mode switches); layout, RNG tracker and kernel backend travel in objects passed along."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "count", "deque",
                 "WeakKeyDictionary", "WeakValueDictionary", "local"}


def _module_level_state(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names == ["__all__"]:
                continue
            value = node.value
            call = value.func.attr if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) else (
                value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None)
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                    call in MUTABLE_CALLS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {names}")
    found += [f"{path.relative_to(ROOT)}:{n.lineno} global {n.names}" for n in ast.walk(tree)
              if isinstance(n, ast.Global)]
    return found


@pytest.mark.parametrize("package", ["megatron_core", "kernels"])
def test_no_module_level_mutable_state(package):
    found = [entry for path in sorted((ROOT / package).rglob("*.py")) for entry in _module_level_state(path)]
    assert not found, "module-level mutable state:\n" + "\n".join(found)
