"""Hypothesis strategies for poolfuzz: every draw the state machine makes, and the configs."""

from poolfuzz.strategies.configs import DRAWN_NAME, configs, drawn_configs
from poolfuzz.strategies.ops import (
    accepted_drafts,
    chunk_sizes,
    decode_picks,
    draft_lengths,
    extra_tokens,
    picks,
    prompt_lengths,
    token_unit,
    warm_prompts,
)

__all__ = ["DRAWN_NAME", "accepted_drafts", "chunk_sizes", "configs", "drawn_configs", "decode_picks", "draft_lengths", "extra_tokens", "picks",
           "prompt_lengths", "token_unit", "warm_prompts"]
