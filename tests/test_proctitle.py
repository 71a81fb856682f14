"""Process titles: a paramserver program names itself; a program that runs one of
its commands in-process (here pytest, through click's CliRunner) keeps its own name.

Real processes' titles are checked in test_cli_e2e.py (launcher, shards, workers).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest
import setproctitle
from click.testing import CliRunner

import paramserver
from paramserver.cli.main import main
from paramserver.errors import ConfigError, ParamServerError
from paramserver.util.proctitle import PREFIX, is_paramserver_program, set_title
from tests.ports import free_port

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py

PACKAGE = Path(paramserver.__file__).parent


def test_paramserver_programs_are_recognised_by_argv0() -> None:
    # the console script, and `python -m` of a core module or of one in a linked folder
    assert is_paramserver_program(str(Path(sys.executable).parent / "paramserver"))
    assert is_paramserver_program(str(PACKAGE / "server" / "loop.py"))
    assert is_paramserver_program(str(PACKAGE / "workers" / "worker.py"))
    assert is_paramserver_program(str(PACKAGE / "workers" / "launch" / "zygote.py"))
    assert is_paramserver_program(str(PACKAGE / "cli" / "__main__.py"))
    # the same files by their real paths (workers/ and cli/ are links into the package)
    assert is_paramserver_program(str((PACKAGE / "cli" / "__main__.py").resolve()))


@pytest.mark.parametrize("argv0", [
    "", "-c", "-m",
    str(Path(__file__)),  # a test file next to the package, not in it
    str(Path(pytest.__file__).parent / "__main__.py"),  # python -m pytest
    str(Path(sys.executable).parent / "pytest"),
    "/usr/lib/python3/dist-packages/ipykernel_launcher.py",
])
def test_other_programs_are_not(argv0: str) -> None:
    assert not is_paramserver_program(argv0)


def test_set_title_in_another_program_leaves_its_title() -> None:
    before = setproctitle.getproctitle()
    assert set_title("worker 0/1 (x)") is False
    assert setproctitle.getproctitle() == before


def _stop_here(seen: list[str], error: type[Exception]) -> Any:
    """A stand-in for the run a command starts once it has (not) set its title:
    it notes the title at that point and stops the command."""
    def run(*args: Any, **kwargs: Any) -> NoReturn:
        seen.append(setproctitle.getproctitle())
        raise error("stopped by the test")
    return run


@pytest.mark.parametrize("command", ["launch", "worker"])
def test_commands_invoked_in_process_leave_the_host_title(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    if command == "launch":
        monkeypatch.setattr("paramserver.workers.launch.cluster.run_cluster",
                            _stop_here(seen, ParamServerError))
        args = ["launch", "--quiet", "--steps", "1", "--out", str(tmp_path / "run")]
    else:
        monkeypatch.setattr("paramserver.workers.worker.run_worker", _stop_here(seen, ConfigError))
        args = ["worker", "--servers", f"127.0.0.1:{free_port()}", "--steps", "1"]
    before = setproctitle.getproctitle()
    assert not before.startswith(PREFIX)
    result = CliRunner().invoke(main, args)
    assert "stopped by the test" in result.output, result.output  # it got as far as the run
    assert seen == [before]
    assert setproctitle.getproctitle() == before
