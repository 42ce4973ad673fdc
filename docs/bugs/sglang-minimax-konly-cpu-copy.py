"""Reproducer: a PD decode server with MiniMax-M3 sparse attention crashes on its first retraction.

A MiniMax-M3 model whose sparse layers keep index keys only (``sparse_disable_index_value``) gets a
``MiniMaxSparseKVPool`` (main K/V plus a K-only index pool, ``MHATokenToKOnlyPool``). The pool has no
``get_cpu_copy`` / ``load_cpu_copy`` of its own, so ``KVCache``'s, which raise ``NotImplementedError``, serve the
``cpu_tensor`` retraction backup of a PD decode server. This script, with SGLang's own code,

1. builds the pool as ``KVCacheConfigurator._build_minimax_sparse_kv_pool`` does for such a model (layers:
   dense, K-only sparse, dense, K-only sparse) on a PD decode server (``--disaggregation-mode decode``; releases
   without the configurator, before 0.5.16: as ``ModelRunner._init_pools`` constructs it);
2. asks ``kv_cache_builder.resolve_decode_retraction_backup`` which backup that server uses (no flag given);
3. checks that the PD registration (``setup_state_kv_args``) accepts the pool, so the server starts;
4. backs up a 4-token request as ``Req.offload_kv_cache`` does (``allocator.get_cpu_copy``); if that works (a
   release with a CPU copy), restores it into new slots and compares main K/V and index K.

Prints ``REPRODUCED: ...`` and exits 1 when the backup raises or loses data, ``NOT REPRODUCED`` (exit 0) when
it round-trips, ``NOT APPLICABLE: ...`` (exit 0) when the release has no MiniMaxSparseKVPool. Exit 2: bad usage
or an environment that cannot run it.

    python sglang-minimax-konly-cpu-copy.py                 # CPU (default)
    python sglang-minimax-konly-cpu-copy.py --device cuda

Needs only torch, SGLang and the standard library (transformers comes with SGLang). Without a GPU, SGLang's
module-level ``triton`` and ``torchvision`` imports are served by inert stand-ins (below); nothing from them runs
on these paths.
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

SLOTS, TOKENS, HEADS, HEAD_DIM, INDEX_DIM = 32, 4, 2, 128, 128
SPARSE_FREQ = [0, 1, 0, 1]  # layer kinds: 0 dense, else sparse
DISABLE_INDEX_VALUE = [0, 1, 0, 1]  # the sparse layers keep index keys only
STALE = 0xEE


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


def model_config():
    """The parts of a MiniMax-M3 ModelConfig the configurator reads: its HF config's sparse-attention section."""
    from transformers import PretrainedConfig

    hf_config = PretrainedConfig(architectures=["MiniMaxM3SparseForCausalLM"], sparse_attention_config=dict(
        sparse_attention_freq=SPARSE_FREQ, sparse_disable_index_value=DISABLE_INDEX_VALUE,
        sparse_index_dim=INDEX_DIM))
    return types.SimpleNamespace(hf_config=hf_config, quantization=None, head_dim=HEAD_DIM, is_draft_model=False,
                                 linear_attn_registry_result=None, get_num_kv_heads=lambda *a: HEADS)


def build_pool(device, server_args, config):
    """The KV pool as this release builds it for a MiniMax sparse model: KVCacheConfigurator's
    _build_minimax_sparse_kv_pool; before the configurator, the MiniMaxSparseKVPool ModelRunner._init_pools
    constructs, with its keywords."""
    import torch
    from sglang.srt.mem_cache import memory_pool

    layers = len(SPARSE_FREQ)
    try:
        from sglang.srt.mem_cache import kv_cache_configurator  # noqa: F401
    except ImportError:
        sparse = [i for i, f in enumerate(SPARSE_FREQ) if f]
        return "ModelRunner._init_pools", construct(
            memory_pool.MiniMaxSparseKVPool, size=SLOTS, page_size=1, dtype=torch.bfloat16, index_dtype=torch.bfloat16,
            head_num=HEADS, head_dim=HEAD_DIM, idx_head_dim=INDEX_DIM, sparse_layer_ids=sparse,
            dense_layer_ids=[i for i in range(layers) if i not in sparse],
            disable_value_sparse_layer_ids=[i for i, f in enumerate(DISABLE_INDEX_VALUE) if f], device=device,
            enable_memory_saver=False, start_layer=0, end_layer=layers)
    cfg = configurator(device=device, kv_cache_dtype=torch.bfloat16, model_dtype=torch.bfloat16, page_size=1,
                       server_args=server_args, model_config=config, is_draft_worker=False,
                       layer_info=types.SimpleNamespace(num_effective_layers=layers, start_layer=0, end_layer=layers))
    return "KVCacheConfigurator", cfg._build_minimax_sparse_kv_pool(max_total_num_tokens=SLOTS)


def default_backup(allocator, config):
    """The retraction backup SGLang resolves for this decode server when no flag names one (or why unknown)."""
    try:
        from sglang.srt.mem_cache.kv_cache_builder import resolve_decode_retraction_backup
    except ImportError:  # before the choice existed a PD decode server always backed up to CPU tensors
        return "cpu_tensor, the only backup of this release"
    runner = types.SimpleNamespace(mtp_draft_device_pools=[], model_config=config, spec_algorithm=None)
    worker = types.SimpleNamespace(get_memory_pool=lambda: (None, allocator), is_hybrid_swa=False,
                                   model_runner=runner)
    try:
        return resolve_decode_retraction_backup(tp_worker=worker)
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"


def pd_registration_refusal(pool):
    """None if the PD registration accepts the pool, else its refusal."""
    try:
        pd_registered_ptrs(pool)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def buffers(pool):
    """(name, layer, tensor) for every buffer a request's KV lives in."""
    out = [("main k_buffer", i, b) for i, b in enumerate(pool.main_pool.k_buffer)]
    out += [("main v_buffer", i, b) for i, b in enumerate(pool.main_pool.v_buffer)]
    for sub in ("index_kv_pool", "index_k_pool"):
        part = getattr(pool, sub, None)
        for name in ("k_buffer", "v_buffer"):
            out += [(f"{sub} {name}", i, b) for i, b in enumerate(getattr(part, name, None) or [])]
    return out


def check_retraction(pool, allocator, device):
    """Back up a request's KV as Req.offload_kv_cache does and restore it into new slots as Req.load_kv_cache does.
    Returns (what was raised, {buffer: [(layer, bad slots)]})."""
    import torch

    for _, _, buf in buffers(pool):
        buf.view(torch.uint8).fill_(STALE)
    old = allocator.alloc(TOKENS)
    gen = torch.Generator().manual_seed(0)
    written = {}
    for name, layer, buf in buffers(pool):
        rows = buf.view(torch.uint8)[old]
        written[name, layer] = torch.randint(0, 200, rows.shape, generator=gen, dtype=torch.uint8).to(device)
        buf.view(torch.uint8)[old] = written[name, layer]
    try:
        backup = allocator.get_cpu_copy(old)  # retraction: Req.offload_kv_cache
    except NotImplementedError as exc:
        return f"NotImplementedError{f'({exc})' if str(exc) else ''} from {type(pool).__name__}.get_cpu_copy", {}
    allocator.free(old)
    new = allocator.alloc(TOKENS)
    try:
        allocator.load_cpu_copy(backup, new)  # resume: Req.load_kv_cache
    except NotImplementedError as exc:
        return f"NotImplementedError{f'({exc})' if str(exc) else ''} from {type(pool).__name__}.load_cpu_copy", {}
    lost = {}
    by_key = {(name, layer): buf for name, layer, buf in buffers(pool)}
    for key, data in written.items():
        bad = int((by_key[key].view(torch.uint8)[new] != data).flatten(1).any(dim=-1).sum())
        if bad:
            lost.setdefault(key[0], []).append((key[1], bad))
    return None, lost


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but this torch sees no usable CUDA device", file=sys.stderr)
        return 2
    if args.device == "cpu" and not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None  # some releases call it unconditionally; CPU work is synchronous
    install_standins()
    try:
        version = importlib.metadata.version("sglang")
        from sglang.srt.mem_cache import memory_pool
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    except Exception as exc:
        print(f"error: cannot import SGLang here ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if not hasattr(memory_pool, "MiniMaxSparseKVPool"):
        print(f"NOT APPLICABLE: SGLang {version} has no MiniMaxSparseKVPool (no MiniMax-M3 sparse attention)")
        return 0
    server_args = publish_server_args(args.device, page_size=1, disaggregation_mode="decode")
    config = model_config()
    with single_rank():
        built_by, pool = build_pool(args.device, server_args, config)
        allocator = TokenToKVPoolAllocator(SLOTS, pool.dtype, args.device, pool, need_sort=True)
        backend = default_backup(allocator, config)
        refusal = pd_registration_refusal(pool)
        raised, lost = check_retraction(pool, allocator, args.device)
    layers = f"{len(pool.main_pool.k_buffer)} main K/V layers, {len(pool.index_k_pool.k_buffer)} K-only index layers"
    where = f"SGLang {version}, {type(pool).__name__} ({layers}) as {built_by} builds it, {args.device}"
    if refusal:
        print(f"NOT REPRODUCED: PD registration refuses this pool, so no PD decode server holds it ({refusal}) "
              f"[{where}]")
        return 0
    if raised:
        print(f"REPRODUCED: the cpu_tensor retraction backup of a {TOKENS}-token request raises {raised}; nothing "
              f"of its KV is backed up (default backup for this pool on a PD decode server: {backend}) [{where}]")
        return 1
    if lost:
        parts = "; ".join(f"{name} (layers {','.join(str(layer) for layer, _ in per_layer)}: "
                          f"{max(bad for _, bad in per_layer)} of {TOKENS} slots)" for name, per_layer in lost.items())
        print(f"REPRODUCED: cpu_tensor retraction backup restored stale rows of {parts} [{where}]")
        return 1
    print(f"NOT REPRODUCED: cpu_tensor retraction backup round-trips main K/V and index K [{where}]")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # never let a failure of the script itself read as a verdict (exit 1)
        traceback.print_exc()
        print("error: the reproducer failed before reaching a verdict (traceback above)", file=sys.stderr)
        sys.exit(2)
