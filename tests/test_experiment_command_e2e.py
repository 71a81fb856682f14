"""`paramserver experiment [grid options] -- COMMAND`: the user's own script as every
worker of every cell (issue 31, item 1), over real processes on loopback, and the grid
options that cannot act on a script refused in one line."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from paramserver.cli.experiment import experiment
from paramserver.errors import ConfigError
from paramserver.observe.events import read_events
from paramserver.workers.experiments.runner import simulate_experiment
from paramserver.workers.experiments.spec import ExperimentSpec, dump_spec, load_spec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "tests" / "experiment_script.py")]
CELLS = ("none-sync-none-w2", "none-async-none-w2")


@pytest.mark.integration
@pytest.mark.timeout(300)  # 2 runs of 3 processes: ~25 s on 2 idle cores
def test_a_grid_runs_the_script_in_every_cell(tmp_path: Path) -> None:
    spec_file = tmp_path / "grid.toml"
    spec_file.write_text('name = "mine"\nseeds = [7]\n')  # not seed 0: PARAMSERVER_SEED is it
    out, seen = tmp_path / "exp", tmp_path / "seen"
    result = CliRunner().invoke(experiment, [
        "--spec", str(spec_file), "--mode", "sync", "--mode", "async", "--workers", "2",
        "--num-servers", "1", "--scenario", "none", "--min-step-time", "0", "--steps", "6",
        "--out", str(out), "--", *SCRIPT, str(seen)])
    assert result.exit_code == 0, result.output
    assert "experiment_script.py" in result.output  # what the grid runs, said up front

    for cell in CELLS:
        for rank in range(2):  # the script ran once per worker, with the cell's environment
            env = json.loads((seen / cell / "seed7" / f"rank{rank}.json").read_text())
            assert env == {"RANK": str(rank), "WORLD_SIZE": "2", "PARAMSERVER_SEED": "7",
                           "PARAMSERVER_CELL": f"{cell}/seed7", "PARAMSERVER_STEPS": "6"}
        run = out / "runs" / cell / "seed7"
        res = json.loads((run / "result.json").read_text())
        assert res["spec"]["command"] == [*SCRIPT, str(seen)]
        assert [(w["worker"], w["steps"]) for w in res["workers"]] == [(0, 6), (1, 6)]
        steps = [r for r in read_events(run / "steps.jsonl") if r["event"] == "step"]
        assert sorted((r["worker"], r["clock"]) for r in steps) == \
            [(w, c) for w in range(2) for c in range(1, 7)]
        assert (run / "final_model.safetensors").exists()  # the servers' weights

    index = json.loads((out / "experiment.json").read_text())
    assert index["command"] == [*SCRIPT, str(seen)]
    assert [(r["config"], r["seed"], r["ok"]) for r in index["runs"]] == \
        [(CELLS[0], 7, True), (CELLS[1], 7, True)]
    assert [c["id"] for c in index["configurations"]] == list(CELLS)
    report = (out / "report.md").read_text()
    assert "Command " in report and "PARAMSERVER_STEPS=6" in report
    for label in ("| sync ", "| async "):  # both cells, with their figures
        row = next(line for line in report.splitlines() if line.startswith(label))
        assert "failed" not in row and row.count("|") > 5, row
    again = load_spec(out / "spec.toml")  # the resolved spec reruns the same grid
    assert again.command == [*SCRIPT, str(seen)] and again.seeds == [7]
    assert "task" not in tomllib.loads((out / "spec.toml").read_text())  # not the loop's keys


@pytest.mark.parametrize(("flags", "said"), [
    (["--task", "digits-mlp"], "--task does not apply with a command"),
    (["--task-arg", "hidden=8"], "--task-arg does not apply with a command"),
    (["--eval-every", "5"], "--eval-every does not apply with a command"),
    (["--budget-seconds", "3"], "--budget-seconds does not apply with a command"),
    (["--budget-gradients", "40"], "--budget-gradients does not apply with a command"),
    (["--preset", "literature"], "eval_every does not apply with a command"),
])
def test_options_of_the_built_in_loop_are_refused_with_a_command(
        tmp_path: Path, flags: list[str], said: str) -> None:
    result = CliRunner().invoke(experiment, [*flags, "--out", str(tmp_path / "x"), "--",
                                             "python", "train.py"])
    assert result.exit_code == 2
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and said in error[0], result.output
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_the_spec_key_command(tmp_path: Path) -> None:
    path = tmp_path / "grid.toml"
    path.write_text('command = "python train.py --lr \'0.1 0.2\'"\nmodes = ["sync"]\n'
                    'steps = 40\n')
    spec = load_spec(path)
    assert spec.command == ["python", "train.py", "--lr", "0.1 0.2"]  # split as a shell does
    assert spec.workload == "python train.py --lr '0.1 0.2'"
    cluster = spec.cluster_spec(spec.configurations()[0], 3)
    assert cluster.command == spec.command and cluster.cell == "transient-sync-none-w4/seed3"
    env = cluster.command_env(1, ["tcp://127.0.0.1:1"], tmp_path)
    assert (env["RANK"], env["WORLD_SIZE"], env["PARAMSERVER_SEED"], env["PARAMSERVER_CELL"],
            env["PARAMSERVER_STEPS"]) == ("1", "4", "3", "transient-sync-none-w4/seed3", "40")
    assert load_spec_text(tmp_path, dump_spec(spec)).command == spec.command
    for bad, said in (({"command": []}, "non-empty list"), ({"command": [1]}, "list of strings"),
                      ({"command": "x", "batch_size": 8}, "batch_size does not apply"),
                      ({"command": "x", "device": "cuda"}, "device does not apply")):
        with pytest.raises(ConfigError, match=said):
            ExperimentSpec.from_dict(bad)
    with pytest.raises(ConfigError, match="use paramserver experiment"):
        simulate_experiment(spec, tmp_path / "sim")
    assert not (tmp_path / "sim").exists()


def test_a_task_run_gets_no_cell_variables(tmp_path: Path) -> None:
    spec = ExperimentSpec(modes=["sync"], seeds=[2])
    cluster = spec.cluster_spec(spec.configurations()[0], 2)
    assert cluster.command is None and cluster.cell is None
    env = cluster.command_env(0, [], tmp_path)  # launch -- COMMAND: the seed, not the cell
    assert env["PARAMSERVER_SEED"] == "2" and "PARAMSERVER_CELL" not in env


def load_spec_text(tmp_path: Path, text: str) -> ExperimentSpec:
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    return load_spec(path)
