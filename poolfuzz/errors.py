"""Errors every layer shares: bad input the user fixes, reported as one line with exit status 2."""


class ConfigError(ValueError):
    """A model config, device, family or fault selection is impossible; the message names the fix."""


class UsageError(Exception):
    """Bad command-line input or an unusable file: printed as one line, exit status 2, nothing written."""
