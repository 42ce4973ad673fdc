"""Hypothesis strategies for poolfuzz: every draw the state machine makes, and the configs."""

from poolfuzz.strategies.configs import configs
from poolfuzz.strategies.ops import (
    accepted_drafts,
    chunk_sizes,
    decode_picks,
    draft_lengths,
    extra_tokens,
    picks,
    prompt_lengths,
    warm_prompts,
)

__all__ = ["accepted_drafts", "chunk_sizes", "configs", "decode_picks", "draft_lengths", "extra_tokens", "picks",
           "prompt_lengths", "warm_prompts"]
