"""Model configs: validation names each problem, the built-in catalogue, and the shared SSM predicate."""

import pytest

from poolfuzz.pools import CONFIGS, ConfigError, ModelConfig, get_config, uses_ssm_state
from poolfuzz.pools.family import resolve_device


def make(**changes) -> ModelConfig:
    return ModelConfig(**{"name": "probe", "architecture": "llama", **changes})


class TestModelConfigValidation:
    @pytest.mark.parametrize(("changes", "problem"), [
        ({"page_size": 0}, "page_size must be >= 1, got 0"),
        ({"full_layers": 0}, "full_layers must be >= 1"),
        ({"mamba_layers": -1}, "layer counts cannot be negative"),
        ({"kv_dtype": "int4"}, "kv_dtype 'int4' is not one of bfloat16, float16, float32, fp8_e4m3"),
        ({"state_dtype": "fp8_e4m3"}, "state_dtype 'fp8_e4m3' is not one of bfloat16, float16, float32"),
        ({"page_size": 4, "full_tokens": 10}, "full_tokens (10) must be a positive multiple of page_size (4)"),
        ({"swa_layers": 1, "sliding_window": 4, "swa_tokens": 0},
         "swa_tokens (0) must be a positive multiple of page_size (1)"),
        ({"swa_layers": 1, "swa_tokens": 8}, "swa_layers > 0 needs sliding_window >= 1"),
        ({"swa_tokens": 8}, "swa_tokens / sliding_window are set but swa_layers is 0"),
        ({"sliding_window": 4}, "swa_tokens / sliding_window are set but swa_layers is 0"),
        ({"mamba_layers": 1}, "mamba_layers > 0 needs mamba_slots >= 1"),
        ({"mamba_slots": 2}, "mamba_slots is set but mamba_layers is 0"),
        ({"request_rows": 0}, "request_rows must be >= 1"),
        ({"max_context": 1}, "max_context must be >= 2"),
        ({"head_num": 1, "head_dim": 8}, "head_num*head_dim must be >= 12 (got 8)"),
        ({"mamba_layers": 1, "mamba_slots": 1, "conv_shapes": ((2, 3),)}, "conv shape (2, 3) holds fewer than 12 values"),
        ({"mamba_layers": 1, "mamba_slots": 1, "temporal_shape": (1, 2, 4)},
         "temporal shape (1, 2, 4) holds fewer than 12 values"),
        ({"schedule_policy": "random"}, "schedule_policy 'random' is not one of fcfs, lpm, dfs-weight, lof"),
        ({"chunked_prefill": -1}, "chunked_prefill (-1) must be >= 0 (0: prompts are not chunked)"),
        ({"conservativeness_pct": 0}, "conservativeness_pct (0) must be from 1 to 1000"),
        ({"free_memory_kib": -1}, "free_memory_kib (-1) must be >= 0"),
        ({"kv_dtype": "fp8_e5m2", "kv_scale_block": 4}, "kv_scale_block needs attention 'mha', kv_dtype 'fp8_e4m3'"),
    ])
    def test_impossible_config_names_the_problem(self, changes, problem):
        """Each impossible setting raises ConfigError that names the config and the problem."""
        with pytest.raises(ConfigError) as info:
            make(**changes)
        assert str(info.value).startswith("config 'probe' is impossible: ")
        assert problem in str(info.value)

    def test_every_problem_is_reported_at_once(self):
        """Several problems are joined into one message, separated by semicolons."""
        with pytest.raises(ConfigError) as info:
            make(request_rows=0, max_context=1)
        assert str(info.value) == ("config 'probe' is impossible: request_rows must be >= 1; "
                                   "max_context must be >= 2")

    def test_config_error_is_a_value_error(self):
        """ConfigError subclasses ValueError, so generic callers can catch it."""
        assert issubclass(ConfigError, ValueError)

    def test_replace_revalidates(self):
        """replace builds a new config and validates it."""
        with pytest.raises(ConfigError, match="page_size"):
            CONFIGS["dense"].replace(page_size=5)
        assert CONFIGS["dense"].replace(name="d2").name == "d2"

    def test_configs_are_frozen(self):
        """A config cannot be mutated in place."""
        with pytest.raises(AttributeError):
            CONFIGS["dense"].page_size = 2  # type: ignore[misc]


class TestDerivedFields:
    def test_layer_ids_are_full_then_swa_then_mamba(self):
        """Global layer ids run full, then sliding-window, then recurrent layers."""
        c = CONFIGS["swa-ssm"].replace(recurrent_layers="own", temporal_shape=(2, 4, 4))
        assert (c.full_layer_ids, c.swa_layer_ids, c.mamba_layer_ids, c.num_layers) == ((0,), (1,), (2, 3), 4)
        assert (c.has_swa, c.has_mamba, c.layers) == (True, True, "FSMM")

    def test_state_in_the_attention_layers_adds_no_layers(self):
        """Inkling's short convolutions (swa-ssm): every attention layer keeps its state, no temporal part."""
        c = CONFIGS["swa-ssm"]
        assert (c.full_layer_ids, c.swa_layer_ids, c.mamba_layer_ids, c.num_layers) == ((0,), (1,), (0, 1), 2)
        assert (c.layers, c.own_mamba_layers, c.has_temporal, c.mamba_layers) == ("FS", 0, False, 2)

    @pytest.mark.parametrize("changes, words", [
        ({"recurrent_layers": "both"}, "recurrent_layers 'both' is not one of own, attention"),
        ({"mamba_layers": 1}, "mamba_layers must be 2 (full_layers + swa_layers), got 1"),
        ({"recurrent_layers": "own"}, "temporal shape (0, 0, 0) holds fewer than 12 values"),
        ({"temporal_shape": (0, 4, 4)}, "temporal shape (0, 4, 4) holds fewer than 12 values"),
        ({"layer_pattern": "FSM"}, "mamba_layers=0 of their own"),
    ])
    def test_state_in_the_attention_layers_is_validated(self, changes, words):
        """The state's layers must be the attention layers; only such state may lack a temporal part."""
        with pytest.raises(ConfigError) as info:
            CONFIGS["swa-ssm"].replace(**changes)
        assert words in str(info.value)

    def test_host_size_defaults_to_twice_full_and_rounds_to_pages(self):
        """host_size is 2x full_tokens unless set, and always whole pages."""
        assert CONFIGS["dense"].host_size == 96
        assert CONFIGS["dense-ps4"].replace(host_tokens=10).host_size == 12

    def test_paged_variants(self):
        """The -ps4 variants keep the full pool's size and the window, double the SWA pool, with their own KV dtype."""
        base, paged = CONFIGS["swa"], CONFIGS["swa-ps4"]
        assert (paged.page_size, paged.full_tokens, paged.swa_tokens, paged.sliding_window) == (
            4, base.full_tokens, 2 * base.swa_tokens, base.sliding_window)
        assert {n: CONFIGS[n].kv_dtype for n in ("dense-ps4", "swa-ps4", "hybrid-linear-ps4", "swa-ssm-ps4")} == {
            "dense-ps4": "fp8_e4m3", "swa-ps4": "bfloat16", "hybrid-linear-ps4": "float32", "swa-ssm-ps4": "float16"}


class TestCatalogue:
    def test_built_in_names(self):
        """The catalogue holds fifteen families, each at page size 1 and 4, DSA in SGLang's shape (64-token pages), alone and
        beside recurrent layers, and
        an all-SWA model (page size 1 only), a speculative hybrid whose context is shorter than its pool, and two servers
        sized by their memory."""
        assert list(CONFIGS) == ["dense", "dense-ps4", "swa", "swa-ps4", "hybrid-linear", "hybrid-linear-ps4",
                                 "swa-ssm", "swa-ssm-ps4", "mla", "mla-ps4", "dsa", "dsa-ps4", "fp8-scaled",
                                 "fp8-scaled-ps4", "dense-cpu-fp8", "dense-cpu-fp8-ps4", "mla-fp4", "mla-fp4-ps4",
                                 "minimax-sparse", "minimax-sparse-ps4", "minimax-sparse-konly",
                                 "minimax-sparse-konly-ps4", "dense-fp4", "dense-fp4-ps4", "mla-ssm", "mla-ssm-ps4",
                                 "hybrid-extra-buffer", "hybrid-extra-buffer-ps4", "hybrid-spec", "hybrid-spec-ps4",
                                 "dsa-ps64", "dsa-ssm-ps64", "swa-only", "hybrid-spec-long", "swa-mem",
                                 "hybrid-linear-mem"]
        assert all(CONFIGS[n].name == n for n in CONFIGS)

    def test_get_config(self):
        """get_config returns the catalogue entry of that name."""
        assert get_config("swa-ssm") is CONFIGS["swa-ssm"]

    def test_unknown_config_lists_the_names(self):
        """An unknown name is a ConfigError that lists every built-in config."""
        with pytest.raises(ConfigError) as info:
            get_config("mixtral")
        assert str(info.value) == ("unknown config 'mixtral'; choose one of: dense, dense-ps4, swa, swa-ps4, "
                                   "hybrid-linear, hybrid-linear-ps4, swa-ssm, swa-ssm-ps4, mla, mla-ps4, dsa, "
                                   "dsa-ps4, fp8-scaled, fp8-scaled-ps4, dense-cpu-fp8, dense-cpu-fp8-ps4, mla-fp4, "
                                   "mla-fp4-ps4, minimax-sparse, minimax-sparse-ps4, minimax-sparse-konly, "
                                   "minimax-sparse-konly-ps4, dense-fp4, dense-fp4-ps4, mla-ssm, mla-ssm-ps4, "
                                   "hybrid-extra-buffer, hybrid-extra-buffer-ps4, hybrid-spec, hybrid-spec-ps4, "
                                   "dsa-ps64, dsa-ssm-ps64, swa-only, hybrid-spec-long, swa-mem, hybrid-linear-mem")


class TestUsesSsmState:
    @pytest.mark.parametrize("name", list(CONFIGS))
    def test_true_exactly_for_configs_with_recurrent_layers(self, name):
        """Every built-in config with mamba layers is an SSM architecture, and no other is."""
        assert uses_ssm_state(CONFIGS[name]) == CONFIGS[name].has_mamba

    def test_reads_the_architecture(self):
        """The predicate reads the architecture name, not the layer counts."""
        assert uses_ssm_state(make(architecture="mamba2"))
        assert not uses_ssm_state(make(architecture="gpt-oss"))


class TestResolveDevice:
    def test_cpu(self):
        """cpu resolves to the CPU device."""
        assert resolve_device("cpu").type == "cpu"

    def test_unsupported_device_type(self):
        """A device type other than cpu or cuda is a ConfigError."""
        with pytest.raises(ConfigError, match="not supported"):
            resolve_device("meta")

    def test_unknown_device_string(self):
        """A string torch cannot parse is a ConfigError naming the choices."""
        with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
            resolve_device("gpu0")

    def test_missing_cuda_device(self):
        """A CUDA index that does not exist is a ConfigError on any machine."""
        with pytest.raises(ConfigError, match="cuda:99"):
            resolve_device("cuda:99")
