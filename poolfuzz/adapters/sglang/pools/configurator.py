"""A config as the server it stands for (server flags and a model's ``config.json``), and the pools SGLang's own KV
cache configurator builds for that server on this machine.

What runs is SGLang's: ``ServerArgs`` with the flags and the model directory (its own validation), ``publish`` as a
scheduler process publishes, its parallel groups built by ``bootstrap._init_parallel_groups`` on one gloo rank, its
``ModelConfig`` read from the directory, the model runner's own leaves for the configurator's inputs
(``resolve_layer_indices``, ``configure_kv_cache_dtype``, ``resolve_sliding_window_size``), and
``KVCacheConfigurator.configure``, which sizes the pools from the memory it finds and the flags' caps
(``--max-total-tokens``, ``--max-running-requests``, ``--swa-full-tokens-ratio``, ``--max-mamba-cache-size``), then
builds the request pool, the KV pool and the allocator.

Stood in for: the model, which a configurator reads only for its quantisation and layer hooks: an object with no
weights and none of those hooks (so SGLang takes its defaults from the model config); the free GPU memory the
configurator's budget starts from (``get_available_gpu_memory`` in ``_profile_available_bytes``, after a
``gc.collect`` of 0.3 s a build), answered with a fixed ``MEMORY_BUDGET`` so the flags' caps decide every size, the
same on every machine (a server sized by its memory, ``ModelConfig.free_memory_kib``, is answered with that memory and
named no caps: SGLang decides its sizes, ``server_sized`` reads them back), while the rest of that method (its mamba
budget) is SGLang's; and the machine a server runs on
(``compat.platform``: a B200 for every config but the CPU server's, which runs SGLang's CPU engine on an AMX Xeon), so
that the flags are resolved and the pools built as that machine's server resolves and builds them (without CUDA,
SGLang's base platform refuses FP4 KV, ``mxfp8`` and the mamba extra buffer, and DSA's model hook asks the GPU's
compute capability); and, for a speculative server
(``--speculative-algorithm NEXTN``: the target worker's pools, with a state row per draft token), the one launch of
SGLang's tiled KV copy kernel its pools make when built, over dummy locations (it moves nothing; a real move called
then is refused): the pools move rows with SGLang's native torch move (``SGLANG_NATIVE_MOVE_KV_CACHE``). Its draft
worker's KV pool is built too, as an EAGLE worker's model runner builds it (the draft checkpoint's model config,
over the target's request pool and allocator, sized by the target's memory config), and listed; no family writes a
draft model's KV, so none runs on it.

One registry (``server_models.MODELS``) maps a config's architecture to the model that stands for it; one with no entry yet is
named as such, never built another way. Releases before 0.5.16 have no configurator: their model runner's own
``init_memory_pool`` builds the pools, under the Scheduler's global arguments (``runner_pools``). Before 0.5.22 a
scheduler publishes its server arguments without its ranks, which its model runner holds (a one-rank
``ParallelState``) and passes to its parallel groups and configurator; the machine is stood in for through the
bindings of SGLang's platform probes (``compat.platform``). On 0.5.18 a speculative server's mamba pool allocates its
draft-token states on ``cuda`` whatever its device, so it does not build here (SGLang's error, declined).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import tempfile
import types
from dataclasses import dataclass, field

from poolfuzz.adapters.sglang.compat import (has_private, model_missing, parser_refusal, private, published_namespace,
                                              release_flag_values, server_flags as server_flag_names)
from poolfuzz.adapters.sglang.compat.drift import (StandIn, build_drift, configurator_lacking, raised_by_sglang,
                                                  startup_refusal)
from poolfuzz.adapters.sglang.compat.platform import (B200, GPU, XEON, cpu_platform_problem, cpu_server, gpu_server,
                                                      platform_problem)
from poolfuzz.adapters.sglang.pools.calls import native_kv_move
from poolfuzz.adapters.sglang.pools import runner_pools
from poolfuzz.adapters.sglang.pools.descriptions import DRAFT, describe_pools, kv_pool_words
from poolfuzz.adapters.sglang.pools.environment import server_environment
from poolfuzz.adapters.sglang.pools.runner_calls import (fixed_free_memory, kv_copy_warmup_skipped, layer_split,
                                                         publish_as_scheduler, runner_ranks, group_ranks, sglang_quiet)
from poolfuzz.adapters.sglang.pools.server_models import MODELS, dtype_flags
from poolfuzz.errors import ConfigError, EngineApiChanged
from poolfuzz.pools.capabilities import MODEL_PATH
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.environment import environment_set

# What the GPU memory probe answers: more than any config's pools take, so the flags' caps bind.
MEMORY_BUDGET = 1 << 30


@dataclass(frozen=True, kw_only=True)
class ServerModel:
    """The server a config stands for: its flags (``ServerArgs`` fields) and its model's ``config.json``."""

    kind: str  # the config's architecture
    flags: dict
    hf_config: dict
    gpu: GPU | None = None  # the GPU it runs on (stood in for while its pools are built); None: a CPU server
    # the device memory (bytes) its configurator finds free once the weights are loaded (``_fixed_free_memory``)
    free_memory: int = MEMORY_BUDGET

    def command_line(self) -> str:
        """The flags as ``python -m sglang.launch_server`` takes them (the model path left out)."""
        return command_line(self.flags)


def command_line(flags: dict) -> str:
    """Server flags as ``python -m sglang.launch_server`` takes them, each value quoted for a shell where it needs it
    (a JSON extra config); the model-path placeholder is left as it is, for the launcher line to fill in."""
    import shlex

    out = []
    for name, value in sorted(flags.items()):
        if value is None:  # left unset (SGLang's default): a role's --max-mamba-cache-size, decode_server.ROLE_FLAGS
            continue
        flag = "--" + name.replace("_", "-")
        text = str(value)
        out.append(flag if value is True else f"{flag} {text if text == MODEL_PATH else shlex.quote(text)}")
    return " ".join(out)


@dataclass(frozen=True, kw_only=True)
class ConfiguredPools:
    """What SGLang's configurator built for a server: the three pools, and what it sized them to."""

    server: ServerModel
    req_to_token_pool: object
    token_to_kv_pool: object
    allocator: object
    sizes: dict = field(default_factory=dict)
    unified_buffer: object = None  # --enable-unified-memory: the byte buffer the sub-pools share
    # a speculative server's draft worker's KV pool (over the same allocator); no family writes a draft model's KV
    draft_kv_pool: object = None
    configurator: object = None  # the target worker's KVCacheConfigurator, which its model runner keeps and asks
    # the variables SGLang's argument hooks set for this server while its flags were resolved (its process runs
    # with them: 0.5.18's Inkling hook turns on the unified radix tree); the builder's process gets its own back
    environment: dict = field(default_factory=dict)

    def parts(self) -> dict[str, str]:
        """Each pool (and each part of a hybrid one) with its class and size, in a listing's words; a speculative
        server's draft KV pool last, which the families' pools are not compared with (they run no draft model)."""
        out = describe_pools(self.req_to_token_pool, self.token_to_kv_pool, self.allocator)
        if self.draft_kv_pool is not None:
            out[DRAFT] = kv_pool_words(self.draft_kv_pool) + " (not fuzzed: no family runs a draft model)"
        return out


def server_gpu(c: ModelConfig) -> GPU | None:
    """The GPU ``c``'s server runs on, or None for a CPU server (SGLang's CPU FP8 KV cache is a CPU server's)."""
    return None if c.kv_quant == "cpu_fp8_e4m3" else B200


def server_flags(c: ModelConfig) -> dict:
    """The flags of the server ``c`` stands for (``ServerArgs`` fields), whether or not a model stands for it yet."""
    model_dtype, flags = dtype_flags(c)
    if not flags and c.architecture in MODELS and MODELS[c.architecture].names_model_kv_dtype:
        flags["kv_cache_dtype"] = model_dtype
    if server_gpu(c) is None:
        flags["device"] = "cpu"
    elif c.architecture in MODELS:
        flags["attention_backend"] = MODELS[c.architecture].attention_backend
    if model_dtype == "float32":  # named: left to "auto", SGLang serves a float32 checkpoint in float16
        flags["dtype"] = model_dtype
    # the sizes as caps, or (a server sized by its memory) none but the running requests: SGLang sizes the rest
    capped = not c.free_memory_kib
    flags.update(page_size=c.page_size, max_running_requests=c.request_rows)
    if capped:
        flags["max_total_tokens"] = c.full_tokens or c.swa_tokens
    if capped and c.has_swa and c.has_full:
        flags["swa_full_tokens_ratio"] = c.swa_tokens / c.full_tokens
    if c.has_mamba:  # an extra buffer's ping-pong pair of track slots is the overlap schedule's
        flags.update(mamba_radix_cache_strategy="extra_buffer" if c.mamba_track_slots else "no_buffer")
        if c.mamba_track_slots != 2:
            flags["disable_overlap_schedule"] = True
    if c.has_mamba and capped:
        flags["max_mamba_cache_size"] = c.mamba_slots
    if c.spec_draft_tokens:
        # the model's own MTP layers draft (NEXTN, which SGLang runs as EAGLE), a tree of top-k 2 verified in one
        # forward of the config's draft tokens: the target's pools keep one state row per draft token
        # (SGLang names the target's checkpoint as the draft's itself only for DeepSeek-like models, not Qwen3-Next)
        flags.update(speculative_algorithm="NEXTN", speculative_num_draft_tokens=c.spec_draft_tokens,
                     speculative_num_steps=c.spec_draft_tokens - 1, speculative_eagle_topk=2,
                     speculative_draft_model_path=MODEL_PATH)
    return release_flag_values(flags)  # as this release's launcher names them (the FP4 KV dtype before 0.5.18)


def server_model(c: ModelConfig) -> ServerModel:
    """The server ``c`` stands for; a ConfigError naming what is missing where no model stands for it yet."""
    kind = c.architecture
    if kind not in MODELS:
        raise ConfigError(f"config {c.name!r}: no model stands for architecture {kind!r} on the configurator path "
                          f"yet (it has models for: {', '.join(MODELS)})")
    if why := MODELS[kind].layers_problem(c):  # no server, so nothing to fuzz: refused
        reason = f"no {kind} model stands for its layers ({why})"
        raise ServerRefused(f"config {c.name!r}: {reason}", reason=reason)
    return ServerModel(kind=kind, flags=server_flags(c), hf_config=MODELS[kind].config_json(c, dtype_flags(c)[0]),
                       gpu=server_gpu(c), free_memory=c.free_memory_kib << 10 or MEMORY_BUDGET)


@dataclass(frozen=True, kw_only=True)
class _Resolved:
    """What building a config's server (with a role's flags) told: its sizes and the environment its argument hooks
    set, or the ConfigError that stopped it (a ServerRefused where SGLang refuses the flags)."""

    sizes: dict | None = None
    environment: dict = field(default_factory=dict)
    error: ConfigError | None = None

    def raise_error(self) -> None:
        """Its error raised afresh (one instance raised again would keep every earlier raise's traceback)."""
        if isinstance(self.error, ServerRefused):
            raise ServerRefused(str(self.error), reason=self.error.reason) from None
        if self.error is not None:
            raise ConfigError(str(self.error)) from None


_RESOLVED: dict[tuple, _Resolved] = {}


def _resolved(c: ModelConfig, role_flags: dict | None) -> _Resolved:
    """``c``'s server with ``role_flags`` built once per config and role per process, and what the build told (the
    refusal, the sizes and the hooks' environment are all asked of it)."""
    key = (c, tuple(sorted((role_flags or {}).items())))
    if key not in _RESOLVED:
        try:
            built = configure(c, role_flags=role_flags)
            _RESOLVED[key] = _Resolved(sizes=built.sizes, environment=built.environment)
        except ConfigError as exc:
            _RESOLVED[key] = _Resolved(error=exc)
    return _RESOLVED[key]


def refusal(c: ModelConfig, *, role_flags: dict | None = None) -> str | None:
    """SGLang's words where its own validation refuses ``c``'s server (with ``role_flags`` beside its own: no such
    server starts), else None: also None where the configurator cannot tell (this release has none, or this machine
    cannot build the server's pools)."""
    error = _resolved(c, role_flags).error
    return error.reason if isinstance(error, ServerRefused) else None


def hooks_environment(c: ModelConfig, *, role_flags: dict | None = None) -> dict[str, str]:
    """The variables SGLang's argument hooks set for ``c``'s server (with ``role_flags``) when its flags are resolved,
    which that server's process runs with (``ConfiguredPools.environment``); {} where no such server builds here (the
    family then says why)."""
    return _resolved(c, role_flags).environment


_SIZED: dict[tuple, ModelConfig] = {}


def server_sized(c: ModelConfig, *, role_flags: dict | None = None) -> ModelConfig:
    """``c`` with the sizes SGLang's configurator gives its server (with ``role_flags``) where SGLang sizes the pools
    itself, so that the family, the reference and the scheduler's caps are the server's:

    - a server sized by its memory (``free_memory_kib``): its token slots (full and window), mamba slots and running
      requests, all read back from what the configurator built;
    - a server with ``role_flags`` whose window pool SGLang sizes otherwise (a PD decode server's, without a radix
      cache, from its requests' windows, ``SWARequestCapPoolConfigurator``, not ``--swa-full-tokens-ratio``): that pool;
    - a server without recurrent state whose token slots settle fewer running requests than its
      ``--max-running-requests`` (SGLang's ``resolve_max_num_reqs``: at most half its token slots): those.

    ``c`` as given otherwise, or where the configurator does not build here (the family then says why; a server sized
    by its memory is then refused, with a ConfigError). A server sized by memory whose sizes, named back to it, size
    it otherwise is refused too (no config would stand for it). Read back once per config and role per process."""
    key = (c, tuple(sorted((role_flags or {}).items())))
    if key not in _SIZED:
        resolved = _resolved(c, role_flags)
        if isinstance(resolved.error, ServerRefused):
            resolved.raise_error()
        if resolved.error is not None and c.free_memory_kib:
            # only SGLang knows what its memory holds: no sizes of the adapter's stand in
            raise ConfigError(f"{resolved.error} (a server sized by its free memory is sized by SGLang alone, its "
                              "configurator or before 0.5.16 its model runner; or name the sizes: "
                              "free_memory_kib=0)") from None
        _SIZED[key] = _read_back(c, resolved.sizes, role_flags) if resolved.sizes else c
        if c.free_memory_kib and resolved.sizes:
            _fixed_point(c, _SIZED[key], role_flags)
    return _SIZED[key]


def _read_back(c: ModelConfig, sizes: dict, role_flags: dict | None = None) -> ModelConfig:
    """``c`` with the sizes the configurator reported: every one for a server sized by its memory, the window pool
    and fewer running requests otherwise (and their state slots, where ``role_flags`` leave those to SGLang)."""
    window, rows = sizes.get("swa_max_total_num_tokens"), sizes["max_running_requests"]
    if rows == 0:  # SGLang starts it, and no request ever runs: nothing to fuzz
        state = f", {sizes['mamba_slots']} state slots" if sizes.get("mamba_slots") is not None else ""
        raise ConfigError(f"config {c.name!r}: SGLang settles no running requests for its server "
                          f"({sizes['max_total_num_tokens']} token slots{state}): it serves none")
    if not c.free_memory_kib:  # capped: the window pool a role sizes, and the running requests its token slots settle
        changes = dict(swa_tokens=window) if c.has_swa and c.has_full and window else {}
        # state slots follow the rows (``mamba_sized``, later), unless the role leaves both to SGLang (a decode server)
        state_left = c.has_mamba and (role_flags or {}).get("max_mamba_cache_size", 0) is None
        if rows and (not c.has_mamba or state_left):
            settled = min(rows, c.request_rows)
            changes.update(request_rows=settled, mamba_slots=settled if state_left else c.mamba_slots)
        return c.replace(**changes)
    if sizes["max_running_requests"] is None:
        raise ConfigError(f"config {c.name!r}: {RUNNER} settles no running requests on this release without "
                          "--max-running-requests (its initialize computes them inline afterwards from the token "
                          "slots: nothing to call), so a server sized by its free memory is not sized here; name the "
                          "sizes: free_memory_kib=0")
    changes = {"request_rows": sizes["max_running_requests"]}
    if c.has_swa and c.has_full:
        changes.update(full_tokens=sizes["full_max_total_num_tokens"], swa_tokens=window)
    elif c.has_swa:  # all SWA: its token slots are the window's
        changes.update(swa_tokens=window or sizes["max_total_num_tokens"])
    else:
        changes.update(full_tokens=sizes["max_total_num_tokens"])
    if c.has_mamba:
        changes.update(mamba_slots=sizes["mamba_slots"])
    unsized = sorted(k for k, v in changes.items() if v is None)
    if unsized:  # the model as SGLang reads it keeps no such pool (a mix ``server_models.layers_problem`` misses)
        raise ConfigError(f"config {c.name!r}: SGLang's configurator sized no {', '.join(unsized)} for its server "
                          f"from {c.free_memory_kib} KiB (its model config keeps no such pool): no server of that "
                          "memory has the config's layers")
    return c.replace(**changes)


def _fixed_point(c: ModelConfig, sized: ModelConfig, role_flags: dict | None) -> None:
    """Refuse a memory-sized server that SGLang sizes otherwise once its own answer is named back (a speculative
    server's state reserve follows its running requests): the sized config would stand for another server."""
    resolved = _resolved(sized, role_flags)
    resolved.raise_error()
    again = _read_back(sized, resolved.sizes, role_flags)
    if again != sized:
        differ = {f: (getattr(sized, f), getattr(again, f)) for f in ("full_tokens", "swa_tokens", "mamba_slots",
                                                                      "request_rows")
                  if getattr(sized, f) != getattr(again, f)}
        raise ConfigError(f"config {c.name!r}: SGLang sizes its server from {c.free_memory_kib} KiB otherwise once "
                          f"its own sizes are named back ({differ}): no config stands for that server")


def problem() -> str | None:
    """Why this release cannot build pools through its configurator (or, before 0.5.16, its model runner) here, or
    None."""
    if by_runner():
        return runner_pools.problem()
    missing = _configurator_lacks()
    return f"the configurator path needs what this release lacks: {', '.join(missing)}" if missing else None


def _configurator_lacks() -> list[str]:
    """What the configurator path calls that this release, which has the configurator, lacks."""
    return [k for k in ("configurator_free_memory", "init_parallel_groups", "init_kv_cache_configurator",
                        "resolve_layer_indices", "runner_kv_dtype", "resolve_sliding_window_size", "spec_aux_config")
            if not has_private(k)]


CONFIGURATOR = "SGLang's KV cache configurator"
RUNNER = "SGLang's model runner's init_memory_pool"  # before 0.5.16, which has no configurator


def by_runner() -> bool:
    """Whether this release's model runner builds a server's pools itself (before 0.5.16: no configurator)."""
    return not has_private("kv_cache_configurator")


def builder() -> str:
    """What builds a server's pools on this release, in a listing's words: ``CONFIGURATOR`` or ``RUNNER``."""
    return RUNNER if by_runner() else CONFIGURATOR


def configure(c: ModelConfig, *, device: str = "cpu", role_flags: dict | None = None) -> ConfiguredPools:
    """Build ``c``'s server's pools with SGLang's configurator; a ConfigError with SGLang's words where the server (or
    this release, or this machine's platform) refuses it. ``role_flags``: the flags that make the server what it is
    beside its model and sizes (a PD decode server's ``--disaggregation-mode decode``, ...); what SGLang's hooks
    resolve from them (the decode side's extra request rows, its disabled radix cache) is theirs."""
    if not by_runner() and (missing := _configurator_lacks()):
        raise configurator_lacking(missing)  # a release with the configurator reshaped around it: not this machine
    if reason := problem():
        raise ConfigError(f"config {c.name!r}: {reason}")
    if reason := model_missing(c.architecture):  # no server of this release runs the model: declined
        raise ServerRefused(f"config {c.name!r}: {reason}", reason=reason)
    server = server_model(c)
    if role_flags:
        server = dataclasses.replace(server, flags=server.flags | role_flags)
    if server.gpu is not None and platform_problem():
        raise ConfigError(f"config {c.name!r}: its server runs on a GPU, which cannot be stood in for on this "
                          f"release ({platform_problem()})")
    if server.gpu is None and cpu_platform_problem():
        raise ConfigError(f"config {c.name!r}: its server runs on SGLang's CPU engine, which cannot be stood in for "
                          f"on this release ({cpu_platform_problem()})")
    model_dir = _model_dir(server.hf_config)
    from poolfuzz.adapters.sglang.server_args import another_server

    runs_in = server_environment(c)  # a user's unreadable eviction interval is their error, before SGLang is asked
    try:
        # the caller's server published again once these pools are built (its environment too); built in the
        # environment the server runs in (a decode server's window pool is sized by its eviction interval)
        with another_server(), sglang_quiet(), environment_set(runs_in):
            before = dict(os.environ)
            result = _configured(server, model_dir, device)
            environment = {k: v for k, v in os.environ.items() if before.get(k) != v}
    except _ResolvedOtherwise as other:
        reason = f"SGLang serves the server {server.command_line()!r} with {other}: no server has the config's pools"
        raise ServerRefused(f"config {c.name!r}: {reason}", reason=reason) from None
    except _Refused as refused:
        exc = refused.__cause__
        reason = (f"SGLang refuses the server {server.command_line()!r}: "
                  f"{type(exc).__name__}: {_first_line(exc)}")
        raise ServerRefused(f"config {c.name!r}: {reason}", reason=reason) from None
    except EngineApiChanged:
        raise  # a name, or a seam's answer, the adapter reads: its verdict, not this machine's limit
    except Exception as exc:  # noqa: BLE001 -- whatever SGLang (or transformers, parsing the model) refuses it with
        if (change := build_drift(exc, during=f"{builder()} for the server {server.command_line()!r}")) is not None:
            raise change from None  # the adapter's call, not the server: never a decline in silence
        if (refuser := startup_refusal(exc)) is not None:  # a check that no such server starts, not this machine's limit
            reason = f"{refuser} the server {server.command_line()!r}: {type(exc).__name__}: {_first_line(exc)}"
            raise ServerRefused(f"config {c.name!r}: {reason}", reason=reason) from None
        raise ConfigError(f"config {c.name!r}: SGLang cannot build the server {server.command_line()!r} here: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None
    (result, built_by), draft = result
    mamba = getattr(result.req_to_token_pool, "mamba_pool", None)
    sizes = {"max_total_num_tokens": result.max_total_num_tokens,
             "max_running_requests": result.max_running_requests,
             "full_max_total_num_tokens": result.full_max_total_num_tokens,
             "swa_max_total_num_tokens": result.swa_max_total_num_tokens,
             "mamba_slots": None if mamba is None else mamba.size,
             # the window the server serves (its runner's, asked of the model first): what its tree evicts by
             "sliding_window_size": (built_by or result).sliding_window_size}
    return ConfiguredPools(server=server, req_to_token_pool=result.req_to_token_pool,
                           token_to_kv_pool=result.token_to_kv_pool, allocator=result.token_to_kv_pool_allocator,
                           sizes=sizes, unified_buffer=getattr(result, "unified_memory_pool", None),
                           draft_kv_pool=None if draft is None else draft[0].token_to_kv_pool,
                           configurator=built_by, environment=environment)


class ServerRefused(ConfigError):
    """SGLang's own validation of the server's flags refuses them: no such server starts, so nothing is fuzzed.
    ``reason``: SGLang's words, without the config's name."""

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # crosses process boundaries (a campaign's workers) with its reason
        return type(self), (self.args[0],), {"reason": self.reason}


class _Refused(Exception):
    """Raised from the flags' resolution by SGLang's own code (its cause is SGLang's error)."""


class _ResolvedOtherwise(Exception):
    """SGLang's resolution of the server's flags changed one the pools are built by (its words: the flag as served)."""


def _first_line(exc: BaseException) -> str:
    """The line of ``exc`` that says what is wrong: its first, or where that only introduces the next (a validator's
    "Class validation error for validator 'validate_rope':"), the two."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _on_server_machine(server: ServerModel):
    """The server's machine as SGLang sees it: its GPU, or a CPU server's Xeon, stood in for (``compat.platform``)."""
    return gpu_server(server.gpu) if server.gpu is not None else cpu_server(XEON)


def _configured(server: ServerModel, model_dir: str, device: str):
    """SGLang's configurator run for ``server`` (published as a scheduler process publishes it), its result. The
    server's flags are resolved and its pools built as on its machine; its one-rank parallel groups are a CPU
    process's (gloo), built outside the GPU's stand-in. ``ServerArgs`` keeps ``device="cpu"`` for a GPU server too,
    so that no hook sizes anything from this machine's devices; the flags name what a GPU server would otherwise pick
    by device (its attention backend)."""
    from sglang.srt.server_args import ServerArgs

    hook = MODELS[server.kind].window_hook
    if hook is not None:  # its model's module imported on this machine: before 0.5.22 a module imported while a GPU
        has_private(hook)  # is stood in for binds the GPU's kernels at import (0.5.18's gpt_oss: sgl_kernel)
    if refused := parser_refusal(server.flags):  # its launcher's parser stops it before ServerArgs exists
        import argparse

        raise _Refused() from argparse.ArgumentError(None, refused)
    with _on_server_machine(server):
        try:
            flags = {k: model_dir if v == MODEL_PATH else v for k, v in server.flags.items()}
            args = ServerArgs(model_path=model_dir, **server_flag_names(ServerArgs, {"device": "cpu"} | flags))
            if not by_runner():  # before 0.5.16 the Scheduler's global arguments, set by the runner path
                publish_as_scheduler(args)
        except Exception as exc:  # noqa: BLE001 -- SGLang's validation raises many types
            if (change := build_drift(exc, during="SGLang's resolution of the server's flags")) is not None:
                raise change from exc
            if raised_by_sglang(exc):
                raise _Refused() from exc
            raise
    if args.page_size != server.flags["page_size"]:  # a model's hook reset it (0.5.12: a no_buffer Qwen3-Next's)
        raise _ResolvedOtherwise(f"--page-size {args.page_size}, not {server.flags['page_size']}")
    if by_runner():
        return _runner_built(server, args, model_dir, device), None
    _parallel_groups(args, model_dir)
    with _on_server_machine(server), fixed_free_memory(server.free_memory):
        return _built(args, model_dir, device, kind=server.kind)


def _built(args, model_dir: str, device: str, *, kind: str):
    """The configurator's result for the published ``args`` (the model runner's leaves give its inputs): the target
    worker's, and with it, for a speculative server, the draft worker's (``(target, draft or None)``, each a
    ``(result, configurator)`` pair)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    target = _worker_pools(args, model_dir, device, kind=kind)
    spec = published_namespace("spec")  # on 0.5.16 the ServerArgs
    if SpeculativeAlgorithm.from_string(spec.speculative_algorithm).is_none():
        return target, None
    # the draft worker's model runner, as an EAGLE worker builds it: its own model config (the MTP layers of the draft
    # checkpoint) and KV pool, over the target's request pool and allocator, sized by the target's memory config
    return target, _worker_pools(args, spec.speculative_draft_model_path, device, kind=kind, target=target[0])


def _worker_pools(args, model_dir: str, device: str, *, kind: str, target=None):
    """One model runner's ``KVCacheConfigurator.configure``: the target worker's, or with ``target`` (the target's
    result) the draft worker's. The configurator is made by the runner's own ``init_kv_cache_configurator``, run
    unbound on a stand-in holding what the runner holds when it calls it: the published server's page size (a model
    hook may have reset it), its groups, and SGLang's own answers for the KV dtype, the layers, the window and the
    speculative hidden-state record (the runner's other inits). ``(result, the configurator)``: the runner keeps the
    configurator, and its token capacities ask it (``compat.worker_token_capacity``)."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    draft = target is not None
    # as the TP worker builds it (``TpModelWorker._init_model_config``): the server's --dtype, context length and
    # quantisation flags are read into it
    model_config = SGLangModelConfig.from_server_args(args, model_path=model_dir, is_draft_model=draft)
    model = _model_standin(kind, model_config)
    spec = published_namespace("spec")  # on 0.5.16 the ServerArgs
    spec_algorithm = SpeculativeAlgorithm.from_string(spec.speculative_algorithm)
    runner = StandIn(
        "ModelRunner", device=device, gpu_id=0, ps=runner_ranks(), pp_group=get_parallel().pp_group, pp_size=get_parallel().pp_size,
        model=model, model_config=model_config, server_args=args, dtype=model_config.dtype,
        # as the runner resolves it (``resolve_draft_attention_backend``, no backend of the draft's algorithm)
        draft_attention_backend=spec.speculative_draft_attention_backend if draft else None,
        page_size=published_namespace("schedule").page_size,
        sliding_window_size=private("resolve_sliding_window_size")(model, model_config),
        spec_algorithm=spec_algorithm, is_draft_worker=draft, draft_model_idx=None,
        spec_aux_config=private("spec_aux_config")(server_args=args, model_config=model_config,
                                                   spec_algorithm=spec_algorithm, is_draft_worker=draft),
        is_hybrid_swa=model_config.is_hybrid_swa, is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
        use_mla_backend=model_config.attention_arch == AttentionArch.MLA,
        layer_info=layer_split(model, model_config, draft, spec_algorithm),
        forward_stream=None, req_to_token_pool=target.req_to_token_pool if draft else None,
        token_to_kv_pool_allocator=target.token_to_kv_pool_allocator if draft else None,
        memory_pool_config=target.memory_pool_config if draft else None)
    private("runner_kv_dtype")(runner)  # the runner's own: its kv_cache_dtype and kv_cache_dtype_str
    private("init_kv_cache_configurator")(runner)
    configurator = runner.kv_cache_configurator
    with kv_copy_warmup_skipped(), native_kv_move():
        return configurator.configure(pre_model_load_memory=0), configurator


def _runner_built(server: ServerModel, args, model_dir: str, device: str):
    """Before 0.5.16: the target worker's pools as its model runner builds them (``runner_pools``), under the
    Scheduler's global ``args``; ``(result, None)``: no configurator. No draft worker is built (no family runs one)."""
    from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig

    with runner_pools.global_server(args):
        model_config = SGLangModelConfig.from_server_args(args, model_path=model_dir)
        runner_pools.runner_groups(args, model_config, _kept_temporary("groups").name)
        with _on_server_machine(server), fixed_free_memory(server.free_memory), kv_copy_warmup_skipped(), \
                native_kv_move():
            runner = runner_pools.built_by_runner(args, model_config, _model_standin(server.kind, model_config),
                                                  device)
    return runner_pools.as_worker(runner), None


def _model_standin(kind: str, model_config):
    """The model a runner holds, as far as the configurator's inputs ask it: no weights, no quantisation and no layer
    hooks (the model config decides), but the model class's window hook where it has one (GPT-OSS serves its
    checkpoint's window less one), run on the model config as the model would run it."""
    model = StandIn("the model")
    hook = MODELS[kind].window_hook
    if hook is not None and has_private(hook):
        model.get_attention_sliding_window_size = types.MethodType(
            private(hook), StandIn("the model", config=model_config.hf_config))
    return model


_GROUPS: dict[str, object] = {}


def _parallel_groups(args, model_dir: str) -> None:
    """SGLang's own parallel groups of a one-rank server, built once per process (gloo: no GPU), their file store in
    a temporary directory removed when the process ends. Before 0.5.22 they are built from the runner's
    ``ParallelState`` and a model config (its DP-attention context, one rank here), passed as the runner passes them:
    the model config of the first server built in the process, read on this machine."""
    if "store" in _GROUPS:
        return
    store = _kept_temporary("groups")
    private("init_parallel_groups")(backend="gloo", dist_init_method=f"file://{store.name}/store", server_args=args,
                                    gpu_id=0, **group_ranks(args, model_dir))
    _GROUPS["store"] = store  # only once built: a failed first build leaves the next to try again


_MODEL_DIRS: dict[str, str] = {}
_TEMPORARY: dict[str, tempfile.TemporaryDirectory] = {}


def _kept_temporary(what: str) -> tempfile.TemporaryDirectory:
    """A temporary directory for ``what``, made once per process and removed when it exits."""
    if what not in _TEMPORARY:
        _TEMPORARY[what] = tempfile.TemporaryDirectory(prefix=f"poolfuzz-{what}-")
        atexit.register(_TEMPORARY[what].cleanup)
    return _TEMPORARY[what]


def _model_dir(hf_config: dict) -> str:
    """A directory holding the model's ``config.json`` (no weights: the configurator reads none), one per model per
    process (a family is built for every example), under one temporary directory removed when the process ends."""
    text = json.dumps(hf_config, indent=1, sort_keys=True)
    if text not in _MODEL_DIRS:
        path = os.path.join(_kept_temporary("models").name, str(len(_MODEL_DIRS)))
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as fh:
            fh.write(text)
        _MODEL_DIRS[text] = path
    return _MODEL_DIRS[text]
