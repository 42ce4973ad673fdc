"""Artifacts are untrusted input: replay and emit-test never run code a file names, and refuse malformed files."""

import ast
import json
import os
import sys

import pytest
from programs import FAULT_35957, PROGRAM_35957

from poolfuzz.cli import run_cli
from poolfuzz.orchestration.artifacts import dumps, from_program

FAULT, PROGRAM = FAULT_35957, PROGRAM_35957
# Statements a test module from emit-test may hold inside its one test function: engine calls.
ENGINE_CALLS = {"check", "sweep", "drain", "admit", "prefill", "decode", "decode_speculative", "evict_swa",
                "retract", "resume", "abort", "finish", "transfer", "fork"}


@pytest.fixture(scope="module")
def base_json():
    return json.loads(dumps(from_program("swa-ssm", PROGRAM, faults=[FAULT])))


def _write(tmp_path, raw, name="a.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw) if not isinstance(raw, str) else raw)
    return path


def _argv(command, path, tmp_path, *extra):
    out = tmp_path / "test_emitted.py"
    return [command, str(path), *(["-o", str(out)] if command == "emit-test" else ["--device", "cpu"]),
            *extra]


def _is_literal(node) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def assert_only_expected_statements(source: str) -> None:
    """The emitted module is a docstring, imports, literal assignments, one DEVICE lookup and one test
    function of engine calls with literal arguments: nothing a crafted artifact could add runs."""
    tree = ast.parse(source)
    body = list(tree.body)
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    assert isinstance(body[0].value.value, str)
    functions = [n for n in body if isinstance(n, ast.FunctionDef)]
    assert len(functions) == 1 and functions[0].name.startswith("test_") and not functions[0].decorator_list
    for node in body[1:]:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef)):
            continue
        assert isinstance(node, ast.Assign) and len(node.targets) == 1, ast.dump(node)
        name = node.targets[0].id
        if name == "DEVICE":
            assert ast.unparse(node.value) == "os.environ.get('POOLFUZZ_DEVICE', 'cpu')"
        else:
            assert _is_literal(node.value), ast.unparse(node)
    fn = functions[0]
    assert not fn.args.args and ast.unparse(fn.body[0].targets[0]) == "engine"
    engine_call = fn.body[0].value
    assert ast.unparse(engine_call.func) == "Engine"
    for kw in engine_call.keywords:
        value = ast.unparse(kw.value)
        assert (kw.arg, value) in {("config", "get_config(CONFIG)"), ("device", "DEVICE"), ("faults", "FAULTS"),
                                   ("backup_mode", "BACKUP_MODE"),
                                   ("family_factory", "resolve_family(FAMILY).factory")} or (
            kw.arg == "options" and ast.unparse(kw.value.func) == "EngineOptions"
            and all(_is_literal(k.value) for k in kw.value.keywords)), value
    for stmt in fn.body[1:]:
        assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call), ast.unparse(stmt)
        call = stmt.value
        assert ast.unparse(call.func.value) == "engine" and call.func.attr in ENGINE_CALLS, ast.unparse(stmt)
        assert not call.args and all(_is_literal(k.value) for k in call.keywords), ast.unparse(stmt)


# ------------------------------------------------------------------------------------------
# 1. emit-test: every artifact value reaches the module as a literal; the module always compiles
# ------------------------------------------------------------------------------------------
INJECT = 'x\n"""\nimport pathlib; pathlib.Path(SENTINEL).write_text("pwned")\n"""\n'


@pytest.mark.parametrize("field", ["device", "status", "poolfuzz_version", "hypothesis_version", "failure",
                                   "outcome", "file name"])
def test_a_crafted_field_cannot_inject_code_into_the_emitted_test(field, base_json, tmp_path, monkeypatch):
    sentinel = tmp_path / "pwned"
    payload = INJECT.replace("SENTINEL", repr(str(sentinel)))
    raw = json.loads(json.dumps(base_json))
    name = "a.json"
    if field == "outcome":
        raw["program"][0]["outcome"] = payload
        raw["program"][-1]["outcome"] = payload  # the failing step's comment too
    elif field == "file name":
        name = 'x\nimport pathlib; pathlib.Path("pwned").write_text("pwned")\n#.json'  # run in tmp_path
    else:
        raw[field] = payload
    path = _write(tmp_path, raw, name)
    out = tmp_path / "test_emitted.py"
    assert run_cli(["emit-test", str(path), "-o", str(out)]) == 0
    source = out.read_text()
    compile(source, str(out), "exec")
    assert_only_expected_statements(source)
    monkeypatch.chdir(tmp_path)
    exec(compile(source, str(out), "exec"), {"__name__": "emitted"})  # import time: the test does not run
    assert not sentinel.exists()


@pytest.mark.parametrize("text", ["back\\slash \\N{x} \\", 'quote"', 'end with quotes """', "tab\there",
                                  "nul\x00byte", "line\rsep\u2028x", "lone \ud800 surrogate", "emoji \U0001F600"])
def test_any_failure_text_gives_a_module_that_compiles_and_keeps_the_text(text, base_json, tmp_path):
    raw = json.loads(json.dumps(base_json))
    raw["failure"] = raw["device"] = raw["program"][-1]["outcome"] = raw["program"][0]["outcome"] = text
    path = _write(tmp_path, raw)
    out = tmp_path / "test_emitted.py"
    assert run_cli(["emit-test", str(path), "-o", str(out)]) == 0
    source = out.read_text(encoding="utf-8")
    assert_only_expected_statements(source)
    assert text in ast.get_docstring(ast.parse(source), clean=False)


# ------------------------------------------------------------------------------------------
# 2. An artifact's family is resolved only when installed or named on the command line
# ------------------------------------------------------------------------------------------
@pytest.fixture
def sentinel_module(tmp_path, monkeypatch):
    """A module that writes a file when imported and has a working family factory."""
    sentinel = tmp_path / "imported"
    (tmp_path / "sentinel_families.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(sentinel)!r}).write_text('imported')\n"
        "from poolfuzz.pools.family import build_family as factory\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sentinel_families", raising=False)
    return sentinel


@pytest.mark.parametrize("command", ["replay", "emit-test"])
@pytest.mark.parametrize("family", ["sentinel_families:factory", "this:s", "os:system"])
def test_an_artifact_never_chooses_which_code_runs(command, family, base_json, sentinel_module, tmp_path, capsys):
    path = _write(tmp_path, {**base_json, "family": family})
    assert run_cli(_argv(command, path, tmp_path)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and f"--family {family}" in err and "not installed" in err
    assert "Beautiful is better" not in captured.out  # `import this` never ran
    assert not sentinel_module.exists() and "sentinel_families" not in sys.modules
    assert not (tmp_path / "test_emitted.py").exists()


@pytest.mark.parametrize("command, code", [("replay", 1), ("emit-test", 0)])
def test_a_family_named_on_the_command_line_is_trusted(command, code, base_json, sentinel_module, tmp_path):
    family = "sentinel_families:factory"
    path = _write(tmp_path, {**base_json, "family": family})
    assert run_cli(_argv(command, path, tmp_path, "--family", family)) == code
    if command == "emit-test":
        assert f"FAMILY = {family!r}" in (tmp_path / "test_emitted.py").read_text()
    else:
        assert sentinel_module.exists()  # imported: the user chose it


def test_a_different_trusted_family_does_not_trust_the_artifacts(base_json, sentinel_module, tmp_path, capsys):
    path = _write(tmp_path, {**base_json, "family": "sentinel_families:factory"})
    assert run_cli(_argv("replay", path, tmp_path, "--family", "poolfuzz.pools.family:build_family")) == 2
    assert "recorded on pool family 'sentinel_families:factory'" in capsys.readouterr().err
    assert not sentinel_module.exists()


@pytest.mark.parametrize("family", ["builtin", "sglang"])
def test_shipped_families_need_no_trust(family, base_json, tmp_path):
    path = _write(tmp_path, {**base_json, "family": family})
    code = run_cli(_argv("emit-test", path, tmp_path))
    assert code == 0 or (family == "sglang" and code == 2)  # 2: SGLang is not installed here


# ------------------------------------------------------------------------------------------
# 6. Every step argument and field is type-checked before anything runs
# ------------------------------------------------------------------------------------------
def _step(i, **args):
    def mutate(raw):
        raw["program"][i]["args"].update(args)
    return mutate


MALFORMED = {
    "rid-list": (_step(1, rid=[1]), "argument rid=[1] must be an int"),
    "prompt-len-str": (_step(0, prompt_len="5"), "argument prompt_len='5' must be an int"),
    "negative-chunk": (_step(1, chunk=-3), "argument chunk=-3 must be an int from 1"),
    "bool-rid": (_step(2, rid=True), "argument rid=True must be an int"),
    "float-len": (_step(0, prompt_len=1.0), "argument prompt_len=1.0 must be an int"),
    "huge-len": (_step(0, prompt_len=10**30), "must be an int from 1 to"),
    "bad-node": (_step(3, node="gpu"), "argument node='gpu' must be one of prefill, decode"),
    "empty-decode": (lambda r: r["program"].insert(2, {"op": "decode", "args": {"rids": []}}),
                     "must be a non-empty list"),
    "decode-str": (lambda r: r["program"].insert(2, {"op": "decode", "args": {"rids": ["1"]}}), "holds '1'"),
    "outcome-dict": (lambda r: r["program"][0].update(outcome={"a": 1}), "'outcome' must be a string"),
    "backup-mode": (lambda r: r.update(backup_mode="floppy"), "backup_mode 'floppy'"),
    "divergence-rid": (lambda r: r["divergence"].update(rid="1"), "divergence field 'rid' must be int or null"),
    "divergence-layer": (lambda r: r["divergence"].update(layer=True), "divergence field 'layer'"),
    "option-type": (lambda r: r["engine_options"].update(poison=1), "engine option 'poison' must be bool"),
    "option-int": (lambda r: r["engine_options"].update(sweep_interval=True), "'sweep_interval' must be int"),
    "option-zero": (lambda r: r["engine_options"].update(sweep_interval=0), "'sweep_interval' must be an int from 1"),
    "seed-str": (lambda r: r.update(seed="7"), "field 'seed' must be int or null"),
    "teardown-str": (lambda r: r.update(in_teardown="no"), "field 'in_teardown' must be bool"),
    "family-int": (lambda r: r.update(family=3), "field 'family' must be str"),
    "status-list": (lambda r: r.update(status=["x"]), "field 'status' must be str"),
    "model-config-list": (lambda r: r.update(model_config=[1]), "field 'model_config' must be dict or null"),
    "pools-str": (lambda r: r.update(pools="engine"), "field 'pools' must be dict or null"),
    "pools-builder": (lambda r: r.update(pools={"built_by": "vendor", "detail": "x"}),
                      "built_by 'vendor' is not one of poolfuzz, engine, adapter"),
    "pools-extra": (lambda r: r.update(pools={"built_by": "engine", "detail": "x", "exec": "rm"}),
                    "field 'pools' must be an object of 'built_by' and a string 'detail'"),
    "model-config-field": (lambda r: r.update(model_config={"name": "x", "architecture": "llama", "os": 1}),
                           "unknown config field 'os'"),
    "model-config-str": (lambda r: r.update(model_config={"name": "x", "architecture": "llama",
                                                          "page_size": "__import__('os')"}),
                         "config field 'page_size' must be an integer"),
    "model-config-huge": (lambda r: r.update(model_config={"name": "x", "architecture": "llama",
                                                           "full_tokens": 2**40, "max_context": 2**40}),
                          "out of range"),
    "model-config-impossible": (lambda r: r.update(model_config={"name": "x", "architecture": "llama",
                                                                 "page_size": 3}), "is impossible"),
    "model-config-fault-misfit": (lambda r: r.update(model_config={"name": "x", "architecture": "llama"}),
                                  "does not apply to its config"),
}


@pytest.mark.parametrize("command", ["replay", "emit-test"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_artifact_is_exit_2_never_a_reproduction(case, command, base_json, tmp_path, capsys):
    mutate, words = MALFORMED[case]
    raw = json.loads(json.dumps(base_json))
    raw.setdefault("engine_options", {})
    mutate(raw)
    path = _write(tmp_path, raw)
    assert run_cli(_argv(command, path, tmp_path)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("poolfuzz: error: ") and words in err, err
    assert captured.out == "" and not (tmp_path / "test_emitted.py").exists()


def test_the_schema_covers_every_engine_operation_and_argument():
    from poolfuzz.harness.engine import NODES
    from poolfuzz.harness.program import operations
    from poolfuzz.orchestration import schema

    ops = operations()
    assert set(schema.OPERATION_ARGS) == set(ops)
    for name, sig in ops.items():
        assert list(schema.OPERATION_ARGS[name]) == [p for p in sig.parameters if p != "self"], name
    assert schema.NODES == NODES
    from poolfuzz.pools.family import BACKUP_MODES

    assert schema.BACKUP_MODES == BACKUP_MODES


# ------------------------------------------------------------------------------------------
# The loader under fuzzing: valid, mutated and random artifacts; exit 0, 1 or 2, never code from the file
# ------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SENTINEL_MODULE = "poolfuzz_sentinel_fuzz"
_json_scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20)
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_evil_text = st.sampled_from(['"""', "'''", "\\", "\n", "\r", "\x00", "#", "\n)\nimport os\n(", "\u2028", "\ud800"])
_text = st.lists(_evil_text | st.text(max_size=6), max_size=5).map("".join)
_families = st.sampled_from([f"{SENTINEL_MODULE}:factory", f"{SENTINEL_MODULE}", "this:s", "os:getcwd", "builtin",
                             "sglang", "poolfuzz.pools.family:build_family", f"{SENTINEL_MODULE}.x:y"])
_ints = st.integers(-3, 12) | st.sampled_from([2**31 - 1, 2**31, 2**63]) | st.booleans()
_args = {"prompt_len": _ints, "rid": _ints, "chunk": _ints, "rids": st.lists(_ints, max_size=3),
         "draft": _ints, "accepted": _ints, "node": st.sampled_from(["prefill", "decode", "x"]) | _json,
         "src_rid": _ints, "extra": _ints, "tree": _ints | _json}


@st.composite
def _step(draw):
    from poolfuzz.orchestration.schema import OPERATION_ARGS

    op = draw(st.sampled_from(sorted(OPERATION_ARGS)) | st.text(max_size=5))
    names = list(OPERATION_ARGS.get(op, {}))
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(sorted(_args)), max_size=3, unique=True))
    step = {"op": op, "args": {n: draw(_args[n]) for n in names}}
    if draw(st.booleans()):
        step["outcome"] = draw(_text | _json)
    return step


_BASE: list = []


def _base() -> dict:
    if not _BASE:
        _BASE.append(json.loads(dumps(from_program("swa-ssm", PROGRAM, faults=[FAULT]))))
    return json.loads(json.dumps(_BASE[0]))


@st.composite
def artifacts_json(draw):
    kind = draw(st.sampled_from(["valid", "mutated", "random"]))
    if kind == "random":
        return draw(_json | st.dictionaries(st.sampled_from(sorted(_base())), _json, max_size=8))
    raw = _base()
    if kind == "valid":
        return raw
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(sorted(raw)))
        choice = draw(st.integers(0, 5))
        if choice == 0:
            raw.pop(key)
        elif choice == 1:
            raw[key] = draw(_json)
        elif choice == 2:
            raw[key] = draw(_text)
        elif choice == 3:
            raw["family"] = draw(_families)
        elif choice == 4:
            raw["program"] = draw(st.lists(_step(), max_size=6))
        else:
            raw["divergence"] = draw(st.dictionaries(st.sampled_from(["kind", "op", "rid", "layer", "detail"]),
                                                     _json | _text, max_size=3))
    return raw


@pytest.fixture(scope="module")
def sentinel_path(tmp_path_factory):
    """A module that writes a file when imported; any artifact that names it must not get it imported."""
    folder = tmp_path_factory.mktemp("sentinel")
    sentinel = folder / "imported"
    (folder / f"{SENTINEL_MODULE}.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('imported')\nfactory = print\n")
    sys.path.insert(0, str(folder))
    try:
        yield sentinel
    finally:
        sys.path.remove(str(folder))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raw=artifacts_json())
def test_fuzzed_artifacts_give_0_1_or_2_and_never_run_their_code(sentinel_path, raw):
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "a.json")
        with open(path, "w") as fh:
            json.dump(raw, fh)
        assert run_cli(["replay", path, "--device", "cpu"]) in (0, 1, 2)
        out = os.path.join(folder, "test_emitted.py")
        code = run_cli(["emit-test", path, "-o", out])
        assert code in (0, 2)
        if code == 0:
            with open(out, encoding="utf-8") as fh:
                source = fh.read()
            assert_only_expected_statements(source)
            exec(compile(source, out, "exec"), {"__name__": "emitted"})  # what pytest runs at import
        else:
            assert not os.path.exists(out)
    assert not sentinel_path.exists() and SENTINEL_MODULE not in sys.modules


def test_a_trusted_family_that_is_not_a_factory_is_exit_2_not_a_reproduction(base_json, tmp_path, capsys):
    path = _write(tmp_path, {**base_json, "family": "os:getcwd"})
    assert run_cli(_argv("replay", path, tmp_path, "--family", "os:getcwd")) == 2
    captured = capsys.readouterr()
    assert "REPRODUCED" not in captured.out
    assert "family 'os:getcwd' (os:getcwd) cannot build config 'swa-ssm' on cpu: TypeError" in captured.err
