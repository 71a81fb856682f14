"""Issue 43's smaller items, the parts that need no cluster: one name per replica, the
`python` a command names, a script that never joined, and a script grid's report.
tests/test_launch_edges_e2e.py runs `paramserver launch` through them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from paramserver.workers.experiments.report import write_report
from paramserver.workers.launch.clusterspec import replica_name
from paramserver.workers.launch.processes import command_python
from paramserver.workers.launch.replicas import replacement_name
from paramserver.workers.launch.results import (
    NOT_JOINED,
    FailureRecord,
    LostWorker,
    WorkerSummary,
)
from tests.test_report import GOOD, fake_experiment


def test_a_replaced_replica_keeps_its_name() -> None:
    # the first primary is server0 in processes.json, and so is its replacement
    assert replacement_name(0, 0) == replica_name(0, 0) == "server0"
    assert replacement_name(2, 1) == replica_name(2, 1) == "server2r1"


def _interpreter(bin_dir: Path, name: str, status: int) -> None:
    """A `name` on PATH that exits ``status`` (0: it imports paramserver)."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\nexit {status}\n")
    path.chmod(0o755)


def test_a_python_that_cannot_import_paramserver_is_replaced_by_the_launchers(
        tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    _interpreter(bins, "python3", 1)  # outside the launcher's virtual environment
    env = {**os.environ, "PATH": f"{bins}{os.pathsep}{os.environ.get('PATH', '')}"}
    command, note = command_python(["python3", "train.py", "--lr", "0.1"], env)
    assert command == [sys.executable, "train.py", "--lr", "0.1"]
    assert note is not None and "cannot import paramserver" in note and "\n" not in note
    # a python that can, the launcher's own, and what is no python run as given
    _interpreter(bins, "python", 0)
    for given in (["python", "train.py"], [sys.executable, "train.py"],
                  ["bash", "-c", "python3 train.py"]):
        assert command_python(given, env) == (given, None)


def test_a_script_that_never_joined_is_not_called_dead() -> None:
    summary = WorkerSummary.from_result(
        LostWorker(1, 0, NOT_JOINED), (FailureRecord("worker1", 0, NOT_JOINED, 0.0),), ())
    assert summary.describe() == f"worker 1 {NOT_JOINED}, tolerated"
    killed = WorkerSummary.from_result(LostWorker(1, -9, "killed by SIGKILL"),
                                       (FailureRecord("worker1", -9, "x", 0.0),), ())
    assert killed.describe() == "worker 1 dead (killed by SIGKILL), tolerated"


def test_a_script_grid_has_no_literature_checks_and_is_named_for_its_script(
        tmp_path: Path) -> None:
    fake_experiment(tmp_path, dts=GOOD, scenarios=("none",), seeds=(0,))
    path = tmp_path / "experiment.json"
    exp = json.loads(path.read_text())
    exp.update(name="experiment", command=["python", "examples/train.py", "--lr", "0.1"])
    path.write_text(json.dumps(exp))
    files = write_report(tmp_path)
    md = files.markdown.read_text()
    assert files.claims == [] and "Literature checks" not in md and "SKIPPED" not in md
    assert md.startswith("# Experiment 'train.py'")
    assert "<title>Experiment train.py</title>" in files.html.read_text()


def test_reshard_at_refuses_what_could_never_move_before_anything_starts(
        tmp_path: Path) -> None:
    from click.testing import CliRunner

    from paramserver.cli.main import main

    base = ["launch", "-s", "2", "-n", "2", "--mode", "sync", "--steps", "10", "--out",
            str(tmp_path / "never")]
    for extra, said in [
        (["--reshard-at", "5:4", "--reshard-at", "5:3"], "round 5 is given twice"),
        (["--reshard-at", "11:3"], "the run closes at most 10 rounds (--steps 10), so the "
                                   "move would never happen"),
        (["--reshard-at", "2:1025"], "at most 1024 shards"),
        (["--reshard-at", "2:0"], "must look like ROUND:S"),
        (["-s", "1025"], "1025 is not in the range 1<=x<=1024"),
    ]:
        res = CliRunner().invoke(main, [*base, *extra])
        assert res.exit_code == 2 and said in res.output, (extra, res.output)
    assert not (tmp_path / "never").exists()
