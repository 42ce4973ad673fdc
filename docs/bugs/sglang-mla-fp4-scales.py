"""Reproducer: SGLang's FP4 MLA KV cache (MLATokenToKVPoolFP4) loses its block scales.

With an FP4 ``--kv-cache-dtype`` (``fp4_mx_block16``, or ``nvfp4``) an MLA model (DeepSeek-V2/V3 style, no DSA
indexer, no linear-attention layers) gets ``MLATokenToKVPoolFP4``: per layer the packed FP4 latent+rope row
(``kv_buffer``) and one scale byte per 16 values beside it (``kv_scale_buffer``). This script builds that pool
with SGLang's own ``KVCacheConfigurator._build_mla_fp4_kv_pool`` for a PD decode server
(``--disaggregation-mode decode --kv-cache-dtype fp4_mx_block16 --attention-backend flashinfer``; releases without
the configurator, before 0.5.16: the class ``ModelRunner._init_pools`` constructs, with its keywords), then

1. retraction: writes known bytes into both buffers for a 4-token request, backs it up as the decode scheduler
   does (``allocator.get_cpu_copy``), frees its slots, allocates new ones and restores
   (``allocator.load_cpu_copy``), and compares both buffers at the new slots;
2. speculative accept: moves 4 rows with ``move_kv_cache`` (what accepting a draft tree path does) and compares;
3. PD transfer: lists the buffers the PD transfer registers (``get_contiguous_buf_infos`` /
   ``get_kv_transfer_buf_infos`` and ``setup_state_kv_args``) and looks for the scale buffers among them.

Prints ``REPRODUCED: ...`` and exits 1 when scale rows are lost, ``NOT REPRODUCED`` (exit 0) when the release
carries them, ``NOT APPLICABLE: ...`` (exit 0) when the release has no MLATokenToKVPoolFP4. Exit 2: bad usage or
an environment that cannot run it.

    python sglang-mla-fp4-scales.py                 # CPU (default)
    python sglang-mla-fp4-scales.py --device cuda

Needs only torch, SGLang and the standard library. Without a GPU, SGLang's module-level ``triton`` and
``torchvision`` imports are served by inert stand-ins (below); nothing from them runs on these paths.
"""

import argparse
import contextlib
import dataclasses
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import sys
import traceback
import types

SLOTS, LAYERS, KV_LORA_RANK, QK_ROPE_HEAD_DIM, TOKENS = 32, 2, 512, 64, 4  # DeepSeek-V3's latent widths
STALE = 0xEE  # what the slots hold before the request lands there (an earlier request's rows)
BUFFERS = ("kv_buffer", "kv_scale_buffer")


def install_standins():
    """Where triton / torchvision do not import (no GPU), put permissive stand-in modules in their place."""

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            if name[:1].isupper():  # a class: subclassable, constructible, subscriptable
                value = type(name, (), {"__init__": lambda self, *a, **k: None,
                                        "__class_getitem__": classmethod(lambda cls, item: cls)})
            else:
                value = importlib.import_module(f"{self.__name__}.{name}")
            setattr(self, name, value)
            return value

        def __call__(self, *args, **kwargs):  # @triton.jit, @triton.autotune(...)
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else (lambda fn: fn)

        def __iter__(self):  # torch probes triton's backends: nothing here
            return iter(())

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        roots = set()

        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in self.roots:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            return Stub(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    for root in ("triton", "torchvision"):
        try:
            importlib.import_module(root)
        except Exception:  # missing, or a CUDA-linked wheel beside a CPU torch
            for mod in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
                del sys.modules[mod]
            Finder.roots.add(root)
    if not Finder.roots:
        return
    sys.meta_path.insert(0, Finder())
    if "triton" in Finder.roots:
        import triton.language
        triton.__version__ = "0.0.0"
        triton.cdiv = lambda a, b: -(a // -b)
        triton.next_power_of_2 = lambda n: 1 << max(n - 1, 0).bit_length()
        triton.language.constexpr = type("constexpr", (), {"__init__": lambda self, *a, **k: None})
    if "torchvision" in Finder.roots:  # transformers reads this enum's members
        import torchvision.transforms.functional
        torchvision.__version__ = "0.0.0"
        names = ("nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")
        mode = enum.Enum("InterpolationMode", {n.upper().replace("-", "_"): n for n in names})
        torchvision.transforms.InterpolationMode = torchvision.transforms.functional.InterpolationMode = mode


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the pool lives (default cpu)")
    return parser.parse_args(argv)


def publish_server_args(device, **flags):
    """ServerArgs for the server configuration, published where this release's code reads them (its runtime
    context, or the global server args before it had one). Flags this release does not know are left out."""
    from sglang.srt import server_args as sa

    known = getattr(sa.ServerArgs, "__struct_fields__", None) or [f.name for f in dataclasses.fields(sa.ServerArgs)]
    # model_path "none": no model to resolve (releases that resolve arguments at construction skip it then)
    args = sa.ServerArgs(model_path="none", device=device, **{k: v for k, v in flags.items() if k in known})
    try:
        from sglang.srt.runtime_context import get_context
        publish = get_context().set_server_args
    except (ImportError, AttributeError):  # releases whose runtime context does not hold the server args
        publish = sa.set_global_server_args_for_scheduler
    publish(args)
    return args


def single_rank():
    """The parallel topology of a one-GPU server (tp = pp = dcp = 1), where SGLang's code reads it."""
    try:
        from sglang.srt import runtime_context as rc
    except ImportError:  # releases before the runtime context: the pools read no topology
        return contextlib.nullcontext()
    wanted = dict(tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, attn_tp_size=1, attn_tp_rank=0, attn_dcp_size=1,
                  attn_dcp_rank=0)
    known = rc._parallel_fields() if hasattr(rc, "_parallel_fields") else getattr(rc, "_PARALLEL_FIELDS", wanted)
    return rc.get_parallel().override(**{k: v for k, v in wanted.items() if k in known})


def construct(cls, **kwargs):
    """cls(**kwargs) without the keywords this release's constructor does not take (releases differ)."""
    params = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in params})


def configurator(**fields):
    """A KVCacheConfigurator holding the fields its pool builders read (its other fields are not used there)."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    cfg = object.__new__(KVCacheConfigurator)
    for name, value in fields.items():
        try:
            setattr(cfg, name, value)
        except AttributeError:  # a field this release's configurator does not have
            pass
    return cfg


def pd_registered_ptrs(pool):
    """(number of main-KV buffers, data pointers of every buffer) a PD server registers for KV transfer: the
    main-KV listing plus the state components (setup_state_kv_args; before it, decode.py's get_state_buf_infos)."""
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base.conn import KVArgs

    listing = getattr(utils, "get_kv_transfer_buf_infos", None)
    ptrs = list((listing(pool) if listing else pool.get_contiguous_buf_infos())[0])
    if hasattr(utils, "setup_state_kv_args"):
        kv_args = KVArgs()
        utils.setup_state_kv_args(kv_args, pool)
        state = getattr(kv_args, "state_data_ptrs", [])
    else:
        state = pool.get_state_buf_infos()[0] if hasattr(pool, "get_state_buf_infos") else []

    def flat(items):
        for item in items:
            yield from (flat(item) if isinstance(item, (list, tuple)) else (item,))

    return len(ptrs), set(ptrs) | set(flat(state))


def build_pool(device, server_args):
    """The KV pool as this release builds it for an MLA model with an FP4 KV cache: KVCacheConfigurator's
    _build_mla_fp4_kv_pool; before the configurator, the MLATokenToKVPoolFP4 ModelRunner._init_pools constructs."""
    import torch
    from sglang.srt.mem_cache import memory_pool

    shape = dict(kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM)
    try:
        from sglang.srt.mem_cache import kv_cache_configurator  # noqa: F401
    except ImportError:
        return "ModelRunner._init_pools", construct(
            memory_pool.MLATokenToKVPoolFP4, size=SLOTS, page_size=1, dtype=torch.float4_e2m1fn_x2, layer_num=LAYERS,
            device=device, enable_memory_saver=False, start_layer=0, end_layer=LAYERS, **shape)
    cfg = configurator(device=device, kv_cache_dtype=torch.float4_e2m1fn_x2, kv_cache_dtype_str="fp4_mx_block16",
                       page_size=1, server_args=server_args, model_config=types.SimpleNamespace(**shape),
                       is_draft_worker=False,
                       use_mla_backend=True,
                       layer_info=types.SimpleNamespace(num_effective_layers=LAYERS, start_layer=0, end_layer=LAYERS))
    return "KVCacheConfigurator", cfg._build_mla_fp4_kv_pool(max_total_num_tokens=SLOTS)


def fill(pool, slots, gen, device):
    """Write known bytes into every buffer at the slots; return what was written."""
    import torch

    written = {}
    for name in BUFFERS:
        for layer, buf in enumerate(getattr(pool, name)):
            rows = buf.view(torch.uint8)[slots]
            data = torch.randint(0, 200, rows.shape, generator=gen, dtype=torch.uint8).to(device)  # never STALE
            buf.view(torch.uint8)[slots] = data
            written[name, layer] = data
    return written


def compare(pool, slots, written):
    """{buffer: [(layer, slots whose rows differ from what was written)]}"""
    import torch

    lost = {}
    for (name, layer), data in written.items():
        bad = int((getattr(pool, name)[layer].view(torch.uint8)[slots] != data).flatten(1).any(dim=-1).sum())
        if bad:
            lost.setdefault(name, []).append((layer, bad))
    return lost


def check_retraction(pool, device, gen):
    """Back up a request's KV as Req.offload_kv_cache does, restore it into new slots as Req.load_kv_cache does."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    for name in BUFFERS:
        for layer in getattr(pool, name):
            layer.view(torch.uint8).fill_(STALE)
    allocator = TokenToKVPoolAllocator(SLOTS, pool.dtype, device, pool, need_sort=True)  # need_sort: a PD server
    old = allocator.alloc(TOKENS)
    written = fill(pool, old, gen, device)
    backup = allocator.get_cpu_copy(old)  # retraction: Req.offload_kv_cache
    allocator.free(old)
    new = allocator.alloc(TOKENS)  # resume: new slots
    assert not set(old.tolist()) & set(new.tolist())
    allocator.load_cpu_copy(backup, new)  # Req.load_kv_cache
    return compare(pool, new, written)


def check_move(pool, device, gen):
    """move_kv_cache(tgt, src), as accepting a speculative draft path moves the accepted rows; None if absent."""
    import torch

    if not hasattr(pool, "move_kv_cache"):
        return None
    src = torch.arange(20, 20 + TOKENS, device=device)
    tgt = torch.arange(10, 10 + TOKENS, device=device)
    written = fill(pool, src, gen, device)
    try:
        pool.move_kv_cache(tgt, src)
    except NotImplementedError:  # a release whose MLA pool has no row move
        return None
    return compare(pool, tgt, written)


def check_pd_registration(pool):
    """What the PD transfer misses of the pool's buffers, or None if it registers them all."""
    try:
        _, registered = pd_registered_ptrs(pool)
    except Exception as exc:
        return f"PD registration raises {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    kv = [b.data_ptr() for b in pool.kv_buffer]
    scales = [b.data_ptr() for b in pool.kv_scale_buffer]
    kv_listed, listed = sum(p in registered for p in kv), sum(p in registered for p in scales)
    if kv_listed == len(kv) and listed == len(scales):
        return None
    return (f"PD transfer registers {kv_listed} of {len(kv)} kv_buffer entries and {listed} of {len(scales)} "
            "kv_scale_buffer entries")


def describe(lost):
    parts = []
    for name, per_layer in lost.items():
        layers = ",".join(str(layer) for layer, _ in per_layer)
        parts.append(f"{name} (layers {layers}: {max(bad for _, bad in per_layer)} of {TOKENS} slots)")
    return "; ".join(parts)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but this torch sees no usable CUDA device", file=sys.stderr)
        return 2
    if not hasattr(torch, "float4_e2m1fn_x2"):
        print(f"error: torch {torch.__version__} has no float4_e2m1fn_x2 (SGLang's FP4 KV dtype)", file=sys.stderr)
        return 2
    if args.device == "cpu" and not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None  # some releases call it unconditionally; CPU work is synchronous
    install_standins()
    try:
        version = importlib.metadata.version("sglang")
        from sglang.srt.mem_cache import memory_pool
    except Exception as exc:
        print(f"error: cannot import SGLang here ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if not hasattr(memory_pool, "MLATokenToKVPoolFP4"):
        print(f"NOT APPLICABLE: SGLang {version} has no MLATokenToKVPoolFP4")
        return 0
    server_args = publish_server_args(args.device, kv_cache_dtype="fp4_mx_block16", attention_backend="flashinfer",
                                      page_size=1, disaggregation_mode="decode")
    gen = torch.Generator().manual_seed(0)
    with single_rank():
        built_by, pool = build_pool(args.device, server_args)
        lost = check_retraction(pool, args.device, gen)
        moved = check_move(pool, args.device, gen)
        pd_missing = check_pd_registration(pool)
    findings = [f"retraction (get_cpu_copy/load_cpu_copy) restored stale rows of {describe(lost)}"] if lost else []
    findings += [f"move_kv_cache left stale rows of {describe(moved)}"] if moved else []
    findings += [pd_missing] if pd_missing else []
    where = f"SGLang {version}, {type(pool).__name__} as {built_by} builds it, {args.device}"
    if findings:
        print(f"REPRODUCED: {'; '.join(findings)} [{where}]")
        return 1
    print(f"NOT REPRODUCED: retraction, move_kv_cache and PD registration carry the FP4 scales [{where}]")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # never let a failure of the script itself read as a verdict (exit 1)
        traceback.print_exc()
        print("error: the reproducer failed before reaching a verdict (traceback above)", file=sys.stderr)
        sys.exit(2)
