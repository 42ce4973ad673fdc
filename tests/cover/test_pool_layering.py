"""Layering of poolfuzz.pools: it imports nothing from the layers above it and touches no CUDA at import."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import poolfuzz.pools

POOLS_DIR = Path(poolfuzz.pools.__file__).parent
MODULES = sorted(POOLS_DIR.glob("*.py"))
FORBIDDEN = ("poolfuzz.harness", "poolfuzz.strategies")


def imported_names(source: str) -> list[str]:
    """Every module (and module.name) an import statement names, relative imports resolved against poolfuzz.pools."""
    tree = ast.parse(source)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # level 1 is poolfuzz.pools, level 2 is poolfuzz
                base = ["poolfuzz", "pools"][: 3 - node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


class TestPoolsLayering:
    def test_the_package_has_modules(self):
        """The scan below covers the real package (a wrong path would pass vacuously)."""
        assert {"allocator.py", "kv.py", "protocol.py", "family.py"} <= {p.name for p in MODULES}

    @pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
    def test_no_upward_imports(self, path):
        """No module in poolfuzz/pools imports poolfuzz.harness or poolfuzz.strategies, even lazily."""
        bad = [n for n in imported_names(path.read_text())
               if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
        assert bad == []

    def test_relative_import_resolution(self):
        """The resolver maps ``from .x import y`` and ``from .. import harness`` to absolute names."""
        assert "poolfuzz.harness" in imported_names("from .. import harness\n")
        assert "poolfuzz.pools.kv" in imported_names("from .kv import KVCache\n")
        assert "poolfuzz.strategies" in imported_names("import poolfuzz.strategies as st\n")

    def test_import_touches_no_cuda(self):
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

