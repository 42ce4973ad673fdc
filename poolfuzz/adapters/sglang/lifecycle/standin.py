"""A small stand-in for SGLang's ``Req``: the fields its pool and retraction code read.

The retraction code under test is SGLang's own: ``Req.offload_kv_cache`` and
``Req.load_kv_cache`` (and the helpers they call on ``self``, such as
``_mamba_pool_needing_backup`` after #35957) are borrowed from the installed ``Req`` class
onto this stand-in, unchanged. A real ``Req`` needs a tokenizer, sampling parameters and
dozens of scheduler fields; none of that touches memory.

Where the installed SGLang keeps the request's KV fields on ``req.kv`` (a ``ReqKvInfo``,
0.5.19 on) the stand-in holds a real ``ReqKvInfo``; before that the fields are flat on the
request (0.5.18 and before keep a small ``req.kv`` record with two of them while the row is
held). The stand-in redirects each field to where the installed release keeps it, so the
adapter reads and writes the same names on the stand-in whatever the layout.
"""

from __future__ import annotations

import inspect

from poolfuzz.adapters.sglang.api import SGLangAPI

# Fields the pools read on the request (flat layout), with their empty values.
FLAT_FIELDS = {
    "req_pool_idx": None,
    "mamba_pool_idx": None,
    "kv_allocated_len": 0,
    "kv_committed_len": 0,
    "cache_protected_len": 0,
    "swa_evicted_seqlen": 0,
    "swa_evict_floor": 0,
    "mamba_ping_pong_track_buffer": None,
    "mamba_next_track_idx": None,
    "mamba_last_track_seqlen": None,
    "mamba_branching_seqlen": None,
    "mamba_cow_src_index": None,
    "mamba_needs_clear": False,
    "kv_cache_cpu": None,
    "retraction_backup": None,
    "inflight_middle_chunks": 0,
    "is_chunked": 0,
    "dllm_config": None,  # not a diffusion LLM request (read by Req.is_dllm)
}

BORROWED = ("offload_kv_cache", "load_kv_cache")
# Req methods that some releases' pools call on the requests handed to them (e.g.
# ``ReqToTokenPool.alloc`` asks ``r.is_dllm()``); borrowed where this Req has them.
BORROWED_IF_PRESENT = ("is_dllm",)


class StandInBase:
    """Fields common to every layout; :func:`standin_class` adds the borrowed methods and, per
    layout, properties that redirect the moved fields to ``self.kv``."""

    kv_layout = "flat"
    kv_factory = None  # builds the ``kv`` record where one exists from the start

    def __init__(self, *, rid: int, api: SGLangAPI):
        self.rid = rid
        self.seqlen = 0  # SGLang computes it from prompt and output ids; the harness owns it
        self.origin_input_ids: list[int] = []
        self.output_ids: list[int] = []
        self.is_retracted = False
        self.retraction_count = 0
        self.beam_group = None  # not a beam-search leader (read by check_decode_mem)
        self.kv = self.kv_factory() if self.kv_factory is not None else None
        for name, value in FLAT_FIELDS.items():
            if not isinstance(getattr(type(self), name, None), property):
                setattr(self, name, value)

    def __repr__(self) -> str:
        return f"SGLangReqStandIn({self.rid})"

    def release_kv_record(self) -> None:
        """What SGLang does once the row is released: a split-layout ``kv`` record goes away."""
        if self.kv_layout == "split":
            self.kv = None


def _on_kv(name: str, default) -> property:
    """A field that lives on ``self.kv`` (created on first write where it starts as None)."""

    def get(self):
        return default if self.kv is None else getattr(self.kv, name)

    def put(self, value):
        if self.kv is None:
            self.kv = type(self).kv_record()
        setattr(self.kv, name, value)

    return property(get, put)


def kv_layout(api: SGLangAPI) -> str:
    """``kv``: every KV field on ``req.kv`` (0.5.19 on); ``split``: a small ``req.kv`` record holds
    a few fields while the request holds KV, the rest are flat; ``flat``: all on the request."""
    if api.kv_on_req:
        return "kv"
    return "split" if api.ReqKvInfo is not None else "flat"


def _referenced_methods(req_cls: type, names) -> list[str]:
    """The borrowed methods plus every method of ``Req`` that they call on ``self``."""
    out, todo = [], list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        attr = inspect.getattr_static(req_cls, name, None)
        if not inspect.isfunction(attr):
            continue
        out.append(name)
        for ref in attr.__code__.co_names:
            if inspect.isfunction(inspect.getattr_static(req_cls, ref, None)) and ref not in out:
                todo.append(ref)
    return out


def standin_class(api: SGLangAPI) -> type:
    """A stand-in class carrying SGLang's own ``offload_kv_cache`` / ``load_kv_cache``."""
    methods = {name: inspect.getattr_static(api.Req, name) for name in _referenced_methods(api.Req, BORROWED + BORROWED_IF_PRESENT)}
    missing = [n for n in BORROWED if n not in methods]
    if missing:
        from poolfuzz.adapters.sglang.api import SGLangUnavailable

        raise SGLangUnavailable(f"SGLang {api.version}'s Req has no {', '.join(missing)}")
    layout = kv_layout(api)
    attrs = dict(methods, kv_layout=layout)
    if layout != "flat":
        record = api.ReqKvInfo
        names = [n for n in inspect.signature(record).parameters if n in FLAT_FIELDS or n == "mamba_pool_idx"]

        def kv_record(cls=None):
            from poolfuzz.adapters.sglang.api import call_with

            return call_with(record, **{n: FLAT_FIELDS.get(n) for n in inspect.signature(record).parameters
                                        if n in FLAT_FIELDS})

        attrs["kv_record"] = staticmethod(kv_record)
        if layout == "kv":
            attrs["kv_factory"] = staticmethod(kv_record)
        for name in names:
            attrs[name] = _on_kv(name, FLAT_FIELDS.get(name))
    cls = type("SGLangReqStandIn", (StandInBase,), attrs)
    cls.borrowed = tuple(sorted(methods))
    return cls
