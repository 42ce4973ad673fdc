"""Hypothesis strategies for poolfuzz: configs, prompt lengths, chunk sizes and victim picks."""

from poolfuzz.strategies.ops import chunk_sizes, extra_tokens, picks, prompt_lengths
from poolfuzz.strategies.configs import configs

__all__ = ["chunk_sizes", "configs", "extra_tokens", "picks", "prompt_lengths"]
