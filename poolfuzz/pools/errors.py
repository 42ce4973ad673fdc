"""Typed errors raised by the pools instead of SGLang's ``None`` returns and bare asserts."""

from poolfuzz.errors import ConfigError  # re-exported: the pools raise it for impossible configs

__all__ = ["ConfigError", "DoubleAlloc", "DoubleFree", "InvalidSlot", "LostKv", "MisalignedAlloc", "PoolError",
           "PoolExhausted", "UnsupportedBackup"]


class PoolError(Exception):
    """Base class of every error a pool raises on exhaustion or misuse."""


class PoolExhausted(PoolError):
    """An allocation asked for more than the pool has free; nothing was allocated."""

    def __init__(self, *, space: str, requested: int, available: int):
        self.space = space
        self.requested = requested
        self.available = available
        super().__init__(f"{space} pool exhausted: requested {requested}, available {available}")


class DoubleFree(PoolError):
    """A slot, page or row was freed while it was already free."""

    def __init__(self, *, space: str, slot: int):
        self.space = space
        self.slot = slot
        super().__init__(f"double free in {space} pool: slot {slot} is already free")


class DoubleAlloc(PoolError):
    """A host slot was handed out while its ``slot_used`` flag was already set."""

    def __init__(self, *, space: str, slot: int):
        self.space = space
        self.slot = slot
        super().__init__(f"double allocation in {space} pool: slot {slot} is already in use")


class InvalidSlot(PoolError):
    """A reserved (padding) or out-of-range slot was passed to a pool."""

    def __init__(self, *, space: str, slot: int, reason: str):
        self.space = space
        self.slot = slot
        super().__init__(f"invalid slot {slot} in {space} pool: {reason}")


class MisalignedAlloc(PoolError):
    """A paged pool was asked for a count or range that is not a whole number of pages."""


class UnsupportedBackup(PoolError):
    """The chosen retraction backup mode cannot carry this model's state."""


class LostKv(AssertionError):
    """A worker stand-in found a position a forward attends to holding KV that is not the request's own:
    an engine's scheduler-driven driver raises it, the harness reports it as StateLost (its fields say
    which request, component, layer, position, block and slot, and whose data is there)."""

    def __init__(self, *, rid: str, step: int, space: str, component: str, layer: int, position: int,
                 block: int | None, slot: int | None, expected: str, found: str, whose: str):
        self.rid, self.step, self.space, self.component, self.layer = rid, step, space, component, layer
        self.position, self.block, self.slot = position, block, slot
        self.expected, self.found, self.whose = expected, found, whose
        super().__init__(f"req {rid} step {step}: {component} layer {layer} position {position}: "
                         + (f"block {block} slot {slot} holds {whose}" if slot is not None else whose)
                         + f" (expected the {'recurrent state' if space == 'mamba' else 'KV'} of its own tokens "
                           f"through position {position})")


class RowOverflow(AssertionError):
    """An engine's scheduler-driven driver found a request's allocated KV past the end of its request row (SGLang's
    ``req_to_token``: the write lands on the next row's first positions). The harness reports it under its own
    check, ``row-bounds``."""


class ServerStuck(AssertionError):
    """An engine's scheduler-driven driver, draining: requests the idle server never finishes (the message names
    them and where each waits). The harness reports it under its own check, ``stuck``, apart from a leak; ``held``
    names what holds the space they wait for where the driver can tell (``session``: a streaming session its client
    closed), and becomes the signature's space, so each cause is its own bug."""

    def __init__(self, message: str, *, held: str | None = None):
        super().__init__(message)
        self.held = held
