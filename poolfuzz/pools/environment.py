"""Process environment variables set for a block and restored after it (what a server or a worker is started with)."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def environment_set(variables: dict[str, str]):
    """Within the block, ``os.environ`` holds ``variables``; afterwards each is as it was (unset where it was)."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
