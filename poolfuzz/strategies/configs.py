"""Model-config strategies: the built-in configs."""

from hypothesis import strategies as st

from poolfuzz.pools.config import CONFIGS, ModelConfig


def configs(names: list[str] | None = None) -> st.SearchStrategy[ModelConfig]:
    """One of the named built-in configs (all of them by default)."""
    chosen = names or sorted(CONFIGS)
    return st.sampled_from([CONFIGS[n] for n in chosen])
