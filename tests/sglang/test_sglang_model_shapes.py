"""Drawn configs become servers SGLang starts (issue 35 item 2): shaped as the models SGLang serves, what SGLang (or
transformers, reading the model) refuses is declined with its words, a server's running requests are the ones its
pools settle, and a drawn run says how many examples ran on SGLang's own pools."""

from __future__ import annotations

import re

import pytest

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.errors import ConfigError


@pytest.fixture(scope="module")
def configurator(api):
    from poolfuzz.adapters.sglang.pools import configurator

    if configurator.problem():
        pytest.skip(f"sglang {api.version}: {configurator.problem()}")
    return configurator


def _origin(config):
    """Who built the pools of ``config``'s scheduler-path server (SGLang, "engine", since stop 67 deleted the adapter's
    wiring; a skip where none starts)."""
    from poolfuzz.orchestration.plugins import resolve_family

    plugin = resolve_family("sglang:scheduler")
    if reason := plugin.unsupported_reason(config):
        pytest.skip(reason)
    driver = plugin.factory(config, device="cpu", faults=(), backup_mode=None)
    try:
        return driver.pools_origin.built_by
    finally:
        driver.close()


def test_sliding_window_beside_recurrent_layers_of_their_own_is_shaped_as_an_inkling(configurator):
    from poolfuzz.adapters.sglang import model_shaped
    from poolfuzz.adapters.sglang.compat import model_missing

    own = CONFIGS["hybrid-linear"].replace(name="random", swa_layers=1, sliding_window=4, swa_tokens=32,
                                           layer_pattern="MFSM")
    with pytest.raises(ConfigError, match="no qwen3-next model stands for its layers"):  # refused
        configurator.configure(own)
    shaped = model_shaped(own)
    assert shaped.state_in_attention and shaped.architecture == "inkling" and shaped.layer_pattern == "FS"
    assert shaped.conv_shapes == ((CONFIGS["hybrid-linear"].conv_shapes[0][1], own.head_num * own.head_dim),) * 6
    if model_missing("inkling"):
        pytest.skip(model_missing("inkling"))
    assert _origin(shaped) == "engine"


def test_a_qwen3_next_is_laid_out_as_one_and_runs_on_sglangs_pools(configurator):
    from poolfuzz.adapters.sglang import model_shaped

    drawn = CONFIGS["hybrid-linear"].replace(name="random", full_layers=2, mamba_layers=1, layer_pattern="MFF",
                                             head_dim=13, conv_shapes=((7, 3),))
    with pytest.raises(ConfigError, match="no qwen3-next model stands for its layers"):
        configurator.configure(drawn)
    shaped = model_shaped(drawn)
    heads, head_dim, key_dim = drawn.temporal_shape
    assert shaped.layer_pattern == "MFMF" and shaped.mamba_layers == 2 and shaped.head_dim == 16
    assert shaped.conv_shapes == ((2 * key_dim + heads * head_dim, 3),)  # its query, key and value rows
    assert _origin(shaped) == "engine"


def test_sparse_attention_beside_recurrent_layers_is_shaped_as_a_glm5_next_without_a_rope_part(configurator):
    """A drawn DSA model with recurrent layers is a GLM-5 Next: Kimi-Linear's KDA layers and DSA layers whose latent
    rows keep no rope part (NoPE, which transformers' own GLM-5 Next config demands from 0.5.22); its decode server
    runs on SGLang's pools where the release has the model (0.5.20 on)."""
    from poolfuzz.adapters.sglang import model_shaped
    from poolfuzz.adapters.sglang.compat import model_missing
    from poolfuzz.orchestration.plugins import resolve_family

    drawn = CONFIGS["dsa-ssm-ps64"].replace(name="random", architecture="kimi-linear", qk_rope_head_dim=16)
    shaped = model_shaped(drawn)
    assert shaped.architecture == "glm5-next" and shaped.qk_rope_head_dim == 0
    if missing := model_missing("glm5-next"):
        pytest.skip(missing)
    plugin = resolve_family("sglang:decode")
    assert plugin.unsupported_reason(shaped) is None, plugin.unsupported_reason(shaped)
    driver = plugin.factory(shaped, device="cpu", faults=(), backup_mode=None)
    try:
        assert driver.pools_origin.built_by == "engine"
        assert "mla.rope" not in {comp.name for comp in driver.family.components()}
    finally:
        driver.close()


def test_a_shape_that_cannot_be_reshaped_is_left_as_drawn():
    from poolfuzz.adapters.sglang import model_shaped

    narrow = CONFIGS["hybrid-linear"].replace(name="random", temporal_shape=(1, 3, 4), conv_shapes=((12, 1),))
    assert model_shaped(narrow) == narrow  # its Qwen3-Next conv would hold 10 values: poolfuzz traces 12 at least


def test_an_odd_head_dim_is_refused_by_transformers_and_shaped_even(configurator):
    from poolfuzz.adapters.sglang import model_shaped

    odd = CONFIGS["dense"].replace(name="random", head_dim=13)
    refused = configurator.refusal(odd)
    if refused is None:
        pytest.skip("this release's transformers takes an odd rotary width")
    assert refused.startswith("transformers refuses the model config of the server") and "RoPE" in refused
    assert model_shaped(odd).head_dim == 14 and configurator.refusal(model_shaped(odd)) is None


def test_an_swa_pool_below_the_admission_floor_is_refused_at_startup(configurator):
    """SGLang's check (0.5.16 to 0.5.19 inline in ``_solve_pool_sizes``, then ``validate_swa_pool_size``) is a
    refusal wherever it raises, whatever function holds it: a release that moves it fails here, not a skip."""
    small = CONFIGS["swa"].replace(name="random", sliding_window=32, swa_tokens=32, full_tokens=64)
    refused = configurator.refusal(small)
    if refused is None:
        try:
            configurator.configure(small)
        except ConfigError as exc:
            assert "cannot hold even one request" not in str(exc), f"SGLang's startup refusal taken for a limit: {exc}"
        pytest.skip("this release has no SWA admission floor check at startup")
    assert re.match(r"SGLang refuses to start the server '.*': ValueError: SWA pool \(\d+ tokens\) cannot hold even "
                    r"one request", refused), refused


def test_a_server_runs_the_requests_its_token_slots_settle(configurator):
    two = CONFIGS["dense"].replace(name="random", full_tokens=2, max_context=4, request_rows=3)
    sized = configurator.server_sized(two)
    if sized.request_rows == 3:
        pytest.skip("this release's runner caps the running requests at the flag and the request pool only "
                    "(before 0.5.16), not at half the token slots")
    assert sized.request_rows == 1  # SGLang's resolve_max_num_reqs: at most half the token slots
    assert _origin(two) == "engine"  # the config named back with SGLang's rows: the server's pools
    with pytest.raises(ConfigError, match="SGLang settles no running requests for its server .*: it serves none"):
        configurator.server_sized(two.replace(full_tokens=1, max_context=2))


def test_a_drawn_scheduler_run_runs_mostly_on_sglangs_own_pools(configurator, tmp_path, capsys):
    """Shaped and filtered so, the examples of ``--family sglang:scheduler --config random`` run on the pools SGLang's
    configurator builds (stop 63: 6 of 35 did, the rest on the adapter's wiring; since stop 67 every example does or is
    declined; 12 of the 30 ran at stop 67, the rest mostly servers whose one token slot settles no request)."""
    from poolfuzz.cli import run_cli

    if configurator.builder() != configurator.CONFIGURATOR:
        pytest.skip("before 0.5.16 a release's runner sizes its servers by rules of its own")
    code = run_cli(["run", "--family", "sglang:scheduler", "--config", "random", "--examples", "30", "--seed", "1",
                    "--db", "none", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("who built the pools"))
    engine = re.fullmatch(r"who built the pools the examples ran on: the engine's own code ([\d,]+)", line)
    assert code in (0, 1) and engine and int(engine.group(1).replace(",", "")) >= 10, out


def test_a_drawn_extra_buffer_runs_as_the_decode_server_it_meets(configurator):
    """A decode server keeps no extra-buffer track slots (it runs without a radix cache): a drawn config that asks for
    them is shaped to the decode server a model of its layers runs, on SGLang's pools, instead of being declined."""
    from poolfuzz.adapters.sglang import decode_shaped
    from poolfuzz.orchestration.plugins import resolve_family

    plugin = resolve_family("sglang:decode")
    drawn = CONFIGS["hybrid-extra-buffer"].replace(name="random")
    assert "keeps no extra-buffer track slots" in (plugin.unsupported_reason(drawn) or "")
    shaped = decode_shaped(drawn)
    assert shaped.mamba_track_slots == 0 and shaped.mamba_layers == drawn.mamba_layers
    if reason := plugin.unsupported_reason(shaped):
        pytest.skip(reason)
    driver = plugin.factory(shaped, device="cpu", faults=(), backup_mode=None)
    try:
        assert driver.pools_origin.built_by == "engine", driver.pools_origin.detail
        assert driver.server_args["mamba_radix_cache_strategy"] == "no_buffer"
    finally:
        driver.close()
