"""Every draw the state machine makes, kept small so sequences stay long under Hypothesis's entropy cap."""

from hypothesis import strategies as st

# An index into the requests live in the phase a rule needs, taken modulo their number:
# every draw names a real request, so no step is wasted on a stale handle.
picks = st.integers(min_value=0, max_value=7)

# Prompts are short: the pools are small so that slots are reused within a few steps.
MAX_PROMPT = 20


def token_unit(config) -> int:
    """Tokens per drawn prompt or chunk length (``ModelConfig.traffic_unit``)."""
    return config.traffic_unit
prompt_lengths = st.integers(min_value=1, max_value=MAX_PROMPT)

# Prefill chunk sizes: 1 token up to more than a page, so chunks straddle page boundaries.
chunk_sizes = st.integers(min_value=1, max_value=16)

# New tokens after a forked prefix.
extra_tokens = st.integers(min_value=1, max_value=6)

# The prompts of the requests a warm start admits and prefills before the first rule.
warm_prompts = st.lists(prompt_lengths, min_size=1, max_size=3)

# The running requests one decode step batches (picks, deduplicated by the machine).
decode_picks = st.lists(picks, min_size=1, max_size=3)

# A speculative step's draft tokens, and how many of them verification accepts.
draft_lengths = st.integers(1, 3)
accepted_drafts = st.integers(0, 3)
