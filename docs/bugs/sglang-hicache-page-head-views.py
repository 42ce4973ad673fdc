"""Reproducer: a HiCache host pool on the ``page_head`` layout with fewer pages than the model has layers.

SGLang's MHA host pool (``MHATokenToKVPoolHost``) lays ``page_head`` out as ``(2, page_num, head_num, page_size,
layer_num, head_dim)``, but builds its per-layer transfer views as ``k_buffer[i] for i in range(layer_num)``, which
walks the page axis. This script, with SGLang's own code,

1. builds a 3-layer ``MHATokenToKVPool`` of 2 token slots on 2-token pages (a paged MHA server's device pool);
2. builds its host pool as a HiCache server with ``--hicache-mem-layout page_head --hicache-ratio 1.25`` does
   (``int(2 * 1.25) // 2 + 1`` = 2 pages; from 0.5.23 through ``hybrid_pool_assembler._mha_host_inputs``);
3. where that does not raise, checks whether the per-layer views are layers.

Prints ``REPRODUCED: ...`` and exits 1 when the build raises or a view is not a layer, ``NOT REPRODUCED`` (exit 0)
when the views are layers, ``NOT APPLICABLE: ...`` (exit 0) when the release has no ``page_head`` layout. Exit 2:
bad usage or an environment that cannot run it.

    python sglang-hicache-page-head-views.py                 # CPU (default)
    python sglang-hicache-page-head-views.py --device cuda   # the device pool on the GPU

Needs only torch, SGLang and the standard library. Without a GPU, SGLang's module-level ``triton`` and
``torchvision`` imports are served by inert stand-ins (below); nothing from them runs on this path.
"""

import argparse
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import sys
import traceback
import types

LAYERS, TOKENS, PAGE, HEADS, HEAD_DIM, RATIO = 3, 2, 2, 1, 12, 1.25

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




def construct(cls, **kwargs):
    """``cls(**kwargs)`` with only the keywords this release's constructor takes (they moved between releases)."""
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in accepted})


def host_pool_class():
    for module in ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.memory_pool_host"):
        try:
            return importlib.import_module(module).MHATokenToKVPoolHost
        except (ImportError, AttributeError):
            continue
    return None


def build_host_pool(device_pool):
    """The host pool a HiCache server builds over ``device_pool`` (``--hicache-mem-layout page_head``)."""
    try:
        assembler = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
        inputs = getattr(assembler, "_mha_host_inputs", None)
    except ImportError:
        inputs = None
    if inputs is not None:  # 0.5.23: the host pool takes the device pool's buffer description
        cls, info, kwargs = inputs(device_pool)
        return cls(info, RATIO, 0, PAGE, "page_head", pin_memory=False, device="cpu", **kwargs)
    return host_pool_class()(device_pool, RATIO, 0, PAGE, "page_head", pin_memory=False, device="cpu")


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but this torch sees no usable CUDA device", file=sys.stderr)
        return 2
    install_standins()
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        version = importlib.metadata.version("sglang")
    except Exception as exc:  # noqa: BLE001 - a broken install is not a verdict
        print(f"error: cannot import SGLang here ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    host_cls = host_pool_class()
    if host_cls is None or "page_head" not in inspect.getsource(sys.modules[host_cls.__module__]):
        print(f"NOT APPLICABLE: SGLang {version} has no MHA host pool with a page_head layout")
        return 0
    device_pool = construct(MHATokenToKVPool, size=TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                            head_dim=HEAD_DIM, layer_num=LAYERS, device=args.device, enable_memory_saver=False,
                            start_layer=0, end_layer=LAYERS)
    where = (f"SGLang {version}, {LAYERS} layers, {TOKENS} device tokens on {PAGE}-token pages, --hicache-ratio "
             f"{RATIO}, page_head, {args.device}")
    try:
        host = build_host_pool(device_pool)
    except IndexError as exc:
        print(f"REPRODUCED: building the page_head host pool raises IndexError: {exc} (its per-layer views walk the "
              f"page axis; {int(TOKENS * RATIO) // PAGE + 1} pages, {LAYERS} layers) [{where}]")
        return 1
    views = getattr(host, "k_data_refs", None)
    layer_view = tuple(host.k_buffer[..., 0, :].shape)
    if views and tuple(views[0].shape) != layer_view:
        print(f"REPRODUCED: the host pool's view of layer 0 has shape {tuple(views[0].shape)}, a page, not the "
              f"layer's {layer_view} [{where}]")
        return 1
    print(f"NOT REPRODUCED: the page_head host pool builds, its per-layer views are layers [{where}]")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # never let a failure of the script itself read as a verdict (exit 1)
        traceback.print_exc()
        print("error: the reproducer failed before reaching a verdict (traceback above)", file=sys.stderr)
        sys.exit(2)
