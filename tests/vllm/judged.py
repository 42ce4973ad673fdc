"""The judged vLLM defects of the installed release (ci/known/vllm-VERSION.txt), passed over as --known does."""

from __future__ import annotations

from pathlib import Path

from tests import judged


def known_file(version: str) -> Path:
    """The installed release's judged defects, ``ci/known/vllm-VERSION.txt`` (it need not exist)."""
    return judged.known_file("vllm", version)


class PassOverJudged(judged.PassOverJudged):
    """``tests.judged.PassOverJudged`` for vLLM's list."""

    def __init__(self, version: str, config: str, *, also: tuple[str, ...] = ()):
        super().__init__("vllm", version, config, also=also)
