"""``--config random``, ``--config-file`` and ``configs --show``: drawn and file configs end to end."""

import json
import os
import subprocess
import sys

import pytest

from poolfuzz.cli import run_cli
from poolfuzz.orchestration.artifacts import load
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.config_file import config_from_fields, load_config_file

PAGED = "paged-free-partial-page"


def test_configs_show_prints_every_field_as_toml(capsys, tmp_path):
    assert run_cli(["configs", "--show", "swa-ssm"]) == 0
    path = tmp_path / "c.toml"
    path.write_text(capsys.readouterr().out)
    assert load_config_file(str(path)) == [CONFIGS["swa-ssm"]]
    assert run_cli(["configs", "--show", "gpt-9"]) == 2


def test_an_edited_config_file_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["configs", "--show", "swa-ssm"]) == 0
    (tmp_path / "mine.toml").write_text(capsys.readouterr().out.replace("page_size = 1\n", "page_size = 16\n"))
    assert run_cli(["run", "--config-file", "mine.toml", "--examples", "20", "--seed", "1", "--db", "none"]) == 0
    out = capsys.readouterr().out
    assert "swa-ssm" in out and "1 passed, 0 failed" in out


@pytest.mark.parametrize("argv, problem", [
    (["--config-file", "missing.toml"], "does not exist"),
    (["--config-file", "bad.toml"], "page_size"),
    (["--config", "swa-ssm", "--config-file", "mine.toml"], "rename it in the file"),
    (["--config-file", "mine.toml", "--faults", "swa-ignores-mamba-backup"], "does not apply to config 'swa-ssm'"),
])
def test_bad_config_files_are_exit_2(argv, problem, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text("[[config]]\nname = 'x'\narchitecture = 'llama'\npage_size = 0\n")
    mine = CONFIGS["swa-ssm"].replace(mamba_layers=0, mamba_slots=0, architecture="gpt-oss", recurrent_layers="own")
    from poolfuzz.pools.config_file import to_toml

    (tmp_path / "mine.toml").write_text(to_toml(mine))
    assert run_cli(["run", "--examples", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and problem in err, err


@pytest.mark.slow
def test_random_passes_on_the_correct_family(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["run", "--config", "random", "dense", "--examples", "30", "--seed", "1", "--db", "none"]) == 0
    assert "2 passed, 0 failed" in capsys.readouterr().out


@pytest.mark.slow
def test_a_fault_found_on_a_drawn_config_replays_and_emits_a_test(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = run_cli(["run", "--config", "random", "--faults", PAGED, "--examples", "200", "--seed", "1",
                    "--db", "none", "--shrink-seconds", "20"])
    assert code == 1
    # The run keeps going past each signature: on drawn shapes the one fault shows several ways; the
    # first one found is the one checked end to end here.
    path = min((tmp_path / "poolfuzz-failures").glob("*.json"), key=lambda p: load(p).examples)
    art = load(path)
    config = config_from_fields(art.model_config, "test")
    assert art.config == "random" and config.page_size > 1 and config not in CONFIGS.values()
    assert run_cli(["replay", str(path)]) == 1
    assert run_cli(["emit-test", str(path), "-o", "test_regression.py"]) == 0
    source = (tmp_path / "test_regression.py").read_text()
    assert "config_from_fields({" in source and "get_config" not in source
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def pytest_rc(text):
        (tmp_path / "test_regression.py").write_text(text)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_regression.py"],
                              cwd=tmp_path, env=env, capture_output=True).returncode

    assert pytest_rc(source) == 1  # fails with the fault
    assert pytest_rc(source.replace(f"FAULTS = [{PAGED!r}]", "FAULTS = []")) == 0  # passes without it


def test_old_artifacts_without_model_config_still_replay(tmp_path):
    from poolfuzz.orchestration.artifacts import dumps, from_program

    art = from_program("swa-ssm", [{"op": "admit", "args": {"prompt_len": 3}},
                                   {"op": "prefill", "args": {"rid": 1, "chunk": 3}},
                                   {"op": "retract", "args": {"rid": 1}},
                                   {"op": "resume", "args": {"node": "prefill"}}],
                       faults=["swa-ignores-mamba-backup"])
    raw = json.loads(dumps(art))
    assert raw["model_config"] is None
    del raw["model_config"]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert run_cli(["replay", str(tmp_path / "old.json")]) == 1


def test_configs_for_a_family_that_describes_no_server_is_an_error_naming_one_that_does(capsys):
    assert run_cli(["configs", "--family", "builtin"]) == 2
    err = capsys.readouterr().err
    assert "family 'builtin' describes no server" in err and "such as sglang" in err


def test_configs_for_a_family_whose_engine_is_absent_says_how_to_install_it(capsys):
    try:
        import sglang  # noqa: F401
    except ImportError:
        assert run_cli(["configs", "--family", "sglang:scheduler"]) == 2
        assert "SGLang is not installed" in capsys.readouterr().err
    else:
        pytest.skip("SGLang is installed here: tests/sglang lists its servers")


def test_a_server_dir_without_a_family_and_one_config_is_an_error(capsys):
    assert run_cli(["configs", "--server-dir", "/tmp/x"]) == 2
    assert "give it with --family NAME and --show CONFIG" in capsys.readouterr().err


def test_a_servers_launch_command_starts_it_in_its_environment():
    """The variables a server's pools are sized in lead its launch command, as a shell takes them."""
    from poolfuzz.pools.capabilities import MODEL_PATH, ServerDescription

    bare = ServerDescription(flags=f"--page-size 1 --draft {MODEL_PATH}", built=None, refused="no GPU", family=None,
                             launcher="python -m engine.launch")
    assert bare.command("/m") == "python -m engine.launch --model-path /m --page-size 1 --draft /m"
    held = ServerDescription(flags="--page-size 1", built=None, refused="no GPU", family=None,
                             launcher="python -m engine.launch", environment="EVICTION_INTERVAL=6 MODE='a b'")
    assert held.command("/m") == "EVICTION_INTERVAL=6 MODE='a b' python -m engine.launch --model-path /m --page-size 1"


def test_a_server_that_crashes_at_startup_is_listed_as_a_crash_not_a_decline(capsys):
    """The engine's own startup raised (SGLang 0.5.11 - 0.5.13's FP4 decode server imports a renamed class): the
    listing says so and goes on to the next config, where it once ended in a traceback."""
    from poolfuzz.cli.catalogue import _print_server
    from poolfuzz.pools.capabilities import ServerDescription

    _print_server(ServerDescription(flags="--page-size 1", built={"KV pool": "P (8 tokens)"}, refused=None,
                                    family=None, family_crashes="ImportError: cannot import name 'X'"))
    out = capsys.readouterr().out
    assert "family: crashes at startup (ImportError: cannot import name 'X'; poolfuzz run reports it as a failure)" in out
    assert "declines" not in out
