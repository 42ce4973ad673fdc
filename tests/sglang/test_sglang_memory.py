"""A long process (an overnight fuzz, a test session) keeps no engine past its example: SGLang's modules keep
exceptions they caught while importing, and their tracebacks must not hold an example's frames."""

from __future__ import annotations

import os
import subprocess
import sys

_FIRST_EXAMPLE_OF_A_PROCESS = """
import gc, weakref
from poolfuzz.adapters.sglang import build_family
from poolfuzz.harness.engine import Engine
from poolfuzz.pools.config import CONFIGS

def example():  # SGLang is imported, and the pools' lazy imports run, inside it, as in a fuzz's first example
    engine = Engine(config=CONFIGS["dense"], family_factory=build_family)
    rid = engine.admit(8)
    engine.prefill(rid, 8)
    family = weakref.ref(engine.families["prefill"])
    engine.close()
    return family

family = example()
gc.collect()
print("kept" if family() is not None else "collected")
"""


def test_the_first_example_of_a_process_is_collected_once_it_ends(api):
    out = subprocess.run([sys.executable, "-c", _FIRST_EXAMPLE_OF_A_PROCESS], capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "collected", out.stdout
