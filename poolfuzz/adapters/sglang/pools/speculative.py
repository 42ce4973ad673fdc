"""Speculative decoding's recurrent scratch on SGLang's real MambaPool, seen as components.

With ``speculative_num_draft_tokens`` SGLang's ``MambaPool`` allocates its intermediate caches
(``intermediate_ssm`` and ``intermediate_conv_window``, ``[layers, spec_state_size + 1, draft_tokens,
*state]``) and hands them to the attention backend through ``get_speculative_mamba2_params_all_layers``;
the speculative worker stand-in (``scheduler/spec_worker.py``) writes a request's row of them at verify.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.api import parameters
from poolfuzz.adapters.sglang.compat import conv_window_buffers
from poolfuzz.adapters.sglang.pools.request_pool import build_request_pool
from poolfuzz.pools.speculative import scratch_components


def speculative_problem(api, config) -> str | None:
    """Why this release cannot build the config's speculative scratch, or None."""
    if not config.spec_draft_tokens:
        return None
    if ("speculative_num_draft_tokens" not in parameters(api.HybridReqToTokenPool)
            or not hasattr(api.MambaPool, "get_speculative_mamba2_params_all_layers")):
        return f"SGLang {api.version}'s MambaPool keeps no speculative intermediate state caches"
    return _probe(api, config)


_PROBED: dict = {}


def _probe(api, config) -> str | None:
    """Build the config's request pool once, with its speculative caches: what a release cannot build on
    this device (some assert CUDA for them) is declined with SGLang's own message."""
    key = (config.mamba_layers, config.conv_shapes, config.temporal_shape, config.state_dtype,
           config.spec_draft_tokens)
    if key not in _PROBED:
        try:
            pool = build_request_pool(api, config, "cpu")
            SGLangScratch(pool, layer_ids=config.mamba_layer_ids, draft_tokens=config.spec_draft_tokens)
            _PROBED[key] = None
        except Exception as exc:  # noqa: BLE001 - any refusal of the constructors declines the config
            first = str(exc).splitlines()[0] if str(exc) else ""
            _PROBED[key] = (f"SGLang {api.version} cannot build the speculative caches on this device "
                            f"({type(exc).__name__}: {first})")
    return _PROBED[key]


class SGLangScratch:
    """The intermediate caches of SGLang's MambaPool as the harness's scratch components."""

    def __init__(self, req_pool, *, layer_ids, draft_tokens: int):
        self.req_pool = req_pool
        self.layer_ids = layer_ids
        self.draft_tokens = draft_tokens
        caches = req_pool.get_speculative_mamba2_params_all_layers()
        windows = list(caches.intermediate_conv_window)
        phys = conv_window_buffers(req_pool.mamba_pool, windows)
        if any(w.data_ptr() != p.data_ptr() or w.shape != p.shape for w, p in zip(windows, phys)):
            # CUDA with a chain of drafts: consecutive steps' conv windows share columns by design, so a
            # step's row is not its own and cannot carry its own tag.
            raise ValueError("the deduplicated conv-window layout shares columns between draft steps; the "
                             "harness needs the dense layout (a CPU pool, or speculative_eagle_topk > 1)")
        if caches.intermediate_ssm is None:
            raise ValueError("the pool keeps no intermediate_ssm (ReplaySSM spec verify)")
        self.buffers = windows + [caches.intermediate_ssm]
        self.state_names = [(f"mamba.conv{i}", None) for i in range(len(windows))] + [("mamba.temporal", None)]

    def components(self):
        return scratch_components(self.state_names, self.buffers, self.layer_ids, self.draft_tokens)
