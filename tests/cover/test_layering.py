"""Layers import one way (cli -> orchestration -> harness -> strategies -> pools -> errors), with no
import cycle anywhere, lazy imports included; building a machine loads no orchestration or CLI code;
private Hypothesis names live in one module; the pools touch no CUDA at import."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import poolfuzz

ROOT = Path(poolfuzz.__file__).parent
MODULES = {  # dotted name -> path, every module of the package
    ".".join(("poolfuzz", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
    for p in sorted(ROOT.rglob("*.py"))
}
# The rank of each layer: a module may import modules of its own layer or of lower ranks only.
LAYERS = {
    "poolfuzz.errors": 0,
    "poolfuzz.pools": 1,
    "poolfuzz.adapters": 2,  # plug-in families: built on the pools, loaded by name, never imported above
    "poolfuzz.strategies": 3,
    "poolfuzz.harness": 4,
    "poolfuzz.orchestration": 5,
    "poolfuzz.cli": 6,
}
# Private Hypothesis names: each is reached through poolfuzz.harness.hypothesis_compat only.
PRIVATE_HYPOTHESIS = ("_hypothesis_internal", "hypothesis.internal", "hypothesis.core", "hypothesis.control",
                      "hypothesis.reporting", "get_state_machine_test", "current_build_context")
COMPAT = "poolfuzz.harness.hypothesis_compat"


def layer_of(module: str) -> str | None:
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def imports_of(name: str, source: str) -> set[str]:
    """Every poolfuzz module an import statement anywhere in ``source`` names (function bodies and
    TYPE_CHECKING blocks included); ``from pkg import mod`` counts as importing ``pkg.mod``."""
    package = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != name:
                out.add(target)
    return out


GRAPH = {name: imports_of(name, path.read_text()) for name, path in MODULES.items()}


def test_every_module_belongs_to_a_layer():
    """A module outside every layer would escape the checks below (the root package is the bottom)."""
    assert {"poolfuzz.harness.engine", "poolfuzz.orchestration.runner", "poolfuzz.cli.run"} <= set(MODULES)
    strays = [m for m in MODULES if m != "poolfuzz" and layer_of(m) is None]
    assert strays == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down(name):
    """No module imports a layer above its own, even lazily; nothing imports a plug-in adapter."""
    layer = layer_of(name)
    rank = LAYERS.get(layer, 0)
    upward = [t for t in GRAPH[name] if layer_of(t) is not None and LAYERS[layer_of(t)] > rank]
    assert upward == []
    if layer != "poolfuzz.adapters":
        assert [t for t in GRAPH[name] if layer_of(t) == "poolfuzz.adapters"] == []


def test_no_import_cycles():
    """The import graph between modules (explicit imports, lazy ones included) is acyclic."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_graph_sees_lazy_and_relative_imports():
    """The scanner finds an import inside a function and resolves relative and package imports."""
    name = "poolfuzz.harness.engine"
    src = "def f():\n    from poolfuzz.cli import run\n    from . import checks\n    from ..pools import kv\n"
    assert imports_of(name, src) == {"poolfuzz.cli.run", "poolfuzz.harness.checks", "poolfuzz.pools.kv"}


def test_private_hypothesis_names_live_in_one_module():
    users = sorted(name for name, path in MODULES.items()
                   if name != COMPAT and any(p in path.read_text() for p in PRIVATE_HYPOTHESIS))
    assert users == []


def test_building_and_running_a_machine_loads_no_orchestration_or_cli():
    script = textwrap.dedent("""
        import sys
        from hypothesis import settings
        from hypothesis.stateful import run_state_machine_as_test
        from poolfuzz.harness.machine import machine_for

        run_state_machine_as_test(machine_for("swa-ssm"), settings=settings(max_examples=2, database=None))
        print(sorted(m for m in sys.modules if m.startswith(("poolfuzz.cli", "poolfuzz.orchestration"))))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_pools_import_touches_no_cuda():
    """Importing every pools module neither probes nor initialises CUDA."""
    script = textwrap.dedent("""
        import importlib, pkgutil
        import torch

        def refuse(*args, **kwargs):
            raise AssertionError("CUDA probed at import time")

        torch.cuda.is_available = refuse
        torch.cuda.device_count = refuse
        import poolfuzz.pools
        for info in pkgutil.iter_modules(poolfuzz.pools.__path__):
            importlib.import_module("poolfuzz.pools." + info.name)
        print("initialized", torch.cuda.is_initialized())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "initialized False"


def test_no_module_is_over_600_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}
