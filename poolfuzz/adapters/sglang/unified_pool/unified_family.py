"""The family on SGLang's unified memory pool: capabilities, the mirrors' push and pull around each
operation, and the mirrored components every unified stack shares (``unified.py``, ``unified_swa.py``)."""

from __future__ import annotations

import functools
import inspect
import types

import torch

from poolfuzz.adapters.sglang.lifecycle.family import SGLangFamily, carries_mamba
from poolfuzz.adapters.sglang.lifecycle.protocol import SGLangProtocol
from poolfuzz.adapters.sglang.unified_pool.unified_mirror import Mirror, held_slots, shadow_like, token_translate
from poolfuzz.adapters.sglang.unified_pool.unified_reference import UnifiedReference, joint_short
from poolfuzz.adapters.sglang.pools.views import KVPoolView, MambaPoolView
from poolfuzz.pools.components import Component


class UnifiedFamily(SGLangFamily):
    """SGLang's pools built on the unified memory pool.

    Capabilities the harness reads, where they differ from :class:`SGLangFamily`:
      ``supports_fork``: False; the family serves through a chunk cache (as ``--disable-radix-cache``).
      ``supports_transfer``: False; PD transfer out of the unified pool (virtual-to-physical
        translation for the connector, the disagg move gate) is not driven.
      ``reference_factory``: :class:`UnifiedReference`: virtual ids are counted exactly; whether an
        allocation fits is the unified allocator's own byte-level answer.
      ``supports_tree_drafts``: False; the unified pools' ``move_kv_cache`` moves physical pages for
        compaction (the SWA pair's raises NotImplementedError), while a tree verify hands it virtual ids.
    """

    supports_fork = False
    supports_transfer = False
    supports_tree_drafts = False
    mirrors: tuple = ()
    kv_mirrors: tuple = ()
    kernel_comps: tuple = ()  # the components as the kernels address them (mirrored_component)
    unified_buffer: object = None

    def __repr__(self) -> str:
        return f"UnifiedFamily({self.config.name}, sglang {self.api.version}, {self.device})"

    def kernel_components(self) -> list[Component]:
        """SGLang's physical views, addressed through its tables: what a forward reads and writes on a server."""
        return list(self.kernel_comps)

    def physical_buffers(self) -> list[torch.Tensor]:
        """SGLang's own views the mirrors stand for (one shared byte buffer under them all)."""
        return [mirror.physical for mirror in self.mirrors]

    def push(self) -> None:
        """The harness's rows of every held virtual id to where SGLang's tables point now."""
        for mirror in self.mirrors:
            mirror.push()

    def pull(self) -> None:
        """Every held virtual id's row read back from where SGLang's tables point now."""
        for mirror in self.mirrors:
            mirror.pull()

    def notify_frees(self) -> None:
        """The scheduler's sync boundary (``flush_opportunistic``, whose errors the scheduler swallows),
        then every held row read back through the tables, then the frees reported."""
        try:
            self.sg_allocator.flush_opportunistic()
        except Exception:  # the scheduler's own try/except: pass (scheduler.py, event loop)
            pass
        self.pull()
        super().notify_frees()

    def flush_cache(self) -> None:
        self.push()
        super().flush_cache()

    @property
    def reference_factory(self):
        family = self

        def build(config, *, backup_mode, **capabilities):
            return UnifiedReference(config, backup_mode=backup_mode, family=family, **capabilities)

        return build


def _pushing(protocol_cls: type) -> type:
    """``protocol_cls`` whose every public operation first pushes the family's mirrors (the forward's
    rows reach SGLang's buffers before SGLang acts on them) and pulls them after."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            family = next((a for a in (*args, *kwargs.values()) if isinstance(a, UnifiedFamily)), None)
            if family is None:
                return fn(self, *args, **kwargs)
            family.push()
            try:
                return fn(self, *args, **kwargs)
            finally:  # what SGLang wrote (a cleared or copied state, a moved row) read back
                family.pull()

        return call

    ops = {name: wrap(fn) for name, fn in inspect.getmembers(protocol_cls, inspect.isfunction)
           if not name.startswith("_") and name != "standin"}
    return type(f"Unified{protocol_cls.__name__}", (protocol_cls,), {**ops, "__module__": __name__})


class _UnifiedServing(SGLangProtocol):
    """The protocol, with the prefill adder's joint budget before a request takes its state slots."""

    def _alloc_row_and_mamba(self, req, family, *, fill_len=None) -> None:
        sg = self.standin(req, family)
        if family.has_recurrent_state() and sg.mamba_pool_idx is None:
            family.admission.admit(family, sg)  # the adder's earlier terms first: a row, the mamba capacity
            # a request re-admitted with ``fill_len`` tokens (a resume) takes them in the same pass, billed in
            # whole pages as the adder bills KV (``ceil_paged_tokens``) and as the reference counts them
            slots = 1 + family.config.mamba_track_slots
            ps = family.config.page_size
            short = joint_short(family, mamba_slots=slots, tokens=-(-(fill_len or 0) // ps) * ps)
            if short is not None:
                raise short
        super()._alloc_row_and_mamba(req, family, fill_len=fill_len)


UnifiedProtocol = _pushing(_UnifiedServing)


def mirrored_component(m: Mirror, *, name: str, layer: int, space: str, cut=None,
                       translated: bool = True) -> tuple[Component, Component]:
    """A component as the harness's pools path reads it (``m``'s virtual-id mirror) and as the kernels address it
    (SGLang's physical view, its slot ids translated through SGLang's table where ``translated``; a mamba state's
    kernels are handed ids translated already, ``translate_mamba_indices``). ``cut``: the part of each row it is."""
    cut = cut or (lambda t: t)
    return (Component(name=name, layer=layer, space=space, tensor=cut(m.shadow)),
            Component(name=name, layer=layer, space=space, tensor=cut(m.physical),
                      translate=m.translate if translated else None))


def mirrored_kv(pool, layer_ids, space: str, allocator, *, held,
                latent_rank: int | None = None) -> tuple[list[Mirror], list[Component], list[Component]]:
    """K and V of each layer of a unified MHA sub-pool, as virtual-id mirrors of its physical views, the mirrored
    components and their kernel twins (``mirrored_component``). With ``latent_rank``, the sub-pool is MLA's: one
    latent row a layer, whose first ``latent_rank`` values are the compressed KV (``mla.latent``) and the rest the
    rope part (``mla.rope``)."""
    mirrors, comps, kernel = [], [], []
    slots = allocator.num_virtual_ids * allocator.pool_page_size
    if latent_rank is not None:
        for local, layer_id in enumerate(layer_ids):
            m = Mirror(shadow=shadow_like(pool.kv_buffer[local], slots), physical=pool.kv_buffer[local],
                       translate=token_translate(allocator), held=held)
            mirrors.append(m)
            for name, cut in (("mla.latent", lambda t: t[:, 0, :latent_rank]),
                              ("mla.rope", lambda t: t[:, 0, latent_rank:])):
                shadow, twin = mirrored_component(m, name=name, layer=layer_id, space=space, cut=cut)
                comps.append(shadow)
                kernel.append(twin)
        return mirrors, comps, kernel
    for local, layer_id in enumerate(layer_ids):
        for part, buffers in (("k", pool.k_buffer), ("v", pool.v_buffer)):
            m = Mirror(shadow=shadow_like(buffers[local], slots), physical=buffers[local],
                       translate=token_translate(allocator), held=held)
            mirrors.append(m)
            shadow, twin = mirrored_component(m, name=f"{space}.{part}", layer=layer_id, space=space)
            comps.append(shadow)
            kernel.append(twin)
    return mirrors, comps, kernel


def mirrored_state(req_pool, layer_ids, allocator) -> tuple[MambaPoolView, list[Mirror]]:
    """The unified Mamba pool's state tensors as virtual-id mirrors, each layer of each tensor (the view's
    ``kernel`` holds their kernel twins)."""
    view, mirrors = _MirroredMambaView(req_pool.mamba_pool, layer_ids), []
    for name, tensor in view.physical_tensors():
        for local, layer_id in enumerate(layer_ids):
            m = Mirror(shadow=shadow_like(tensor[local], allocator.num_virtual_ids), physical=tensor[local],
                       translate=req_pool.mamba_allocator.translate, held=functools.partial(held_slots, allocator))
            mirrors.append(m)
            shadow, twin = mirrored_component(m, name=name, layer=layer_id, space="mamba", translated=False)
            view.comps.append(shadow)
            view.kernel.append(twin)
    return view, mirrors


class _MirroredMambaView(MambaPoolView):
    """The MambaPool's state as virtual-id mirrors (``components``); ``physical_tensors`` are SGLang's."""

    def __init__(self, pool, layer_ids):
        super().__init__(pool, layer_ids)
        self.comps: list[Component] = []
        self.kernel: list[Component] = []

    def physical_tensors(self):
        return self.state_tensors()

    def components(self) -> list[Component]:
        return list(self.comps)


def prewarm_compaction(allocator) -> None:
    """What the scheduler does right after it builds a unified pool (0.5.23: ``prewarm_compaction``, the
    first compaction move made before serving). A release whose allocator has no such step (0.5.22) builds
    without it, as its scheduler does."""
    prewarm = getattr(allocator, "prewarm_compaction", None)
    if prewarm is not None:
        prewarm()


def kv_pool_view(api, kv_pool, comps, *, door) -> KVPoolView:
    """The harness's view of a unified KV pool, with the capabilities its CPU copy declares."""
    carries, declared = carries_mamba(api, kv_pool)
    view_cls = type(type(kv_pool).__name__, (KVPoolView,), {"cpu_copy_carries_mamba": carries,
                                                            "declared": declared, "__module__": __name__})
    return view_cls(kv_pool, comps, door=door)


def served_bundle(served):
    """The pools SGLang's configurator built for a unified server, in the shape of a unified factory's result."""
    return types.SimpleNamespace(req_to_token_pool=served.req_to_token_pool, token_to_kv_pool=served.token_to_kv_pool,
                                 token_to_kv_pool_allocator=served.allocator, unified_memory_pool=served.unified_buffer)
