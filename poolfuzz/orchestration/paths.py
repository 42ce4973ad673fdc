"""Folders a run will write into, checked before any fuzzing: bad ones are usage errors (exit 2)."""

from __future__ import annotations

import os
import tempfile

from poolfuzz.errors import UsageError


def check_writable_dir(path: str, flag: str) -> None:
    """``path`` is, or can become, a folder this process can create files in; else a UsageError.

    Nothing is left behind: the folder is not created, and the probe file (in the nearest folder
    that exists) is removed. A real probe, not ``os.access``: root passes every access check, yet
    cannot create files in /proc or on a read-only mount.
    """
    target = os.path.abspath(path)
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == target:
            raise UsageError(f"{flag} {path!r} is a file; pass a directory")
        raise UsageError(f"{flag} {path!r} is under the file {os.path.relpath(existing)!r}, where no folder can be "
                         "created; pass a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".poolfuzz-probe-", dir=existing)
    except OSError as exc:
        raise UsageError(f"{flag} {path!r}: cannot create files in {existing!r} ({exc.strerror or exc}); pass a "
                         "directory you can write to") from None
    os.close(fd)
    os.unlink(probe)
