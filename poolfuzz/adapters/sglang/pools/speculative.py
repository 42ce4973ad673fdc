"""Speculative decoding's recurrent scratch on SGLang's real MambaPool, seen as components.

With ``speculative_num_draft_tokens`` SGLang's ``MambaPool`` allocates its intermediate caches
(``intermediate_ssm`` and ``intermediate_conv_window``, ``[layers, spec_state_size + 1, draft_tokens,
*state]``) and hands them to the attention backend through ``get_speculative_mamba2_params_all_layers``;
the speculative worker stand-in (``scheduler/spec_worker.py``) writes a request's row of them at verify.
"""

from __future__ import annotations

from poolfuzz.adapters.sglang.api import parameters
from poolfuzz.adapters.sglang.compat import conv_window_buffers
from poolfuzz.pools.speculative import scratch_components


def speculative_problem(api, config) -> str | None:
    """Why this release keeps no speculative scratch for the config, or None. What a release cannot build on this device
    (some assert CUDA for the caches) is SGLang's configurator's to say, when it builds the server's request pool."""
    if not config.spec_draft_tokens:
        return None
    if ("speculative_num_draft_tokens" not in parameters(api.HybridReqToTokenPool)
            or not hasattr(api.MambaPool, "get_speculative_mamba2_params_all_layers")):
        return f"SGLang {api.version}'s MambaPool keeps no speculative intermediate state caches"
    return None


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
