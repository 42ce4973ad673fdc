"""Errors every layer shares: bad input the user fixes, reported as one line with exit status 2."""


class ConfigError(ValueError):
    """A model config, device, family or fault selection is impossible; the message names the fix."""


class UsageError(Exception):
    """Bad command-line input or an unusable file: printed as one line, exit status 2, nothing written."""


class EngineApiChanged(Exception):
    """An engine release no longer has, or has reshaped, something an adapter reads from it.

    Never a finding: the run cannot test that release until the adapter is updated, so it says
    "API CHANGED", writes no artifact and exits 2. Raised only by the per-engine compatibility
    modules (``adapters/vllm/compat.py``, ``adapters/sglang/compat/``), each read checking the shape it expects."""

    def __init__(self, *, engine: str, release: str, attribute: str, expected: str, found: str):
        self.engine, self.release, self.attribute = engine, release, attribute
        self.expected, self.found = expected, found
        super().__init__(f"{engine} {release}: {attribute}: expected {expected}, found {found}; "
                         f"the {engine} adapter needs updating for this release (see `poolfuzz doctor --family "
                         f"{engine}`)")

    @property
    def verdict(self) -> str:
        return f"API CHANGED: {self}"


def api_change_in(exc: BaseException | None) -> EngineApiChanged | None:
    """The EngineApiChanged that ``exc`` is, or that caused it (an engine call may wrap it), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, EngineApiChanged):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def reraise_api_change(exc: BaseException) -> None:
    """Raise the EngineApiChanged inside ``exc``, if any: code that treats any exception as a finding of
    the pools (a replay, a search) calls this first, so that an engine change is never one."""
    change = api_change_in(exc)
    if change is not None:
        raise change from None
