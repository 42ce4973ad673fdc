"""Model-config strategies: the built-in configs, or random valid ones for pool-level tests."""

from hypothesis import strategies as st

from poolfuzz.pools.config import CONFIGS, ModelConfig


def configs(names: list[str] | None = None) -> st.SearchStrategy[ModelConfig]:
    """One of the named built-in configs (all of them by default)."""
    chosen = names or sorted(CONFIGS)
    return st.sampled_from([CONFIGS[n] for n in chosen])


@st.composite
def random_configs(draw) -> ModelConfig:
    """A small valid config with any layer mix, page size and sizes."""
    ps = draw(st.sampled_from([1, 2, 4]))
    swa = draw(st.integers(0, 2))
    mamba = draw(st.integers(0, 2))
    arch = "inkling" if mamba else ("gpt-oss" if swa else "llama")
    pages = draw(st.integers(4, 16))
    return ModelConfig(
        name="random", architecture=arch, page_size=ps, full_layers=draw(st.integers(1, 2)), swa_layers=swa,
        mamba_layers=mamba, sliding_window=draw(st.integers(1, 3 * ps)) if swa else 0,
        full_tokens=pages * ps * 2, swa_tokens=pages * ps if swa else 0, request_rows=draw(st.integers(1, 5)),
        max_context=pages * ps * 2, mamba_slots=draw(st.integers(1, 5)) if mamba else 0,
        kv_dtype=draw(st.sampled_from(["bfloat16", "float16", "float32", "fp8_e4m3"])),
    )
