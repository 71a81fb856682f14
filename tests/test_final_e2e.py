"""Issue 43, item 2: a script grid's final figures are the final weights', not the
evaluating worker's last evaluation in its loop. Under a persistent straggler in async
the fast evaluator ends first; with ``opt.final()`` it waits for the straggler and
evaluates the weights every worker's pushes made. Real processes on loopback."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from paramserver.cli.experiment import experiment
from paramserver.observe.events import read_events
from paramserver.workers.experiments.report import summarize

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import final_script  # noqa: E402  (the script's model and held-out data)

SCRIPT = [sys.executable, str(ROOT / "tests" / "final_script.py")]


@pytest.mark.integration
@pytest.mark.timeout(300)  # 1 run of 3 processes: ~15 s on 2 idle cores
def test_a_script_grid_reports_the_final_weights_under_a_persistent_straggler(
        tmp_path: Path) -> None:
    out = tmp_path / "exp"
    result = CliRunner().invoke(experiment, [
        "--mode", "async", "--workers", "2", "--num-servers", "2", "--scenario",
        "persistent", "--min-step-time", "0.02", "--steps", "10", "--seeds", "1",
        "--out", str(out), "--", *SCRIPT])
    assert result.exit_code == 0, result.output
    run = out / "runs" / "persistent-async-none-w2" / "seed0"
    model = final_script.make_model()
    model.load_state_dict(load_file(str(run / "final_model.safetensors")))
    truth = final_script.evaluate(model)  # the final weights, as the servers hold them

    res = json.loads((run / "result.json").read_text())
    [summary] = summarize(out)
    [metrics] = summary.runs
    assert res["eval_of"] == "final_weights" and not summary.final_in_loop
    for got in (res["eval"]["loss"], metrics.final_loss, summary.stats["final_loss"].median):
        assert math.isclose(got, truth["loss"], rel_tol=1e-6), (got, truth)
    for got in (res["eval"]["accuracy"], metrics.final_accuracy):
        assert math.isclose(got, truth["accuracy"], rel_tol=1e-6), (got, truth)
    # the evaluator (worker 1: worker 0 is the straggler) ended first, and its last
    # in-loop evaluation is not of the final weights: the straggler's pushes came after
    evals = read_events(run / "events" / "worker1.jsonl", "eval")
    assert evals[-1].get("final") is True and not any(e.get("final") for e in evals[:-1])
    assert not math.isclose(evals[-2]["loss"], truth["loss"], rel_tol=1e-6)
    last_steps = [read_events(run / "events" / f"worker{r}.jsonl", "step")[-1]["t"]
                  for r in (0, 1)]
    assert last_steps[1] < last_steps[0] < evals[-1]["t"]
    row = next(line for line in (out / "report.md").read_text().splitlines()
               if line.startswith("| async "))
    assert f"| {truth['loss']:.3f} |" in row and "last in-loop" not in row, row


def test_a_command_runs_figures_say_whether_they_came_after_final(tmp_path: Path) -> None:
    """launch -- COMMAND: result.json's eval is the evaluating rank's last logged one,
    of the final weights only if it was logged after opt.final()."""
    from paramserver.workers.launch.finalfigures import logged_eval

    events = tmp_path / "events"
    events.mkdir()
    record = {"event": "eval", "worker": 1, "clock": 4, "versions": [4], "loss": 0.5}
    (events / "worker1.jsonl").write_text(json.dumps({**record, "t": 1.0}) + "\n")
    assert logged_eval(tmp_path, 2) == ({"loss": 0.5}, "last_in_loop")
    with (events / "worker1.jsonl").open("a") as fh:
        fh.write(json.dumps({**record, "t": 2.0, "loss": 0.25, "final": True}) + "\n")
    assert logged_eval(tmp_path, 2) == ({"loss": 0.25}, "final_weights")
    assert logged_eval(tmp_path / "none", 2) == ({}, None)
