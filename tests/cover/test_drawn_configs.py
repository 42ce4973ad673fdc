"""Drawn configs: valid, buildable, shrink to the simplest, declined ones rejected, not failed."""

import pytest
from hypothesis import HealthCheck, find, given, seed, settings
from hypothesis.errors import NoSuchExample

from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import CONFIGS, ModelConfig
from poolfuzz.pools.config_file import config_fields, config_from_fields, load_config_file, to_toml
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.faults import get_fault
from poolfuzz.pools.family import build_family
from poolfuzz.strategies import DRAWN_NAME, drawn_configs

FAST = settings(max_examples=40, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


@FAST
@given(drawn_configs())
def test_every_drawn_config_builds_and_round_trips_through_its_fields(config):
    assert config.name == DRAWN_NAME
    assert config.max_context >= config.full_tokens
    build_family(config)
    assert config_from_fields(config_fields(config), "test") == config


def test_drawn_configs_shrink_to_the_simplest():
    simplest = find(drawn_configs(), lambda c: True, settings=settings(database=None))
    assert (simplest.page_size, simplest.full_layers, simplest.swa_layers, simplest.mamba_layers) == (1, 1, 0, 0)
    assert simplest.layer_pattern == "" and simplest.full_tokens == 1 and simplest.request_rows == 1
    # the server's scheduling flags shrink to the named configs'
    assert (simplest.schedule_policy, simplest.chunked_prefill, simplest.conservativeness_pct) == ("fcfs", 16, 10)
    assert simplest.free_memory_kib == 0  # a server of named sizes, not one sized by its memory
    paged_mamba = find(drawn_configs(), lambda c: c.page_size > 4 and c.has_mamba, settings=settings(database=None))
    assert (paged_mamba.page_size, paged_mamba.mamba_layers, paged_mamba.swa_layers) == (8, 1, 0)


@pytest.mark.slow
def test_the_strategy_reaches_off_grid_shapes():
    s = settings(database=None, max_examples=2000)
    find(drawn_configs(), lambda c: c.max_context > 8192, settings=s)
    find(drawn_configs(), lambda c: "MF" in c.layers and "FM" in c.layers, settings=s)
    find(drawn_configs(), lambda c: c.has_swa and c.sliding_window == 1, settings=s)
    find(drawn_configs(), lambda c: c.has_swa and c.sliding_window > c.swa_tokens, settings=s)
    find(drawn_configs(), lambda c: c.kv_dtype == "fp8_e5m2" and c.page_size == 2, settings=s)
    # server flags nobody wrote down: a cache-aware policy with prompts prefilled whole, a full conservativeness
    find(drawn_configs(), lambda c: c.schedule_policy == "dfs-weight" and c.chunked_prefill == 0
         and c.conservativeness_pct == 100 and c.has_mamba, settings=s)
    # a recurrent server sized by its memory, SGLang deciding its slots; never a long context's (rows of 64K tokens)
    find(drawn_configs(), lambda c: c.free_memory_kib > 32 and c.has_mamba and c.has_swa, settings=s)
    with pytest.raises(NoSuchExample):
        find(drawn_configs(), lambda c: c.free_memory_kib and c.max_context > 8192, settings=settings(database=None,
                                                                                                   max_examples=300))


def test_sliding_window_and_recurrent_state_are_drawn_in_separate_layers_and_in_the_same_ones():
    """#35957's kind of model both ways: recurrent layers of its own, and an Inkling's short convolutions beside the
    KV of every attention layer (six kernel-major convs of the heads' width, no temporal state), which builds and
    whose failures name those layers."""
    s = settings(database=None, max_examples=500)
    find(drawn_configs(), lambda c: c.has_swa and c.has_mamba and not c.state_in_attention, settings=s)
    inkling = find(drawn_configs(), lambda c: c.state_in_attention and c.layer_pattern, settings=s)
    assert inkling.architecture == "inkling" and "M" not in inkling.layers and inkling.has_swa
    assert inkling.mamba_layer_ids == tuple(range(inkling.num_layers)) and inkling.temporal_shape == (0, 0, 0)
    assert len(inkling.conv_shapes) == 6 and {w for _, w in inkling.conv_shapes} == {inkling.head_num * inkling.head_dim}
    family = build_family(inkling)
    assert {c.name for c in family.components() if c.space == "mamba"} == {f"mamba.conv{i}" for i in range(6)}
    failed = run_machine(inkling, faults=["swa-ignores-mamba-backup"], max_examples=200, seed=0, shrink_limit=0)
    assert not failed.passed and "component mamba.conv" in failed.failure, failed.failure


@pytest.mark.parametrize("storage", [
    lambda c: c.attention == "mla" and c.has_mamba and c.layer_pattern,  # Kimi-Linear's interleaving, drawn
    lambda c: c.attention == "dsa" and c.page_size > 1,
    lambda c: c.attention == "msa" and "K" in c.msa_layers,
    lambda c: c.kv_scale_block > 0,
    lambda c: c.kv_quant == "cpu_fp8_e4m3",
    lambda c: c.kv_quant == "fp4_mx_block16" and c.attention == "mha",
    lambda c: c.kv_quant == "fp4_mx_block16" and c.attention == "mla",
], ids=["mla-between-mamba", "dsa-paged", "msa-k-only", "fp8-scaled", "cpu-fp8", "fp4-mha", "fp4-mla"])
@pytest.mark.slow
def test_the_strategy_draws_every_storage_kind_and_it_builds(storage):
    build_family(find(drawn_configs(), storage, settings=settings(database=None, max_examples=3000)))


STORAGE_FAULTS = {"fp4-mha-copy-drops-scales": "full.k_scale", "fp4-copy-drops-scales": "mla.scale",
                  "msa-copy-skips-k-only-index": "msa.index_k", "hybrid-mla-pd-item-of-head-width": "mla.latent"}


@pytest.mark.parametrize("fault", sorted(STORAGE_FAULTS))
def test_a_storage_kinds_fault_is_found_on_drawn_configs(fault):
    """Within a few dozen examples: the draw is steered to the kind (a filter alone saw none in 200)."""
    result = run_machine(drawn_configs(faults=[fault]), faults=[fault], max_examples=60, seed=0, shrink_limit=0)
    assert not result.passed and result.failure.startswith("StateLost"), result.failure
    assert f"component {STORAGE_FAULTS[fault]} " in result.failure


@pytest.mark.parametrize("fault", [*sorted(STORAGE_FAULTS), "dsa-index-scales-transposed",
                                   "quant-store-skips-last-token"])
def test_a_fault_that_needs_a_storage_kind_draws_it_without_filtering_much(fault):
    """Hypothesis's filter_too_much health check is on: the steered draw seldom misses the fault's kind."""
    applies = get_fault(fault).applies_to

    @settings(max_examples=100, database=None, derandomize=True)
    @given(drawn_configs(faults=[fault]))
    def check(config):
        assert applies(config)

    check()


def test_a_fault_that_accepts_plain_rows_draws_what_the_unfaulted_strategy_draws():
    """Steering is for storage faults only: every other fault filters the usual draw, so a seed keeps its examples."""
    applies = get_fault("mamba-layer-map-contiguous").applies_to

    def examples(strategy):
        seen = []

        @seed(7)
        @settings(max_examples=30, database=None, suppress_health_check=list(HealthCheck))
        @given(strategy)
        def collect(config):
            seen.append(config)

        collect()
        return seen

    assert examples(drawn_configs(faults=["mamba-layer-map-contiguous"])) == examples(drawn_configs().filter(applies))
    # and a storage fault steers: its simplest draw is its kind, where the usual simplest is plain rows
    steered = find(drawn_configs(faults=["fp4-mha-copy-drops-scales"]), lambda c: True, settings=settings(database=None))
    assert (steered.kv_quant, steered.swa_layers, steered.mamba_layers) == ("fp4_mx_block16", 0, 0)


def test_faults_restrict_the_draw_to_configs_they_apply_to():
    @FAST
    @given(drawn_configs(faults=["swa-ignores-mamba-backup"]))
    def check(config):
        assert config.has_swa and config.has_mamba

    check()


def test_layer_pattern_places_each_kind_of_layer():
    own = CONFIGS["swa-ssm"].replace(recurrent_layers="own", temporal_shape=(2, 4, 4))  # recurrent layers of its own
    c = own.replace(layer_pattern="MFMS")
    assert (c.full_layer_ids, c.swa_layer_ids, c.mamba_layer_ids) == ((1,), (3,), (0, 2))
    assert own.layers == "FSMM"
    with pytest.raises(ConfigError, match="layer_pattern"):
        own.replace(layer_pattern="FSM")
    with pytest.raises(ConfigError, match="only F"):
        CONFIGS["dense"].replace(layer_pattern="FX")


def test_a_drawn_run_passes_on_the_correct_family():
    result = run_machine(drawn_configs(), max_examples=25, seed=3)
    assert result.passed, result.failure
    assert result.config == DRAWN_NAME


def test_a_config_the_family_declines_is_rejected_not_failed():
    built: list[ModelConfig] = []

    def factory(config, **kwargs):
        built.append(config)
        return build_family(config, **kwargs)

    factory.unsupported_reason = lambda c: "paged pools only on a GPU" if c.page_size > 1 else None
    result = run_machine(drawn_configs(), max_examples=25, seed=5, family_factory=factory)
    assert result.passed, result.failure
    assert built and all(c.page_size == 1 for c in built)


def test_a_failure_on_a_drawn_config_carries_that_config():
    result = run_machine(drawn_configs(faults=["paged-free-partial-page"]), faults=["paged-free-partial-page"],
                         max_examples=200, seed=1, shrink_limit=20)
    assert not result.passed
    assert result.model_config is not None and result.model_config.page_size > 1


def test_toml_round_trip(tmp_path):
    path = tmp_path / "mine.toml"
    edited = to_toml(CONFIGS["swa-ssm"]).replace("page_size = 1", "page_size = 16")
    path.write_text(edited + to_toml(CONFIGS["dense"].replace(name="mine")))
    configs = load_config_file(str(path))
    assert configs == [CONFIGS["swa-ssm"].replace(page_size=16), CONFIGS["dense"].replace(name="mine")]


@pytest.mark.parametrize("text, match", [
    ("[[config]]\nname = 'x'\narchitecture = 'llama'\npage_size = true\n", "page_size.*integer"),
    ("[[config]]\nname = 'x'\narchitecture = 'llama'\npage_size = 3\nfull_tokens = 64\n", "multiple of page_size"),
    ("[[config]]\nname = 'x'\narchitecture = 'llama'\nbogus = 1\n", "unknown config field 'bogus'"),
    ("[[config]]\nname = 'x'\n", "lacks the field 'architecture'"),
    ("[[config]]\nname = 'x'\narchitecture = 'llama'\nmax_context = 8\n", "max_context"),
    ("[[config]]\nname = 'x'\narchitecture = 'llama'\nfull_tokens = 99999999999\n", "out of range"),
    ("[[config]]\nname = 'x'\narchitecture = 'llama'\nconv_shapes = [[0, 3]]\n", "conv_shapes"),
    ("name = 'x'\n", "one or more \\[\\[config\\]\\] tables"),
    ("[[config]\n", "not valid TOML"),
])
def test_a_bad_config_file_is_one_clear_error(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config_file(str(path))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_failure_while_building_a_drawn_engine_is_reported_not_lost_in_the_shrink(seed):
    # host-pool-for-ssm fails the engine's audit at construction, before any step: the observer must
    # hear of it, or the run's budget stops the shrink and the failure is reported as a pass.
    fault = "host-pool-for-ssm"
    result = run_machine(drawn_configs(faults=[fault]), faults=[fault], max_examples=40, seed=seed, shrink_limit=10)
    assert not result.passed and "host_pool retraction backup chosen" in result.failure
    assert result.model_config is not None and result.model_config.has_mamba
    assert result.backup_mode == "host_pool" and result.engine_steps == ()


def test_a_familys_shape_is_applied_to_every_draw_before_the_filter():
    """``drawn_configs(shape=...)`` (a factory's ``model_shaped``): every draw reshaped, then filtered."""
    seen = []

    @settings(max_examples=30, database=None, deadline=None)
    @given(drawn_configs(shape=lambda c: c.replace(head_dim=16), where=lambda c: c.head_dim == 16))
    def check(c):
        seen.append(c.head_dim)

    check()
    assert seen and set(seen) == {16}


def test_state_in_attention_keeps_the_kernel_and_follows_the_heads_width():
    own = CONFIGS["hybrid-linear"].replace(name="random", swa_layers=1, sliding_window=4, swa_tokens=32,
                                           layer_pattern="MFSM")
    inkling = own.with_state_in_attention()
    kernel = own.conv_shapes[0][1]
    assert inkling.mamba_layers == 2 and inkling.layer_pattern == "FS" and inkling.state_in_attention
    assert inkling.conv_shapes == ((kernel, own.head_num * own.head_dim),) * 6 and not inkling.has_temporal
    wider = inkling.replace(head_dim=own.head_dim + 2).with_state_in_attention()  # again: the kernel kept
    assert wider.conv_shapes == ((kernel, own.head_num * (own.head_dim + 2)),) * 6
