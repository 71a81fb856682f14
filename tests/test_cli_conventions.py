"""One meaning per flag name, and commands that treat alike what they share (issue 15,
"CLI conventions"): --num-servers is the count everywhere (--servers, its old name for
a count, warns once), the run folder rules of launch and experiment. Nothing is spawned."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from paramserver.cli import experiment as experiment_cli
from paramserver.cli import simulate as simulate_cli
from paramserver.cli.main import main
from paramserver.errors import ConfigError
from paramserver.workers.experiments.spec import ExperimentSpec, dump_spec, load_spec

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


DEPRECATED = "--servers is deprecated for this count; use --num-servers"


# --------------------------------------------------------------------------- --num-servers


def test_launch_num_servers_and_its_old_name() -> None:
    new = invoke("launch", "-s", "3", "-n", "2", "--print-config")
    assert new.exit_code == 0, new.output
    assert "num-servers = 3" in new.stdout and DEPRECATED not in new.stderr
    old = invoke("launch", "--servers", "3", "-n", "2", "--print-config")
    assert old.exit_code == 0, old.output
    assert "num-servers = 3" in old.stdout
    assert old.stderr.count(DEPRECATED) == 1  # once, on stderr, naming the new flag
    assert DEPRECATED not in old.stdout
    # the hidden old flag is not a key of the printed configuration
    assert "\nservers" not in old.stdout


def test_launch_old_and_new_count_disagree() -> None:
    result = invoke("launch", "--servers", "3", "--num-servers", "2", "--print-config")
    assert result.exit_code == 2
    assert "Error: --servers 3 and --num-servers 2 disagree" in result.output
    same = invoke("launch", "--servers", "2", "--num-servers", "2", "--print-config")
    assert same.exit_code == 0, same.output


def test_launch_servers_in_config_file_stay_addresses(tmp_path: Path) -> None:
    """A shared file's top-level ``servers`` (the workers' addresses) is not a count."""
    conf = tmp_path / "run.toml"
    conf.write_text('servers = ["127.0.0.1:5600"]\nnum-servers = 3\n')
    result = invoke("launch", "--config", str(conf), "--print-config")
    assert result.exit_code == 0, result.output
    assert "num-servers = 3" in result.stdout and DEPRECATED not in result.output


@pytest.mark.parametrize("module", [experiment_cli, simulate_cli],
                         ids=["experiment", "simulate"])
@pytest.mark.parametrize("flag", ["--num-servers", "-s", "--servers"])
def test_grid_num_servers(module: Any, flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ExperimentSpec] = []

    def fake_run_grid(console: Any, spec: ExperimentSpec, *args: Any) -> Any:
        seen.append(spec)
        raise click.exceptions.Exit(0)

    monkeypatch.setattr(module, "run_grid", fake_run_grid)
    result = invoke(module.__name__.rsplit(".", 1)[1], flag, "3", "--mode", "async")
    assert result.exit_code == 0, result.output
    assert seen[0].servers == 3
    assert result.stderr.count(DEPRECATED) == (1 if flag == "--servers" else 0)


def test_spec_key_num_servers_and_its_old_name(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    new = tmp_path / "new.toml"
    new.write_text("num_servers = 3\n")
    assert load_spec(new).servers == 3
    old = tmp_path / "old.toml"
    old.write_text("servers = 3\n")
    with caplog.at_level(logging.WARNING):
        assert load_spec(old).servers == 3
    assert "spec key 'servers' is deprecated" in caplog.text and "'num_servers'" in caplog.text
    both = tmp_path / "both.toml"
    both.write_text("servers = 3\nnum_servers = 2\n")
    with pytest.raises(ConfigError, match="not both 'num_servers' and 'servers'"):
        load_spec(both)
    # a written spec uses the new name, and reads back equal
    text = dump_spec(load_spec(new))
    assert "num_servers = 3" in text and "\nservers" not in text


# --------------------------------------------------------------------------- --out, --overwrite


def one_line_error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Path, list[str]]]:
    """Stands in for whatever would start processes: records the folder it was given,
    with what it held then, and stops the command there."""
    seen: list[tuple[str, Path, list[str]]] = []

    def record(what: str, out: Path) -> None:
        seen.append((what, out, sorted(p.name for p in out.iterdir())))
        raise click.exceptions.Exit(0)

    monkeypatch.setattr("paramserver.workers.launch.cluster.run_cluster",
                        lambda spec, out, **kw: record("launch", out))
    for module in (experiment_cli, simulate_cli):
        monkeypatch.setattr(module, "run_grid",
                            lambda console, spec, out, *a, **kw: record("grid", out))
    return seen


COMMANDS = {
    "launch": (["launch", "-n", "1", "-s", "1"], "run", "logs"),
    "experiment": (["experiment", "--mode", "async"], "experiment", "experiment.json"),
    "simulate": (["simulate", "--mode", "async"], "experiment", "spec.toml"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_out_rules_alike(command: str, tmp_path: Path,
                         started: list[tuple[str, Path, list[str]]]) -> None:
    args, what, marker = COMMANDS[command]
    # a new folder and an empty one are used
    for out in (tmp_path / "new", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        assert invoke(*args, "--out", str(out)).exit_code == 0
        assert started.pop()[1:] == (out, [])
    # a folder that holds something else is refused, and left alone
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    error = one_line_error(invoke(*args, "--out", str(foreign)))
    assert f"{foreign} is not empty and holds no {what}; give --overwrite" in error
    assert (foreign / "notes.txt").read_text() == "mine" and not started
    # an earlier (here: failed, half-written) run or experiment is refused too
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    if "." in marker:
        (earlier / marker).write_text("{}")
    else:
        (earlier / marker).mkdir()
    (earlier / "result-of-sorts.txt").write_text("old")
    error = one_line_error(invoke(*args, "--out", str(earlier)))
    assert f"{earlier} holds an earlier {what}; give --overwrite" in error
    # --overwrite clears either, and only what is inside
    for out in (earlier, foreign):
        result = invoke(*args, "--out", str(out), "--overwrite")
        assert result.exit_code == 0, result.output
        assert started.pop()[1:] == (out, [])


def test_overwrite_never_deletes_outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         started: list[tuple[str, Path, list[str]]]) -> None:
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.txt").write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    (out / "link-to-keep").symlink_to(keep)  # a link inside: removed, its target kept
    (out / "logs").mkdir()
    assert invoke("launch", "--out", str(out), "--overwrite").exit_code == 0
    assert started.pop()[2] == [] and (keep / "precious.txt").exists()
    # a link as --out, the working directory and a folder above it are never cleared
    link = tmp_path / "link"
    link.symlink_to(keep)
    error = one_line_error(invoke("launch", "--out", str(link), "--overwrite"))
    assert "will not clear it: it is a symbolic link" in error
    work = keep / "sub"
    work.mkdir()
    (work / "script.py").write_text("")
    monkeypatch.chdir(work)
    for target in (".", str(keep)):
        error = one_line_error(invoke("experiment", "--out", target, "--overwrite"))
        assert "the working directory or a folder above it" in error
    assert (keep / "precious.txt").exists() and (work / "script.py").exists()
    assert not started


# --------------------------------------------------------------------------- the number of workers


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def resolved(result: Result, key: str) -> str:
    assert result.exit_code == 0, result.output
    return next(line for line in result.stdout.splitlines() if line.startswith(f"{key} ="))


@pytest.mark.parametrize(("command", "key", "text"), [
    ("launch", "num-workers", "[server]\nexpected-workers = 3\n"),
    ("launch", "num-workers", "[worker]\nworld-size = 3\n"),
    ("server", "expected-workers", "world-size = 3\n"),
    ("server", "expected-workers", "[worker]\nworld-size = 3\n"),
    ("worker", "world-size", "[server]\nexpected-workers = 3\n"),
    ("worker", "world-size", "[launch]\nnum-workers = 3\n"),
])
def test_worker_count_defaults_from_its_other_names(command: str, key: str, text: str,
                                                    tmp_path: Path) -> None:
    extra = ["--servers", "127.0.0.1:5600"] if command == "worker" else []
    result = invoke(command, *extra, "--config", config(tmp_path, text), "--print-config")
    assert " ".join(resolved(result, key).split()[:3]) == f"{key} = 3"


@pytest.mark.parametrize(("command", "args", "text", "message"), [
    ("launch", [], "[server]\nexpected-workers = 3\n[worker]\nworld-size = 4\n",
     "expected-workers = 3 in {f} [server]; world-size = 4 in {f} [worker]"),
    ("launch", ["-n", "2"], "[server]\nexpected-workers = 3\n",
     "--num-workers 2; expected-workers = 3 in {f} [server]"),
    ("server", ["--expected-workers", "2"], "world-size = 5\n",
     "--expected-workers 2; world-size = 5 in {f}"),
    ("worker", ["--servers", "127.0.0.1:5600", "--world-size", "2"],
     "[server]\nexpected-workers = 3\n", "--world-size 2; expected-workers = 3 in {f} [server]"),
])
def test_worker_count_mismatch_is_one_usage_error(command: str, args: list[str], text: str,
                                                  message: str, tmp_path: Path) -> None:
    path = config(tmp_path, text)
    error = one_line_error(invoke(command, *args, "--config", path))
    assert f"Error: the number of workers is given differently: {message.format(f=path)}. " \
           "--world-size, --expected-workers and --num-workers are one number" in error


def test_worker_count_same_name_follows_precedence(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A file's num-workers yields to -n as every option's file value yields to its flag."""
    path = config(tmp_path, "num-workers = 3\n")
    assert resolved(invoke("launch", "--config", path, "-n", "2", "--print-config"),
                    "num-workers").split()[2] == "2"
    monkeypatch.setenv("PARAMSERVER_EXPECTED_WORKERS", "2")
    error = one_line_error(invoke("server", "--config", config(tmp_path, "world-size = 5\n")))
    assert "PARAMSERVER_EXPECTED_WORKERS=2; world-size = 5 in" in error


def test_worker_count_not_a_count(tmp_path: Path) -> None:
    error = one_line_error(invoke("launch", "--config", config(tmp_path, "[worker]\n"
                                                                         "world-size = 0\n")))
    assert "world-size = 0 is not a number of workers" in error


def test_run_checks_the_job_against_the_file(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's 4 ranks with 2 servers are 2 workers; the file says 3: refused before
    any rendezvous (no store is listening at MASTER_PORT)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    path = config(tmp_path, "[worker]\nworld-size = 3\n")
    error = one_line_error(invoke("run", "--num-servers", "2", "--config", path))
    assert (f"world-size = 3 in {path} [worker]; 2 worker ranks in this job (4 ranks - "
            "--num-servers 2)") in error
