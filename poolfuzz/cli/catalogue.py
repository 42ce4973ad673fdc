"""``poolfuzz configs`` and ``poolfuzz faults``: what can be fuzzed and which bugs can be switched on."""

from __future__ import annotations

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.faults import FAULTS, applicable_configs


def register(sub) -> None:
    p = sub.add_parser("configs", help="list the built-in model configs, or print one as TOML")
    p.add_argument("--show", metavar="NAME",
                   help="print config NAME as TOML, every field written out: edit it and pass it to "
                        "poolfuzz run --config-file FILE.toml")
    p.add_argument("--family", metavar="NAME",
                   help="also print, per config, the server it stands for on that family's engine: its flags and "
                        "the pools the engine's own configurator builds for it here, beside the family's")
    p.add_argument("--server-dir", metavar="DIR",
                   help="with --family and --show NAME: write the model's config.json for NAME's server to DIR and "
                        "print the engine's command that launches that server (random weights) on a GPU")
    p.set_defaults(handler=_configs)
    p = sub.add_parser("faults", help="list the fault catalogue")
    p.set_defaults(handler=_faults)
    p = sub.add_parser("checks", help="list the checks a failure signature names (and --waive takes)")
    p.set_defaults(handler=_checks)


def _configs(args) -> int:
    from poolfuzz.errors import UsageError

    if getattr(args, "server_dir", None) and not (args.family and args.show):
        raise UsageError("--server-dir writes the server of one config: give it with --family NAME and --show CONFIG")
    if getattr(args, "family", None) and getattr(args, "show", None):
        from poolfuzz.pools.config import get_config

        config = get_config(args.show)
        described = _describing_family(args.family).describe_server(config)
        print(config.name)
        _print_server(described)
        if args.server_dir:
            _write_server(described, args.server_dir)
        return 0
    if getattr(args, "show", None):
        from poolfuzz.pools.config import get_config
        from poolfuzz.pools.config_file import to_toml

        print(to_toml(get_config(args.show)), end="")
        return 0
    plugin = _describing_family(args.family) if getattr(args, "family", None) else None
    for name, c in CONFIGS.items():
        print(f"{name:20} {c.architecture:12} page_size={c.page_size} full={c.full_layers} "
              f"swa={c.swa_layers} mamba={c.mamba_layers} kv={c.kv_dtype}")
        if plugin is not None:
            _print_server(plugin.describe_server(c))
    print(f"{'random':20} {'(drawn)':12} a config Hypothesis draws in every example: poolfuzz run --config random")
    return 0


def _describing_family(name: str):
    """The family plug-in ``name``, which must describe the servers its configs stand for."""
    from poolfuzz.errors import UsageError
    from poolfuzz.orchestration.plugins import resolve_family
    from poolfuzz.pools.capabilities import factory_capabilities

    plugin = resolve_family(name)
    if factory_capabilities(plugin.factory).describe_server is None:
        raise UsageError(f"family {name!r} describes no server for its configs (drop --family, or name a family "
                         "whose factory declares describe_server, such as sglang:scheduler)")
    plugin.check_engine()
    return plugin


def _write_server(d, directory: str) -> None:
    """The server's model as DIR/config.json, and the command that launches it."""
    import json
    import os
    import shlex

    from poolfuzz.errors import UsageError

    if d.model is None:
        raise UsageError(f"no server to write: {d.refused}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as fh:
            json.dump(d.model, fh, indent=1, sort_keys=True)
            fh.write("\n")
    except OSError as exc:
        raise UsageError(f"cannot write {directory}/config.json ({exc.strerror}); name a directory you can write") from None
    print(f"wrote {os.path.join(directory, 'config.json')}; launch the server on a GPU with:")
    print(f"  {d.command(shlex.quote(os.path.abspath(directory)))}")


def _print_server(d) -> None:
    indent = " " * 4
    if d.flags:
        print(f"{indent}server flags: {d.flags}")
    if d.environment:
        print(f"{indent}server environment: {d.environment}")
    for note in d.notes:
        print(f"{indent}note: {note}")
    if d.built is None:
        print(f"{indent}{d.built_by}: {d.refused}")
    else:
        print(f"{indent}{d.built_by} built:")
        for part, what in d.built.items():
            print(f"{indent}  {part:14} {what}")
    if d.family_crashes is not None:
        print(f"{indent}family: crashes at startup ({d.family_crashes}; poolfuzz run reports it as a failure)")
    elif d.family is None:
        print(f"{indent}family: declines ({d.family_declines})")
    elif d.built is None:
        print(f"{indent}family builds:")
        for part, what in d.family.items():
            print(f"{indent}  {part:14} {what}")
    else:
        differs = {p: w for p, w in d.family.items() if d.built.get(p) != w}
        extra = [p for p in d.built if p not in d.family and p not in d.unfuzzed]
        if not differs and not extra:
            print(f"{indent}family runs on them")
        for part, what in differs.items():
            print(f"{indent}family differs: {part:14} {what}")
        for part in extra:
            print(f"{indent}family differs: {part:14} (none)")


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
