"""Load every poolfuzz module once, so a seed draws the same examples whatever ran before it.

Hypothesis mixes literals from the local modules in ``sys.modules`` into what it generates, and
rescans whenever a module is added. poolfuzz imports most of its modules lazily, so without this a
seeded run in a test process that happened to import, say, the SGLang adapter first would draw
other examples than the same seed in a fresh ``poolfuzz run`` (the fresh-clone CI saw it: two
seeded catalogue cells passed alone and failed after other tests). Loading all of them first makes
the pool of constants a function of the poolfuzz version only.
"""

import functools
import importlib
import pkgutil

import poolfuzz


@functools.cache
def load_every_module() -> None:
    """Import each poolfuzz module (the CLI's ``__main__`` aside); later calls do nothing."""
    for info in pkgutil.walk_packages(poolfuzz.__path__, "poolfuzz."):
        if not info.name.endswith(".__main__"):
            importlib.import_module(info.name)
