"""A server's arguments published into SGLang's runtime context, as a launcher publishes them, and the record of the
last server this process published (the tree, scheduler and configurator paths each publish one)."""

from __future__ import annotations

import os
from contextlib import contextmanager

from poolfuzz.adapters.sglang.compat import namespace_published, seed_mamba_chunk_size

# "flags": the key of the server flags this process last published here (None: another server was published since);
# "call": those flags and the model's mamba chunk, to publish them again
_PUBLISHED: dict[str, object] = {}
# SGLang's own model path for a server without weights: ServerArgs then skips what needs a model's config (0.5.18
# fetched one from the hub for any other path, so its server arguments could not be published offline).
NO_MODEL = "dummy"


def publish_server_args(*, mamba_chunk_size: int = 64, fresh: bool = False, **flags) -> None:
    """Publish a server's arguments into SGLang's runtime context, as a launcher does before the scheduler and its
    tree read them: ``ServerArgs`` with ``flags`` (the rest at their defaults), projected into the config bags with
    what SGLang derives from them at publish (``exec.mamba.enable_mamba_extra_buffer`` from
    ``mamba_radix_cache_strategy``, ...). No model, so no resolution pipeline, which would fetch one. Published again
    only where the flags differ from the last ones this process published; with no flags, where nothing is published
    yet, or where a server with other flags was (so the families that read the defaults do not run on another
    server's flags). ``mamba_chunk_size``: the model's (its HF config's; FLA's chunk, 64, where it names none).
    ``fresh``: published again whatever was published last (a server that resolves flags on its pools lands them in
    the context, so the next server with the same flags must not start from them)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    key = tuple(sorted(flags.items())) + ((("mamba_chunk_size", mamba_chunk_size),) if mamba_chunk_size != 64 else ())
    if _PUBLISHED.get("flags") == key and not fresh:
        return
    context = runtime_context.get_context()
    if key or "flags" in _PUBLISHED or not namespace_published(context, "memory"):
        context.set_server_args(ServerArgs(model_path=NO_MODEL, device="cpu", **flags))
        # The server's widths now come from the arguments; the rank a launcher would write is the
        # single rank of a CPU run (MLA's pools and their retraction read it).
        parallel = runtime_context.get_parallel()
        try:
            parallel.attn_dcp_rank
        except (RuntimeError, ValueError):
            parallel.override_permanently(attn_dcp_rank=0)
    # The mamba checkpoint grid is max(the model's mamba chunk, page size), read from the model's HF
    # config, which a run without a model has none of: SGLang honours a pre-seeded value (as its
    # own test fixtures seed it). A model config without mamba_chunk_size gets FLA's chunk, 64 (the
    # value SGLang falls back to; importing the FLA kernels for it probes Triton's GPU driver).
    seed_mamba_chunk_size(runtime_context.get_server_args(), max(mamba_chunk_size, flags.get("page_size", 1)))
    _PUBLISHED["flags"] = key
    _PUBLISHED["call"] = (mamba_chunk_size, dict(flags))


@contextmanager
def another_server():
    """Inside, another server is published (the configurator's, with a model); after it, the server this process
    last published here is published again, so what reads SGLang's context next (a scheduler resolving its
    retraction backup, a tree) reads its own server; where none was, the next publish here runs whatever it asks.
    The process environment is put back too: SGLang's argument hooks set variables for the server they resolve
    (0.5.18's Inkling hook ``SGLANG_ENABLE_UNIFIED_RADIX_TREE``), which must not reach the next server built here."""
    last = _PUBLISHED.get("call")
    environment = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
        _PUBLISHED.clear()
        _PUBLISHED["flags"] = None
        if last is not None:
            chunk, flags = last
            publish_server_args(fresh=True, mamba_chunk_size=chunk, **flags)


def publish_defaults() -> None:
    """The tree reads the server's configuration from SGLang's runtime context: a server with default arguments."""
    publish_server_args()
