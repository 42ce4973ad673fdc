"""A config as the server it stands for, and the pools SGLang's own KV cache configurator builds for it (issue 35):
``adapters/sglang/pools/configurator.py`` and ``poolfuzz configs --family sglang``."""

from __future__ import annotations

import re

import pytest
import torch
from packaging.version import Version

from poolfuzz.errors import ConfigError
from poolfuzz.pools.config import CONFIGS


def _served() -> str:
    """How a family on the pools SGLang built for its server names their source: the builder (its configurator, or
    before 0.5.16 its model runner), then the server's flags."""
    from poolfuzz.adapters.sglang.pools.configurator import builder

    return builder() + " ("


@pytest.fixture(scope="module")
def configurator(api):
    from poolfuzz.adapters.sglang.pools import configurator

    if configurator.problem():
        pytest.skip(f"sglang {api.version}: {configurator.problem()}")
    return configurator


@pytest.fixture(scope="module")
def sized_by_configurator(configurator):
    """A release whose KV cache configurator sizes the pools (0.5.16 on): the tests of its sizing rules. Before it the
    model runner sizes them by the rules of its own release (a window pool of 0.5.10 is not the flag's share, a request
    pool of 0.5.9 keeps no spare row)."""
    if configurator.builder() != configurator.CONFIGURATOR:
        pytest.skip("before 0.5.16 the model runner sizes the pools by its release's own rules")


def _refuses_no_buffer_pages(api) -> bool:
    """Whether the release refuses the mamba radix cache's no_buffer strategy at pages over one (0.5.14 on; 0.5.12 and
    before accept it; 0.5.13 is not installed here)."""
    return Version(api.version) >= Version("0.5.14")


@pytest.fixture(scope="module")
def cpu_engine(configurator):
    """A release whose CPU server's machine is stood in for here (0.5.18's configurator has no CPU FP8 KV cache)."""
    if configurator.cpu_platform_problem():
        pytest.skip(f"no CPU server is stood in for on this release ({configurator.cpu_platform_problem()})")


@pytest.fixture(scope="module")
def speculative(configurator):
    """A release whose speculative server's pools build on this machine (0.5.18's ``MambaPool`` allocates its
    draft-token states on ``cuda`` whatever its device: a GPU server's pools, which no CPU builds)."""
    try:
        configurator.configure(CONFIGS["hybrid-spec"])
    except ConfigError as exc:
        pytest.skip(str(exc))


def _built_here(configurator, name: str):
    """What SGLang builds for config ``name``'s server, or a skip naming why it builds none on this release here (a
    KV dtype its launcher does not take yet, a model it does not have yet; any other refusal of the flags fails the
    test)."""
    from poolfuzz.adapters.sglang.compat import model_missing

    if missing := model_missing(CONFIGS[name].architecture):
        pytest.skip(missing)
    try:
        return configurator.configure(CONFIGS[name])
    except configurator.ServerRefused as exc:
        if "invalid choice" not in exc.reason:
            raise
        pytest.skip(str(exc))
    except ConfigError as exc:
        pytest.skip(str(exc))


def _extra_columns(page_size: int = 1) -> int:
    """The columns SGLang adds to a request row beyond the model's context (its own rule, asked of a server with that
    page size: the configurator publishes the server before it back once it has built the pools)."""
    try:
        from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
    except ImportError:  # before 0.5.16 the model runner adds them inline (``_init_pools``' extra_max_context_len)
        return 4
    import inspect

    from sglang.srt.runtime_context import get_server_args

    from poolfuzz.adapters.sglang.server_args import publish_server_args

    publish_server_args(page_size=page_size)
    # 0.5.16 and 0.5.17 are handed the ServerArgs; 0.5.18 on read the published one
    handed = [get_server_args()] if inspect.signature(get_req_to_token_extra_context_len).parameters else []
    return get_req_to_token_extra_context_len(*handed)


def test_a_dense_server_gets_the_pools_its_flags_size(configurator, sized_by_configurator):
    c = CONFIGS["dense"]
    built = configurator.configure(c)
    assert built.server.flags == {"attention_backend": "triton", "page_size": 1, "max_total_tokens": c.full_tokens,
                                  "max_running_requests": c.request_rows}
    assert type(built.token_to_kv_pool).__name__ == "MHATokenToKVPool"
    assert built.token_to_kv_pool.size == c.full_tokens and built.allocator.size == c.full_tokens
    assert len(built.token_to_kv_pool.k_buffer) == c.full_layers
    rows = built.req_to_token_pool.req_to_token
    assert tuple(rows.shape) == (c.request_rows + 1, c.max_context + _extra_columns(c.page_size))


def test_a_sliding_window_server_splits_its_tokens_by_the_flag_and_its_layers_by_the_model(configurator, sized_by_configurator):
    c = CONFIGS["swa"]
    built = configurator.configure(c)
    kv = built.token_to_kv_pool
    assert type(kv).__name__ == "SWAKVPool"
    assert (kv.full_kv_pool.size, kv.swa_kv_pool.size) == (c.full_tokens, c.swa_tokens)
    assert sorted(kv.layers_mapping) == list(range(c.full_layers + c.swa_layers))
    swa_layers = sorted(i for i, (_, is_swa) in kv.layers_mapping.items() if is_swa)
    assert swa_layers == list(c.swa_layer_ids)


def test_a_recurrent_server_caps_its_requests_by_its_mamba_slots(configurator, sized_by_configurator):
    """``--max-mamba-cache-size`` below the state slots the requests need: SGLang admits fewer requests, its own
    sizing, which the listing shows (the family sizes the slots up instead)."""
    c = CONFIGS["hybrid-linear"]
    built = configurator.configure(c)
    assert type(built.req_to_token_pool).__name__ == "HybridReqToTokenPool"
    assert built.req_to_token_pool.mamba_pool.size == c.mamba_slots
    assert built.sizes["max_running_requests"] < c.request_rows
    assert built.req_to_token_pool.req_to_token.shape[0] == built.sizes["max_running_requests"] + 1


def test_a_speculative_server_builds_one_recurrent_state_per_draft_token(configurator, speculative):
    """``--speculative-algorithm NEXTN`` (the model's MTP layers draft, run as EAGLE): the target's mamba pool keeps
    the verify's intermediate states, one per draft token for every request row (its KV pool, built to move rows,
    warms SGLang's copy kernel up over dummy locations: the one launch stood in for); the draft worker builds its own
    KV pool beside it."""
    c = CONFIGS["hybrid-spec"]
    built = configurator.configure(c)
    cache = built.req_to_token_pool.mamba_pool.mamba_cache
    rows = built.sizes["max_running_requests"] + 1
    assert cache.intermediate_ssm.shape[1:3] == (rows, c.spec_draft_tokens)
    assert all(w.shape[2] == c.spec_draft_tokens for w in cache.intermediate_conv_window)
    assert "4 draft-token states" in built.parts()["mamba pool"]
    # the draft worker's KV pool, over the target's allocator: listed, never compared with a family's pools
    assert built.draft_kv_pool is not None and built.draft_kv_pool is not built.token_to_kv_pool
    assert "not fuzzed" in built.parts()[configurator.DRAFT]


@pytest.mark.parametrize("family_name", ["sglang:scheduler", "sglang:hicache", "sglang:decode", "sglang:unified-server"])
def test_an_inkling_server_runs_on_the_conv_states_sglang_keeps_in_every_layer(configurator, family_name):
    """``swa-ssm`` stands for an Inkling: SGLang builds a sliding-window pool for its local layers and full KV for the
    rest, and a short-conv state pool over every layer (no temporal state). The config keeps its state in its
    attention layers, shaped so, and every server a run starts on it drives the pools SGLang built; the harness checks
    the six convs of each layer and names no temporal component."""
    from poolfuzz.orchestration.plugins import resolve_family

    c = CONFIGS["swa-ssm"]
    parts = _built_here(configurator, "swa-ssm").parts()
    assert parts["KV pool"].startswith("SWAKVPool") and f"sliding-window layers {list(c.swa_layer_ids)}" in parts["KV pool"]
    assert "temporal (0, 0, 0)" in parts["mamba pool"]
    # short convs over full K and V, local K and V, and the attention and MLP output streams (16 wide each here)
    assert parts["mamba pool"].count("(3, 16)") == 6
    plugin = resolve_family(family_name)
    if plugin.unsupported_reason(c):
        pytest.skip(plugin.unsupported_reason(c))
    built = plugin.factory(c, device="cpu", faults=(), backup_mode=None)
    family = built.family  # the server's pools
    assert family.pools_source.startswith(_served()), family.pools_source
    assert family.pools_origin.built_by == "engine"  # what a run counts its examples by, and an artifact records
    state = {(comp.name, comp.layer) for comp in family.components() if comp.space == "mamba"}
    assert state == {(f"mamba.conv{i}", layer) for i in range(6) for layer in (0, 1)}


@pytest.mark.parametrize("family_name", ["sglang:scheduler", "sglang:hicache", "sglang:decode", "sglang:unified-server"])
def test_a_kimi_linear_server_runs_on_the_one_kernel_major_conv_state_sglang_builds(configurator, sized_by_configurator,
                                                                                     family_name):
    """``mla-ssm`` stands for a Kimi-Linear: its KDA layers keep one short-conv state, the kernel's 3 steps by the query,
    key and value widths side by side (2 heads of 4 each: 24), and MLA KV in its full layers. Every server a run starts
    on it drives the pools SGLang's configurator built."""
    from poolfuzz.orchestration.plugins import resolve_family

    c = CONFIGS["mla-ssm"]
    parts = configurator.configure(c).parts()
    assert "conv (3, 24) torch.bfloat16; temporal (2, 4, 4) torch.float32" in parts["mamba pool"], parts["mamba pool"]
    assert parts["full kv pool"].startswith("MLATokenToKVPool")
    plugin = resolve_family(family_name)
    if plugin.unsupported_reason(c):
        pytest.skip(plugin.unsupported_reason(c))
    family = plugin.factory(c, device="cpu", faults=(), backup_mode=None).family
    assert family.pools_source.startswith(_served()), family.pools_source
    assert [tuple(t.shape[2:]) for t in family.sg_req_pool.mamba_pool.mamba_cache.conv] == [(3, 24)]


@pytest.mark.parametrize("name, words", [
    ("hybrid-linear-ps4", "no_buffer only supports page_size=1"),
    ("hybrid-spec-ps4", "no_buffer only supports page_size=1"),
])
def test_a_server_sglang_refuses_is_refused_in_its_words(api, configurator, name, words):
    if not _refuses_no_buffer_pages(api):
        pytest.skip(f"sglang {api.version} accepts no_buffer at pages over one")
    with pytest.raises(ConfigError, match=words):
        configurator.configure(CONFIGS[name])


def test_a_server_sglang_serves_at_another_page_size_is_refused_naming_it(api, configurator):
    """SGLang's argument resolution resets a page size the pools are built by (a DeepSeek DSA server on a Blackwell
    GPU gets 64-token pages; on 0.5.12 a no_buffer Qwen3-Next's radix cache gets pages of 1, which 0.5.14 on
    refuses): no server of the release has the config's pools, so the family declines it rather than fuzzing its
    own wiring of them, and says which page size SGLang serves."""
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason

    # 0.5.12's hook resets the page (0.5.9 and 0.5.10 serve it paged, 0.5.14 on refuse it; 0.5.11, 0.5.13 not run)
    resets = Version("0.5.12") <= Version(api.version) < Version("0.5.14")
    names = ["dsa", "dsa-ps4"] + (["hybrid-linear-ps4"] if resets else [])
    refused = {n: configurator.refusal(CONFIGS[n]) for n in names}
    if not any(refused.values()):
        pytest.skip(f"sglang {api.version} keeps the page size these servers name (its DSA pages are sized later, "
                    "by the configurator)")
    for name, why in refused.items():
        served = 1 if name == "hybrid-linear-ps4" else 64
        assert why and f"with --page-size {served}, not {CONFIGS[name].page_size}: no server has" in why, (name, why)
        assert unsupported_reason(CONFIGS[name]) is not None


# a build that failed on a call into SGLang: a keyword, field or name this release does not have
_DRIFT = re.compile(r": (TypeError|AttributeError|ImportError|ModuleNotFoundError|NameError): ")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_server_is_left_to_the_wiring_by_the_adapters_own_drift(configurator, name):
    """A configurator build that fails on the adapter's call into SGLang is API CHANGED (``compat/drift.py``): until
    stop 61 it left the family on its wiring, every example saying why and no run failing, and so 0.5.16, 0.5.17 and
    0.5.19 to 0.5.21 ran every config. Here: no named config's server meets such a drift on this release, and no
    reason a build gives for the wiring reads like one the guard let through (a call into SGLang that did not bind,
    raised in SGLang's frame). SGLang's refusals of the flags are not drift."""
    from poolfuzz.errors import EngineApiChanged

    try:
        configurator.configure(CONFIGS[name])
    except EngineApiChanged as exc:
        pytest.fail(exc.verdict)
    except configurator.ServerRefused:
        return
    except ConfigError as exc:
        assert not _DRIFT.search(str(exc)), str(exc)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_listed_flags_are_the_servers_own_command_line(api, configurator, name, tmp_path):
    """Every config's flags, as the listing prints them, parse with SGLang's own argument parser into those
    values (the models aside: a flag SGLang does not know, or a value it does not take, fails here)."""
    import argparse
    import shlex

    from sglang.srt.server_args import ServerArgs

    if Version(api.version) < Version("0.5.22"):
        pytest.skip("before 0.5.22 a parsed command line is resolved on this machine (its hooks run on the model and "
                    "the platform), so what it holds is the resolution's, not the flags'")
    flags = configurator.server_flags(CONFIGS[name])
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = ServerArgs.from_cli_args(parser.parse_args(["--model-path", str(tmp_path), "--device", "cpu",
                                                         *shlex.split(configurator.command_line(flags))]))
    for flag, value in flags.items():
        assert getattr(parsed, flag) == value, flag


def test_pools_other_than_the_configs_are_named_fact_by_fact(configurator):
    """The family runs on nothing but SGLang's pools, so pools that are not the config's decline it: each fact its checks
    and its scheduler's caps rest on is named with the config's value and SGLang's (0.5.9 and 0.5.10 size an SWA
    server's pools from its flags otherwise than the configurator does later, and ``swa`` then declines there)."""
    from poolfuzz.adapters.sglang.pools.family import pools_problem

    built = _built_here(configurator, "swa")
    full, window = built.token_to_kv_pool.full_kv_pool.size, built.token_to_kv_pool.swa_kv_pool.size
    c = CONFIGS["swa"].replace(full_tokens=full, swa_tokens=window)  # the release's own sizes for the flags
    assert pools_problem(c, built) is None
    other = c.replace(full_tokens=full + 8, swa_tokens=window + 4)
    assert pools_problem(other, built) == (f"full-attention token slots {full + 8} (SGLang's: {full}); "
                                           f"sliding-window token slots {window + 4} (SGLang's: {window})")
    assert pools_problem(other, built, sized=False) is None  # a unified pool's sizes are SGLang's envelope's
    hybrid = CONFIGS["hybrid-linear"]
    wide = hybrid.replace(conv_shapes=tuple((n + 2, k) for n, k in hybrid.conv_shapes))
    assert "conv state shapes" in pools_problem(wide, _built_here(configurator, "hybrid-linear"))


def test_a_sparse_server_between_recurrent_layers_is_a_glm5_next_with_a_dsa_sub_pool(api, configurator):
    """``dsa-ssm-ps64`` puts sparse (DSA) attention without a rope part (NoPE) between recurrent layers, as a GLM-5
    Next does (SGLang 0.5.20 on): its PD decode server's HybridLinearKVPool keeps a DSA sub-pool, index cache and all,
    and the decode family runs on it, the DSA index keys and the latent rows (no rope part) among its components. A
    release without the model declines the config, naming the model it lacks."""
    from poolfuzz.adapters.sglang.compat import model_missing
    from poolfuzz.adapters.sglang.scheduler.decode_server import ROLE_FLAGS
    from poolfuzz.orchestration.plugins import resolve_family

    c = CONFIGS["dsa-ssm-ps64"]
    why = resolve_family("sglang:decode").unsupported_reason(c)
    if missing := model_missing(c.architecture):
        with pytest.raises(ConfigError, match=re.escape(missing)):
            configurator.configure(c, role_flags=ROLE_FLAGS)
        return
    assert why is None, why
    kv = configurator.configure(c, role_flags=ROLE_FLAGS).token_to_kv_pool
    assert type(kv) is api.HybridLinearKVPool and type(kv.full_kv_pool) is api.DSATokenToKVPool
    assert kv.full_kv_pool.index_k_with_scale_buffer is not None
    family = resolve_family("sglang:decode").factory(c, device="cpu", faults=(), backup_mode=None).family
    assert family.pools_source.startswith(_served()) and family.pools_origin.built_by == "engine"
    names = {(comp.name, comp.layer) for comp in family.components()}
    assert {layer for name, layer in names if name == "dsa.index_k"} == set(c.full_layer_ids)
    assert {layer for name, layer in names if name == "mla.latent"} == set(c.full_layer_ids)
    assert not any(name == "mla.rope" for name, _ in names)  # NoPE: the latent row is the compressed part alone


def test_a_sparse_attention_server_on_a_blackwell_gpu_keeps_its_kv_in_the_dtype_it_names(api, configurator):
    """SGLang's DeepSeek DSA hook (which also sets the page size to 64) stores the KV as fp8_e4m3 on the GPU the
    server stands on unless the server names its dtype: the config's server names bfloat16, and gets it."""
    named = configurator.configure(CONFIGS["dsa-ps64"])
    assert named.server.flags["kv_cache_dtype"] == "bfloat16"
    kv = named.token_to_kv_pool
    assert type(kv) is api.DSATokenToKVPool and kv.dtype == torch.bfloat16 and kv.page_size == 64  # NSA before 0.5.13
    try:
        left_to_auto = configurator.configure(CONFIGS["dsa-ps64"], role_flags={"kv_cache_dtype": "auto"})
    except ConfigError as exc:  # 0.5.9's runner asserts an fp8 DSA cache's rank fills its quant blocks: no such server
        assert Version(api.version) < Version("0.5.10") and "kv_lora_rank 16 must be multiple" in str(exc), exc
    else:
        assert left_to_auto.token_to_kv_pool.dtype == torch.float8_e4m3fn


def test_a_gpu_server_is_stood_in_for_only_while_its_pools_are_built(configurator, sized_by_configurator):
    """A Blackwell server's FP4 KV cache gets its quant method (``is_float4_e2m1fn_x2`` asks SGLang's CUDA probe);
    afterwards every probe answers for this machine again."""
    _built_here(configurator, "dense-fp4")  # a release whose servers have an FP4 KV cache (0.5.16 on)
    from sglang.srt import runtime_context, server_args
    from sglang.srt.utils import common

    def answers():  # every reader's answer: the platform's (0.5.22 on) or each module's binding of the probe (before)
        platform = runtime_context.get_platform().is_cuda if hasattr(runtime_context, "get_platform") else None
        return (common.is_cuda(), platform, getattr(server_args, "is_cuda", None), common.is_cuda,
                torch.cuda.get_device_capability)

    before = answers()
    built = configurator.configure(CONFIGS["dense-fp4"])
    assert built.server.gpu is not None and built.server.gpu.name == "B200"
    assert type(built.token_to_kv_pool.quant_method).__name__ == "FP4MXBlock16KVCacheMethod"
    assert answers() == before


def test_a_cpu_server_is_built_on_sglangs_cpu_engine_on_an_amx_xeon(configurator, cpu_engine):
    """SGLang's CPU FP8 KV cache stands for its CPU server: no GPU is stood in for, the flags say ``--device cpu``,
    and the machine is SGLang's CPU engine on a Xeon with AMX, as that KV cache requires: the configurator's own CPU
    FP8 checks pass and it gives the pool SGLang's CPU FP8 quant method, so the family runs on that pool. Afterwards
    the configurator's platform and every probe answer for this machine again."""
    import sglang.srt.mem_cache.kv_cache_configurator as module
    from sglang.srt.runtime_context import get_platform

    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    c = CONFIGS["dense-cpu-fp8"]
    assert configurator.server_gpu(c) is None and configurator.server_flags(c)["device"] == "cpu"
    before = (module.current_platform, module.cpu_has_amx_support, get_platform().has_amx)
    built = configurator.configure(c)
    assert built.server.gpu is None
    assert type(built.token_to_kv_pool.quant_method).__name__ == "CPUFP8KVCacheMethod"
    assert (module.current_platform, module.cpu_has_amx_support, get_platform().has_amx) == before
    family = build_driver(c).family
    assert family.pools_source.startswith(_served() + "--device cpu "), family.pools_source


def test_a_cpu_server_on_a_machine_without_amx_is_refused_in_sglangs_words(configurator, cpu_engine, monkeypatch):
    """The same server on a Xeon without AMX: SGLang resolves its attention backend to ``torch_native`` and its
    configurator refuses the CPU FP8 KV cache."""
    from poolfuzz.adapters.sglang.compat import platform

    monkeypatch.setattr(configurator, "XEON", platform.CPU(name="Xeon (no AMX)", amx=False))
    with pytest.raises(ConfigError, match="CPU FP8 KV cache requires"):
        configurator.configure(CONFIGS["dense-cpu-fp8"].replace(name="dense-cpu-fp8-no-amx"))


def test_the_configs_listing_names_each_servers_flags_and_pools(api, configurator, capsys):
    from poolfuzz.cli import main

    assert main(["configs", "--family", "sglang:scheduler"]) == 0
    out = capsys.readouterr().out
    out = "\n" + out
    dense = out[out.index("\ndense "):out.index("\ndense-ps4 ")]
    flags = next(line for line in dense.splitlines() if "server flags:" in line)
    # the pools' flags and the scheduler's own (0.5.9 - 0.5.15 add --enable-streaming-session)
    for flag in ("--attention-backend triton", "--chunked-prefill-size 16", "--max-running-requests 5",
                 "--max-total-tokens 48", "--page-size 1", "--schedule-conservativeness 0.1", "--schedule-policy fcfs"):
        assert f" {flag}" in flags + " ", (flag, flags)
    assert "KV pool        MHATokenToKVPool (48 tokens, torch.bfloat16)" in dense
    builder = "configurator" if configurator.builder() == configurator.CONFIGURATOR else "model runner"
    if _refuses_no_buffer_pages(api):
        assert f"{builder}: config 'hybrid-linear-ps4': SGLang refuses the server" in out
    assert dense.count("family runs on them") == 1


def test_a_speculative_servers_draft_pool_is_listed_but_not_called_a_difference(api, configurator, speculative, capsys):
    """The draft worker's KV pool of a speculative server is listed (no family runs a draft model), and the family that
    runs on every other pool SGLang built is listed as running on them."""
    from poolfuzz.cli import main

    from poolfuzz.orchestration.plugins import resolve_family

    assert main(["configs", "--family", "sglang:scheduler", "--show", "hybrid-spec"]) == 0
    out = capsys.readouterr().out
    assert "draft KV pool  HybridLinearKVPool" in out and "(not fuzzed: no family runs a draft model)" in out
    assert "family differs" not in out
    declines = resolve_family("sglang:scheduler").unsupported_reason(CONFIGS["hybrid-spec"])
    assert ("family runs on them" in out) == (declines is None), declines  # 0.5.21: no spec-v2 scheduling


def test_a_configs_server_is_written_out_to_launch_on_a_gpu(api, configurator, capsys, tmp_path):
    import json

    from poolfuzz.cli import main

    assert main(["configs", "--family", "sglang:scheduler", "--show", "swa", "--server-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    model = json.loads((tmp_path / "config.json").read_text())
    # HF's window counts the current token; SGLang's GPT-OSS serves one less, the config's
    assert model["architectures"] == ["GptOssForCausalLM"] and model["sliding_window"] == CONFIGS["swa"].sliding_window + 1
    # started in the environment its pools are sized in (the eviction interval a harness context evicts at)
    launch = next(line.strip() for line in out.splitlines() if "sglang.launch_server" in line)
    assert launch.startswith(f"SGLANG_SWA_EVICTION_INTERVAL={CONFIGS['swa'].sliding_window} python -m "
                             f"sglang.launch_server --load-format dummy --skip-tokenizer-init --model-path {tmp_path} "
                             "--attention-backend triton "), launch
    for flag in ("--max-running-requests 5", "--max-total-tokens 64", "--page-size 1", "--swa-full-tokens-ratio 0.5"):
        assert f" {flag}" in launch + " ", (flag, launch)


@pytest.mark.parametrize("name", ["dense", "swa-ps4", "swa-only", "mla-ps4", "minimax-sparse-konly-ps4", "dense-fp4",
                                  "fp8-scaled", "fp8-scaled-ps4", "mla-fp4-ps4", "dsa-ps64"])
def test_the_family_runs_on_the_pools_sglangs_configurator_built_for_its_server(configurator, name):
    """Where the configurator builds the pools the config describes, the family drives those very objects: its
    request rows are as wide as SGLang makes them (the model's context and SGLang's extra columns)."""
    from poolfuzz.adapters.sglang.pools.family import build_sglang_family

    c = CONFIGS[name]
    _built_here(configurator, name)
    try:
        family = build_sglang_family(c)
    except ConfigError as exc:  # a release before the mode's pool class, or one that sizes the pools otherwise
        pytest.skip(f"the family declines it here: {exc}")
    assert family.pools_source.startswith(_served() + "--attention-backend ")
    assert family.sg_req_pool.req_to_token.shape[1] == c.max_context + _extra_columns(c.page_size)


@pytest.mark.parametrize("family_name", ["sglang:scheduler", "sglang:hicache", "sglang:decode", "sglang:unified-server"])
@pytest.mark.parametrize("name", ["hybrid-linear", "hybrid-extra-buffer", "hybrid-extra-buffer-ps4", "hybrid-spec"])
def test_a_qwen3_next_server_runs_on_the_recurrent_pools_sglangs_configurator_built(configurator, family_name, name):
    """The Qwen3-Next configs are shaped as the model SGLang builds them for (one short conv over the query, key and
    value widths; the full-attention layer last in its interval; a float32 checkpoint named by ``--dtype``), so every
    server a run starts on them drives the request, mamba and KV pools SGLang's configurator built."""
    from poolfuzz.orchestration.plugins import resolve_family

    plugin = resolve_family(family_name)
    if plugin.unsupported_reason(CONFIGS[name]):
        pytest.skip(plugin.unsupported_reason(CONFIGS[name]))
    driver = plugin.factory(CONFIGS[name], device="cpu", faults=(), backup_mode=None)
    source = driver.family.pools_source
    assert source.startswith(_served()), source
    conv = driver.family.sg_req_pool.mamba_pool.mamba_cache.conv
    assert [(tuple(t.shape[2:]), t.dtype) for t in conv] == [((16, 3), torch.bfloat16)]


def test_a_decode_server_leaves_its_mamba_cache_to_sglang(configurator):
    """A decode server is launched without ``--max-mamba-cache-size``: with its radix cache off, SGLang's configurator
    gives each running request a state slot (``_handle_max_mamba_cache``), and the family runs on what it built."""
    from poolfuzz.adapters.sglang.scheduler.decode_server import ROLE_FLAGS, SglangDecodeDriver
    from poolfuzz.orchestration.plugins import resolve_family

    c = CONFIGS["hybrid-linear"]
    if resolve_family("sglang:decode").unsupported_reason(c):
        pytest.skip(resolve_family("sglang:decode").unsupported_reason(c))
    assert "max-mamba-cache-size" not in configurator.command_line(configurator.server_flags(c) | ROLE_FLAGS)
    family = SglangDecodeDriver(c).family
    assert "--max-mamba-cache-size" not in family.pools_source and "--disaggregation-mode decode" in family.pools_source
    assert family.pools_source.startswith(_served()), family.pools_source


def test_a_decode_server_runs_on_the_request_pool_sglangs_pd_hook_sizes(configurator):
    """The scheduler path's PD decode server: SGLang's own resolution (with a model) gives the request pool its extra
    rows for requests in pre-allocation and transfer, and the family runs on that pool."""
    from poolfuzz.adapters.sglang.scheduler.decode_server import SglangDecodeDriver

    c = CONFIGS["dense"]
    family = SglangDecodeDriver(c).family  # the decode server a fuzz run builds
    assert family.pools_source.startswith(_served()), family.pools_source
    assert "--disaggregation-mode decode" in family.pools_source
    pool = family.sg_req_pool
    assert type(pool).__name__ == "DecodeReqToTokenPool" and pool.pre_alloc_size == 2 * c.request_rows


def test_a_radix_disabled_decode_server_sizes_its_window_pool_from_its_requests(configurator, sized_by_configurator):
    """Not from ``--swa-full-tokens-ratio``: SGLang's configurator sizes a radix-disabled SWA server's window pool for
    its running and pre-allocated requests' windows (here the whole 64 tokens, where the config asks for 32). The
    decode server reads that size back into its config and runs on the pools SGLang built; a family built from the
    config as given is declined, naming the window pool's two sizes."""
    from poolfuzz.adapters.sglang import build_decode_driver
    from poolfuzz.adapters.sglang.pools.family import build_sglang_family
    from poolfuzz.adapters.sglang.scheduler.decode_server import ROLE_FLAGS

    c = CONFIGS["swa"]
    built = configurator.configure(c, role_flags=ROLE_FLAGS)
    assert built.sizes["swa_max_total_num_tokens"] == 64 != c.swa_tokens
    with pytest.raises(ConfigError, match=rf"sliding-window token slots {c.swa_tokens} \(SGLang's: 64\)"):
        build_sglang_family(c, role_flags=ROLE_FLAGS)
    assert configurator.server_sized(c, role_flags=ROLE_FLAGS) == c.replace(swa_tokens=64)
    driver = build_decode_driver(c)  # the decode server a fuzz run starts (its host_pool backup's host tier too)
    assert driver.config.swa_tokens == 64 and driver.family.pools_source.startswith(_served())
    assert configurator.server_sized(CONFIGS["swa"]) == c  # a plain server's window pool is the flag's


def test_a_gpu_servers_build_leaves_this_machines_device_module_bound(configurator):
    """A PD decode server's pools, built while a GPU is stood in for, import the HiCache controller: it binds its device
    module at import, and bound to CUDA's, a later host tier in the process asked CUDA for its events. The modules
    that bind it are imported on this machine first, so a decode server with a host_pool backup starts after it."""
    import sys

    import torch

    from poolfuzz.adapters.sglang.compat.platform import DEVICE_BOUND_MODULES
    from poolfuzz.adapters.sglang.scheduler.decode_server import ROLE_FLAGS

    configurator.configure(CONFIGS["swa"], role_flags=ROLE_FLAGS)
    # a listed module this release has but that binds nothing (0.5.21's unified cache linker) is not asked
    bound = {name: sys.modules[name].device_module for name in DEVICE_BOUND_MODULES
             if name in sys.modules and hasattr(sys.modules[name], "device_module")}
    assert bound and all(module is not torch.cuda for module in bound.values()), bound


def test_the_configurator_publishes_the_callers_server_back(configurator):
    """The configurator publishes its own server (with a model) to build the pools; what reads SGLang's context next
    (a decode server resolving its retraction backup, a tree) must read its caller's server again."""
    if configurator.builder() != configurator.CONFIGURATOR:
        pytest.skip("before 0.5.16 a scheduler's arguments are one global (the next test)")
    from sglang.srt.runtime_context import get_server_args

    from poolfuzz.adapters.sglang.server_args import NO_MODEL, publish_server_args

    publish_server_args(chunked_prefill_size=24, schedule_conservativeness=0.1)
    configurator.configure(CONFIGS["swa"])
    args = get_server_args()
    assert (args.model_path, args.chunked_prefill_size, args.schedule_conservativeness) == (NO_MODEL, 24, 0.1)


def test_the_model_runners_build_puts_the_schedulers_global_arguments_back(configurator):
    """Before 0.5.16 the model runner builds the pools under the Scheduler's one global ``ServerArgs``: the server's
    own while it builds, the caller's again afterwards (a scheduler path reads its own next)."""
    if configurator.builder() == configurator.CONFIGURATOR:
        pytest.skip("from 0.5.16 the configurator publishes into the runtime context (the test above)")
    from sglang.srt.server_args import ServerArgs, get_global_server_args, set_global_server_args_for_scheduler

    from poolfuzz.adapters.sglang.server_args import NO_MODEL

    mine = ServerArgs(model_path=NO_MODEL, device="cpu", chunked_prefill_size=24)
    set_global_server_args_for_scheduler(mine)
    built = configurator.configure(CONFIGS["swa"])
    assert get_global_server_args() is mine
    assert type(built.token_to_kv_pool).__name__ == "SWAKVPool"


@pytest.mark.parametrize("family, role, request_pool", [
    ("sglang:scheduler", "--chunked-prefill-size 16", "ReqToTokenPool ("),
    ("sglang:decode", "--disaggregation-mode decode --disaggregation-transfer-backend fake", "DecodeReqToTokenPool"),
    ("sglang:hicache", "--enable-hierarchical-cache", "ReqToTokenPool ("),
])
def test_the_scheduler_path_servers_are_listed_with_every_flag_they_run_with(api, configurator, scheduling, capsys,
                                                                            family, role, request_pool):
    """``poolfuzz configs --family sglang:scheduler|decode|hicache``: per config, the flags that server runs with (its
    pools' and its own: chunked prefill, running cap, role), what SGLang's configurator builds, and the pools the
    server runs on; a config the server does not drive says why."""
    from poolfuzz.adapters.sglang.scheduler.servers import unsupported_reason
    from poolfuzz.cli import main

    if unsupported_reason(CONFIGS["dense"]):
        pytest.skip(unsupported_reason(CONFIGS["dense"]))
    assert main(["configs", "--family", family, "--show", "dense"]) == 0
    out = capsys.readouterr().out
    flags = next(line for line in out.splitlines() if "server flags:" in line)
    assert role in flags and "--max-running-requests 5" in flags and "--disable-overlap-schedule" in flags, flags
    assert request_pool in out and "MHATokenToKVPool (48 tokens" in out
    assert main(["configs", "--family", family, "--show", "hybrid-spec-ps4"]) == 0  # SGLang refuses no_buffer at ps4
    assert "family: declines" in capsys.readouterr().out
    assert main(["configs", "--family", family, "--show", "hybrid-spec"]) == 0
    out = capsys.readouterr().out
    # a speculative server: the scheduler server drives one where the real triton wheel is here (its kernels run in
    # the interpreter) on a release with the spec-v2 round's names; the decode and HiCache servers decline it
    from poolfuzz.adapters.sglang import compat
    from poolfuzz.adapters.sglang.shims import install

    if family == "sglang:scheduler" and install()["triton"] != "stand-in" and compat.runs_spec_v2_synchronously():
        assert "--speculative-algorithm NEXTN --speculative-draft-model-path dummy --speculative-eagle-topk 2" in out
        assert "family: declines" not in out
        # a model with recurrent state: its server's mamba flags, not the model's chunk (a model field, not a flag)
        assert "--mamba-track-interval 8" in out and "--mamba-chunk-size" not in out
    else:
        assert "family: declines" in out


def test_a_gpt_oss_server_serves_the_configs_window(configurator):
    """A GPT-OSS checkpoint's ``sliding_window`` counts the current token (HF's way) and SGLang's model serves one
    less (``get_attention_sliding_window_size``); the model runner asks the model before its config. The written
    checkpoint names the config's window plus one, and the configurator sizes with the config's window, the one the
    family's tree runs."""
    c = CONFIGS["swa"]
    built = configurator.configure(c)
    assert built.server.hf_config["sliding_window"] == c.sliding_window + 1
    assert built.sizes["sliding_window_size"] == c.sliding_window


@pytest.mark.parametrize("family_name", ["sglang:scheduler", "sglang:hicache", "sglang:decode", "sglang:unified-server"])
@pytest.mark.parametrize("name", ["swa-mem", "hybrid-linear-mem"])
def test_a_server_sized_by_its_memory_runs_on_the_sizes_sglang_gives_it(configurator, family_name, name):
    """Issue 35 item 2's memory branch: a server launched with no size cap but its running requests. SGLang's
    configurator decides the token slots, the window pool's share, the mamba slots and how many requests those
    hold, from the memory it finds free; every server a run starts reads those sizes back and runs on the very
    pools SGLang built, none of the caps of the config it was copied from. On 0.5.9 too (declined before stop 70):
    its runner settles the running requests inline after its pools, and they are read off its request pool."""
    from poolfuzz.orchestration.plugins import resolve_family

    plugin, c = resolve_family(family_name), CONFIGS[name]
    if plugin.unsupported_reason(c):
        pytest.skip(plugin.unsupported_reason(c))
    driver = plugin.factory(c, device="cpu", faults=(), backup_mode=None)
    family, sized = driver.family, driver.config
    assert family.pools_source.startswith(_served()), family.pools_source
    assert "--max-total-tokens" not in family.pools_source and "--max-mamba-cache-size" not in family.pools_source
    assert family.served.sizes["max_running_requests"] == sized.request_rows
    assert sized.full_tokens != c.full_tokens  # SGLang's answer to 8 KiB, not the caps of the config copied
    if c.has_mamba:
        assert family.sg_req_pool.mamba_pool.size == sized.mamba_slots != c.mamba_slots


def test_sglang_splits_a_servers_memory_its_own_way(configurator, sized_by_configurator):
    """What SGLang makes of 8 KiB, read back: the window pool takes the share SGLang resolves for the model
    (``--swa-full-tokens-ratio`` unnamed), and a recurrent server admits only the requests its state slots hold
    (``resolve_max_num_reqs``: the mamba slots over the slots a request takes), fewer than ``--max-running-requests``."""
    from types import SimpleNamespace

    from poolfuzz.adapters.sglang.compat import has_private, private
    from poolfuzz.adapters.sglang.server_args import publish_server_args

    if has_private("calculate_mamba_ratio"):
        from sglang.srt.runtime_context import get_server_args
    swa, capped = configurator.server_sized(CONFIGS["swa-mem"]), CONFIGS["swa"]
    assert 0 < swa.swa_tokens < swa.full_tokens  # SGLang's own share, not the 1:2 the capped server names
    assert swa.swa_tokens * capped.full_tokens != swa.full_tokens * capped.swa_tokens
    c = CONFIGS["hybrid-linear-mem"]
    hybrid = configurator.server_sized(c)
    flags = {k: v for k, v in configurator.server_flags(c).items() if k != "attention_backend"}
    if has_private("calculate_mamba_ratio"):
        publish_server_args(**flags)
        per_request = private("calculate_mamba_ratio")(SimpleNamespace(server_args=get_server_args()))
    else:  # before 0.5.16: the model runner's own rule, over the Scheduler's global arguments
        from sglang.srt.server_args import ServerArgs

        from poolfuzz.adapters.sglang.compat import server_flags
        from poolfuzz.adapters.sglang.server_args import NO_MODEL

        args = ServerArgs(model_path=NO_MODEL, device="cpu", **server_flags(ServerArgs, flags))
        per_request = private("runner_mamba_ratio")(SimpleNamespace(server_args=args))
    assert hybrid.request_rows == hybrid.mamba_slots // per_request < c.request_rows
    # named back, the sizes are the same server's (a config that stands for it replays it)
    assert configurator.server_sized(hybrid) == hybrid


@pytest.mark.parametrize("config, words", [
    # too little memory for the state a request needs: SGLang refuses to start
    # (0.5.12 and before size it no requests without a word, which its TP worker then asserts against)
    (CONFIGS["hybrid-linear"].replace(free_memory_kib=2),
     "state cache is too small to serve any requests|request_rows must be >= 1|settles no running requests"),
    # layers no Qwen3-Next has: a sliding window, or two full-attention layers among three
    (CONFIGS["hybrid-linear"].replace(swa_layers=1, sliding_window=4, swa_tokens=16, layer_pattern="",
                                      free_memory_kib=16), "a Qwen3-Next has no sliding-window layers"),
    (CONFIGS["hybrid-linear"].replace(full_layers=2, mamba_layers=1, layer_pattern="", free_memory_kib=16),
     "a Qwen3-Next keeps one full-attention layer in every 1: 2 among 3 layers"),
], ids=["too-little-memory", "no-window-pool", "interval"])
def test_a_server_sized_by_its_memory_that_sglang_cannot_size_is_refused_with_the_reason(configurator, config, words):
    with pytest.raises(ConfigError, match=words):
        configurator.server_sized(config)


def test_a_server_sized_by_its_memory_is_refused_where_no_configurator_sizes_it(configurator, monkeypatch):
    """A release (or machine) whose configurator does not build: the adapter has no sizes of its own to stand in
    for SGLang's answer, so the config is refused, saying how to run it with named sizes."""
    monkeypatch.setattr(configurator, "problem", lambda: "this release has no KV cache configurator")
    monkeypatch.setattr(configurator, "_SIZED", {})
    monkeypatch.setattr(configurator, "_RESOLVED", {})  # what this test's refusing release built: nothing
    with pytest.raises(ConfigError, match="no KV cache configurator.*name the sizes: free_memory_kib=0"):
        configurator.server_sized(CONFIGS["swa-mem"])
    assert configurator.server_sized(CONFIGS["swa"]) == CONFIGS["swa"]  # a server of named sizes needs none
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    # the server is declined with that reason
    with pytest.raises(ConfigError, match="name the sizes: free_memory_kib=0"):
        build_driver(CONFIGS["swa-mem"])


def test_a_servers_resolution_leaves_the_process_environment_as_it_was(configurator):
    """SGLang's argument hooks set environment variables for the server they resolve (0.5.23's DSA hook a prefill
    threshold; 0.5.18's Inkling hook the unified radix tree, after which the next all-SWA server's registry built a
    unified tree): none reaches the next server the process builds."""
    import os

    for name in ("dense", "swa", "swa-ssm", "dsa", "dsa-ps64"):
        before = dict(os.environ)
        try:
            configurator.configure(CONFIGS[name])
        except ConfigError:
            pass  # refused or not built here: its resolution ran all the same
        assert dict(os.environ) == before, name


def test_a_scheduler_server_runs_with_what_its_argument_hooks_set(configurator, scheduling):
    """The other side: the server whose flags a hook resolves runs with what the hook set (DeepSeek DSA's hook its
    dense-prefill threshold, 0.5.15 on; 0.5.18's Inkling hook the unified radix tree), while it builds and at every
    step, as its process would; the process outside it keeps its own environment. Before, a scheduler-path server
    published its flags without SGLang's resolution and ran without them."""
    import os

    from poolfuzz.adapters.sglang.scheduler.servers import build_driver

    variable = "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"
    c = CONFIGS["dsa-ps64"]
    hooks = configurator.hooks_environment(c)
    if variable not in hooks:
        pytest.skip(f"this release's DSA hook sets no {variable}")
    before = os.environ.get(variable)
    driver = build_driver(c)
    # the environment each of its steps runs under (scheduling.py: ``cpu_server(self.environment)``)
    assert driver.environment[variable] == hooks[variable] and os.environ.get(variable) == before


def test_a_flag_value_the_releases_launcher_does_not_take_is_refused_in_its_words(api, configurator):
    """Before 0.5.17 SGLang's own launch parser has no ``--kv-cache-dtype mxfp8``: such a server never starts, so it
    is refused with the parser's words rather than fuzzed on the adapter's wiring. The FP4 KV cache it has is named
    as its launcher names it (``fp4_e2m1``, which 0.5.17 renamed ``fp4_mx_block16``), and its runner builds it."""
    from poolfuzz.adapters.sglang.compat import parser_refusal

    fp4 = configurator.server_flags(CONFIGS["dense-fp4"])["kv_cache_dtype"]
    mxfp8 = parser_refusal(configurator.server_flags(CONFIGS["fp8-scaled"]))
    if Version(api.version) >= Version("0.5.18"):
        assert fp4 == "fp4_mx_block16" and mxfp8 is None
    if fp4 == "fp4_mx_block16":  # its parser takes the new name, and mxfp8 with it (0.5.17 on)
        assert mxfp8 is None
        return
    assert fp4 == "fp4_e2m1" and "invalid choice: 'mxfp8'" in mxfp8
    with pytest.raises(configurator.ServerRefused, match="invalid choice: 'mxfp8'"):
        configurator.configure(CONFIGS["fp8-scaled"])
    built = configurator.configure(CONFIGS["dense-fp4"])
    assert type(built.token_to_kv_pool).__name__ == "MHATokenToKVPoolFP4" and "--kv-cache-dtype fp4_e2m1" in (
        built.server.command_line())


def test_a_refusal_is_named_past_the_line_that_only_introduces_it(configurator):
    """transformers' validators (0.5.23's, refusing a GPT-OSS of odd head width) raise a first line that only
    introduces the reason; the refusal names both."""
    exc = ValueError("Class validation error for validator 'validate_rope':\n    ValueError: RoPE requires an even "
                     "rotary dimension, but got `head_dim`=7\n  more")
    assert configurator._first_line(exc) == ("Class validation error for validator 'validate_rope': ValueError: RoPE "
                                             "requires an even rotary dimension, but got `head_dim`=7")
    assert configurator._first_line(ValueError("one line\nsecond")) == "one line"


def test_a_build_that_imports_sglang_under_a_bound_stand_in_is_refused(configurator, monkeypatch):
    """Before 0.5.22 the GPU is stated through the bindings of SGLang's probes, which a module imported meanwhile
    may have read at import for good: the stand-in refuses such a build (the module is to be imported first), and
    every binding answers for this machine again."""
    import sys
    import types

    from sglang.srt.utils import common

    from poolfuzz.adapters.sglang.compat import platform
    from poolfuzz.adapters.sglang.pools.runner_calls import sglang_quiet

    if configurator.has_private("override_platform"):
        pytest.skip("SGLang states the platform itself (override_platform) from 0.5.19")
    monkeypatch.delitem(sys.modules, "sglang.poolfuzz_probe", raising=False)
    with pytest.raises(RuntimeError, match=r"first imported while a GPU was stood in for \(sglang.poolfuzz_probe\)"):
        with sglang_quiet(), platform._stated_by_bindings(platform.B200.facts()):  # as a build runs it
            assert common.is_cuda() and common.get_device_sm() == 100
            sys.modules["sglang.poolfuzz_probe"] = types.ModuleType("sglang.poolfuzz_probe")
    assert common.get_device_sm() != 100 and common.is_cuda() == torch.cuda.is_available()
