"""examples/ddp_port/ (issue 31): the PyTorch DDP tutorial's trainer, ported. In sync mode
every step's loss of every rank equals the same script under real DDP (torchrun, gloo on
loopback) to the last digit, under `launch` and in the sync cell of the example's grid,
which compares sync, async and ssp:2 under a persistent straggler and reports them.

Why exactly and not nearly: with equal batches DDP averages the ranks' gradients as
g0/2 + g1/2 and a sync shard as (n g0 + n g1) / 2n, and scaling by a power of two is
exact in floating point, so both give the same float; both then take the same SGD step
from the same initial weights (DDP broadcasts rank 0's, paramserver is seeded by them)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner

from paramserver import ClusterSpec, ServerConfig, WorkerConfig, run_cluster
from paramserver.cli.experiment import experiment
from paramserver.observe.events import read_events
from paramserver.workers.experiments.spec import load_spec
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_port"
GRID = load_spec(EXAMPLE / "grid.toml")
assert GRID.command is not None
# the grid's own size and step size, so that its sync cell is the DDP run's configuration
EPOCHS = int(GRID.command[GRID.command.index("--epochs") + 1])
LR = str(GRID.optimizer_args["lr"])
STEPS_PER_EPOCH = 8  # 256 samples, 2 ranks, batches of 16
#: the grid's cells, and the configuration labels the report gives them
CELLS = {"sync": "persistent-sync-none-w2", "async": "persistent-async-none-w2",
         "ssp s=2": "persistent-ssp2-none-w2"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARAMSERVER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example under DDP (2 processes with torchrun's environment, as torchrun would
    start them) and, meanwhile, under paramserver's launcher (sync; run here, in-process)."""
    tmp = tmp_path_factory.mktemp("ddp-port")
    script = [sys.executable, str(EXAMPLE / "train.py"), "--epochs", str(EPOCHS)]
    port = str(free_port())
    ddp = [subprocess.Popen(
        [*script, "--ddp", "--lr", LR, "--losses", str(tmp / "ddp")], cwd=ROOT,
        env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        spec = ClusterSpec(
            num_servers=1, num_workers=2,
            server=ServerConfig(mode="sync", optimizer="sgd", optimizer_args={"lr": float(LR)}),
            worker=WorkerConfig(servers=[]),
            command=[*script, "--losses", str(tmp / "ps"),
                     "--snapshot", str(tmp / "snapshot.safetensors")])
        with mock.patch.dict(os.environ, _env(), clear=True):  # the workers' environment
            run_cluster(spec, tmp / "run")
    finally:
        for proc in ddp:
            output, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, output[-3000:]
    return tmp


@pytest.fixture(scope="module")
def grid(runs: Path) -> Path:
    """The example's grid as its README runs it, from the repository root (the spec's
    command is relative to it): sync, async and ssp:2, worker 0 4x slower."""
    out = runs / "grid"
    # the spec's "python" is the one on PATH: this interpreter's, as in an activated venv
    env = _env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    with mock.patch.dict(os.environ, env, clear=True), contextlib.chdir(ROOT):
        result = CliRunner().invoke(experiment, [
            "--spec", "examples/ddp_port/grid.toml", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_sync_equals_ddp_to_the_last_digit(runs):
    for rank in (0, 1):
        ddp = json.loads((runs / "ddp" / f"rank{rank}.json").read_text())
        ps = json.loads((runs / "ps" / f"rank{rank}.json").read_text())
        assert len(ddp) == EPOCHS * STEPS_PER_EPOCH
        assert ps == ddp  # every step, every digit
        assert sum(ddp[-STEPS_PER_EPOCH:]) < sum(ddp[:STEPS_PER_EPOCH])  # it trained
    assert json.loads((runs / "ps" / "rank0.json").read_text()) != \
        json.loads((runs / "ps" / "rank1.json").read_text())  # each rank its own share


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_port_reports_through_opt_log_and_keeps_a_snapshot(runs):
    events = runs / "run" / "events"
    for rank in (0, 1):  # opt.log(loss=...) joined each step's record
        logged = [s["loss"] for s in read_events(events / f"worker{rank}.jsonl", "step")]
        assert logged == json.loads((runs / "ps" / f"rank{rank}.json").read_text())
    # worker 0 evaluates (launch's default): once an epoch, then after opt.final() (every
    # worker done) the final weights, which are result.json's figures
    evals = read_events(events / "worker0.jsonl", "eval")
    assert [e["clock"] for e in evals] == [STEPS_PER_EPOCH * (k + 1) for k in range(EPOCHS)] \
        + [STEPS_PER_EPOCH * EPOCHS]
    assert [e.get("final", False) for e in evals] == [False] * EPOCHS + [True]
    assert read_events(events / "worker1.jsonl", "eval") == []
    result = json.loads((runs / "run" / "result.json").read_text())
    assert result["eval"] == {"loss": evals[-1]["loss"], "accuracy": evals[-1]["accuracy"]}
    assert result["eval_of"] == "final_weights"
    assert evals[-1]["accuracy"] > 0.5  # 4 classes: well above chance
    assert json.loads((runs / "snapshot.safetensors.json").read_text()) == {"EPOCHS_RUN": EPOCHS}


def test_the_grid_compares_the_modes_under_a_straggler_that_does_not_evaluate():
    assert GRID.command is not None and GRID.command[1] == "examples/ddp_port/train.py"
    assert [str(m) for m in GRID.modes] == ["sync", "async", "ssp:2"]
    assert [c.id for c in GRID.configurations()] == list(CELLS.values())
    for config in GRID.configurations():  # 'persistent' slows worker 0: worker 1 evaluates
        assert GRID.evaluator_of(config) == 1


@pytest.mark.integration
@pytest.mark.timeout(480)  # with the module's DDP and launch runs: ~2 min on 2 idle cores
def test_the_grid_runs_every_cell_and_reports_the_three_modes(grid):
    index = json.loads((grid / "experiment.json").read_text())
    assert [(r["config"], r["seed"], r["ok"]) for r in index["runs"]] == \
        [(cell, 0, True) for cell in CELLS.values()]
    for cell in CELLS.values():  # every worker of every cell ran the script to its end
        run = grid / "runs" / cell / "seed0"
        result = json.loads((run / "result.json").read_text())
        assert [(w["worker"], w["steps"]) for w in result["workers"]] == \
            [(0, EPOCHS * STEPS_PER_EPOCH), (1, EPOCHS * STEPS_PER_EPOCH)]
        # worker 1, not the straggler, evaluated: once an epoch, then the final weights
        # after opt.final(), once the straggler was done too
        evals = read_events(run / "events" / "worker1.jsonl", "eval")
        assert [e["clock"] for e in evals] == \
            [STEPS_PER_EPOCH * (k + 1) for k in range(EPOCHS)] + [STEPS_PER_EPOCH * EPOCHS]
        assert evals[-1]["final"] is True and result["eval_of"] == "final_weights"
        assert read_events(run / "events" / "worker0.jsonl", "eval") == []
    md = (grid / "report.md").read_text()
    html = (grid / "report.html").read_text()
    for label in CELLS:  # the three modes, each a row of figures in both tables
        rows = [line for line in md.splitlines() if line.startswith(f"| {label} |")]
        assert len(rows) == 2 and all("failed" not in row for row in rows), rows
        assert html.count(f"<td>{label}</td>") == 2
    assert "Held-out evaluation: worker 1 evaluates" in md
    assert "examples/ddp_port/train.py" in md


@pytest.mark.integration
@pytest.mark.timeout(480)
def test_the_grids_sync_cell_equals_ddp_to_the_last_digit(runs, grid):
    """The grid's sync cell is the DDP run's configuration (same command, workers, lr);
    the straggler's delays change when steps happen, not what they compute."""
    events = grid / "runs" / CELLS["sync"] / "seed0" / "events"
    for rank in (0, 1):
        ddp = json.loads((runs / "ddp" / f"rank{rank}.json").read_text())
        logged = [s["loss"] for s in read_events(events / f"worker{rank}.jsonl", "step")]
        assert logged == ddp  # every step, every digit
    for mode in ("async", "ssp s=2"):  # the others did not: worker 1 outran the straggler
        events = grid / "runs" / CELLS[mode] / "seed0" / "events"
        logged = [s["loss"] for s in read_events(events / "worker1.jsonl", "step")]
        assert logged != json.loads((runs / "ddp" / "rank1.json").read_text())
