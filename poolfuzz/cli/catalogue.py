"""``poolfuzz configs`` and ``poolfuzz faults``: what can be fuzzed and which bugs can be switched on."""

from __future__ import annotations

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.faults import FAULTS, applicable_configs


def register(sub) -> None:
    p = sub.add_parser("configs", help="list the built-in model configs, or print one as TOML")
    p.add_argument("--show", metavar="NAME",
                   help="print config NAME as TOML, every field written out: edit it and pass it to "
                        "poolfuzz run --config-file FILE.toml")
    p.set_defaults(handler=_configs)
    p = sub.add_parser("faults", help="list the fault catalogue")
    p.set_defaults(handler=_faults)
    p = sub.add_parser("checks", help="list the checks a failure signature names (and --waive takes)")
    p.set_defaults(handler=_checks)


def _configs(args) -> int:
    if getattr(args, "show", None):
        from poolfuzz.pools.config import get_config
        from poolfuzz.pools.config_file import to_toml

        print(to_toml(get_config(args.show)), end="")
        return 0
    for name, c in CONFIGS.items():
        print(f"{name:20} {c.architecture:12} page_size={c.page_size} full={c.full_layers} "
              f"swa={c.swa_layers} mamba={c.mamba_layers} kv={c.kv_dtype}")
    print(f"{'random':20} {'(drawn)':12} a config Hypothesis draws in every example: poolfuzz run --config random")
    return 0


def _faults(args) -> int:
    for f in FAULTS.values():
        print(f"{f.id:34} {f.upstream:16} {f.description}")
        print(f"{'':34} applies to: {', '.join(applicable_configs(f.id))}")
    return 0


def _checks(args) -> int:
    from poolfuzz.harness.failures import CHECKS, WAIVABLE

    for name, what in CHECKS.items():
        print(f"{name:16} {'waivable' if name in WAIVABLE else '        '}  {what}")
    return 0
