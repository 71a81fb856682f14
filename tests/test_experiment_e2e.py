"""Experiments over real processes: a small grid through the CLI, the custom task and
policy example, and the published claims about sync, SSP and async."""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from paramserver.cli.experiment import experiment
from paramserver.observe.events import read_events
from paramserver.workers.experiments.runner import run_experiment
from paramserver.workers.experiments.spec import ExperimentSpec, load_spec

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _table(md: str, scenario: str) -> dict[str, dict[str, str]]:
    """The rows of one scenario's tables (outcome, dynamics), by configuration label, each
    by column name."""
    section = md.split(f"## Scenario '{scenario}'")[1].split("\n## ")[0]
    merged: dict[str, dict[str, str]] = {}
    for table in re.findall(r"(?:^\|.*\n?)+", section, flags=re.M):
        header, _, *cells = [[c.strip() for c in row.strip().strip("|").split("|")]
                             for row in table.strip().splitlines()]
        for c in cells:
            merged.setdefault(c[0], {}).update(zip(header, c, strict=True))
    return merged


def _median(cell: str) -> float:
    return float(re.match(r"-?[\d.]+", cell).group())  # type: ignore[union-attr]


@pytest.mark.timeout(600)  # 4 runs of 3 processes each: ~40 s on 2 idle cores
def test_small_grid_end_to_end(tmp_path):
    out = tmp_path / "exp"
    args = ["--mode", "sync", "--mode", "ssp:1", "--seeds", "2", "--steps", "30",
            "--workers", "2", "--num-servers", "1", "--scenario", "transient", "--eval-every", "3",
            "--min-step-time", "0.01", "--target-loss", "2.25", "--out", str(out)]
    result = CliRunner().invoke(experiment, args)
    assert result.exit_code == 0, result.output
    assert f"report: {out / 'report.md'}" in result.output
    assert "configuration" in result.output and "ssp s=1" in result.output  # summary table

    # the run directory: resolved spec, environment, index, report, images
    spec = load_spec(out / "spec.toml")
    assert [str(m) for m in spec.modes] == ["sync", "ssp:1"] and spec.seeds == [0, 1]
    env = json.loads((out / "environment.json").read_text())
    assert env["packages"]["torch"] and env["packages"]["pyzmq"] and "git_commit" in env
    index = json.loads((out / "experiment.json").read_text())
    assert [(r["config"], r["seed"], r["ok"]) for r in index["runs"]] == [
        ("transient-sync-none-w2", 0, True), ("transient-ssp1-none-w2", 0, True),
        ("transient-sync-none-w2", 1, True), ("transient-ssp1-none-w2", 1, True)]
    for name in ("transient-loss.png", "transient-staleness.png",
                 "transient-ssp1-none-w2-clocks.png"):
        assert (out / "images" / name).read_bytes()[:4] == b"\x89PNG"
    html = (out / "report.html").read_text()
    # every figure inlined: the three above and the work, throughput, step-time and
    # accuracy plots
    assert html.count("data:image/png;base64,") == len(list((out / "images").glob("*.png")))
    assert len(list((out / "images").glob("*.png"))) == 3 + 4

    # every step of every worker is in steps.jsonl, with what the issue asks for
    table = _table((out / "report.md").read_text(), "transient")
    for config, label in (("transient-sync-none-w2", "sync"), ("transient-ssp1-none-w2",
                                                                 "ssp s=1")):
        ups, accs, stale_max, gaps = [], [], [], []
        for seed in (0, 1):
            run = out / "runs" / config / f"seed{seed}"
            records = read_events(run / "steps.jsonl")
            steps = [r for r in records if r["event"] == "step"]
            assert len(steps) == 2 * 30
            assert [r["t"] for r in records] == sorted(r["t"] for r in records)
            assert {"t", "worker", "clock", "read_versions", "staleness", "accepted", "reasons",
                    "weight", "loss"} <= set(steps[0])
            assert any(r["event"] == "eval" and "accuracy" in r for r in records)
            # the table's figures, recomputed from the raw logs
            res = json.loads((run / "result.json").read_text())
            starts = [e["t"] for r in range(2)
                      for e in read_events(run / "events" / f"worker{r}.jsonl", "worker_start")]
            train = max(s["t"] for s in steps) - max(starts)
            ups.append(res["servers"][0]["version"] / train)
            accs.append(100 * res["eval"]["accuracy"])
            pushes = read_events(run / "events" / "server0.jsonl", "push")
            assert len(pushes) == 60 and all(p["accepted"] for p in pushes)
            stale_max.append(max(p["staleness"] for p in pushes))
            gaps.append(res["servers"][0]["max_answered_gap"])
        row = table[label]
        assert _median(row["updates/s"]) == pytest.approx(statistics.median(ups), abs=0.051)
        assert _median(row["final accuracy (%)"]) == pytest.approx(statistics.median(accs),
                                                                   abs=0.051)
        assert row["rejected (%)"] == "0.0"  # nothing rejected
        assert row["staleness p50/p95/max"].endswith(f"/ {statistics.median(stale_max):g}")
        assert _median(row["max clock gap"]) <= (1 if label == "ssp s=1" else 0)
        assert max(gaps) <= (1 if label == "ssp s=1" else 0)
    assert _median(table["sync"]["updates/s"]) < _median(table["ssp s=1"]["updates/s"])


@pytest.mark.timeout(300)
def test_custom_task_and_policy_example(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "custom"))
    spec = load_spec(ROOT / "examples" / "custom" / "experiment.toml", seeds=1, steps=20,
                     workers=[3], modes=["async"],
                     policies=["mypkg.policies:MyPolicy:tolerance=0,max_staleness=1"])
    result = run_experiment(spec, tmp_path / "custom")
    assert [o.ok for o in result.outcomes] == [True], result.outcomes
    run = tmp_path / "custom" / result.outcomes[0].plan.path
    pushes = read_events(run / "events" / "server0.jsonl", "push")
    # the policy decided: stale pushes were down-weighted (tau 1) or rejected (tau > 1)
    assert all(p["weight"] == 1.0 for p in pushes if p["staleness"] == 0)
    assert all(p["weight"] == 0.5 for p in pushes if p["staleness"] == 1)
    assert all(not p["accepted"] for p in pushes if p["staleness"] > 1)
    assert any(p["staleness"] >= 1 for p in pushes)
    summary = result.report.summaries[0]  # type: ignore[union-attr]
    assert summary.label == "async + MyPolicy(max_staleness=1, tolerance=0)"
    assert summary.runs[0].final_accuracy is not None


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 18 runs of 5 processes: about 4 min on 2 idle cores
def test_literature_claims(tmp_path):
    """Ho et al. 2013, Cui et al. 2014, with 4 workers: updates/s grow with the staleness
    bound under transient stragglers (3 seeds); without stragglers every mode needs about
    as many updates to reach the target (2 seeds: they agree within a few %); the SSP bound
    holds. Two grids, so that only the second pays for the steps sync needs to reach the
    target at a learning rate small enough for the claim (lr x staleness, see the docs)."""
    common = {"workers": [4], "servers": 1, "target_loss": 0.5}
    # 20 ms steps: the injected slowness, not the scheduler's noise, sets the pace
    throughput = run_experiment(ExperimentSpec(
        name="transient", modes=["sync", "ssp:1", "ssp:3", "async"], scenarios=["transient"],
        steps=120, eval_every=10, seeds=3, min_step_time=0.02, **common),
        tmp_path / "transient")
    load = os.getloadavg()[1]  # over the last 5 minutes: while the grid ran
    progress = run_experiment(ExperimentSpec(
        name="none", modes=["sync", "ssp:3", "async"], scenarios=["none"], steps=420,
        eval_every=2, seeds=2, min_step_time=0.01, optimizer_args={"lr": 0.05}, **common),
        tmp_path / "none")
    for result in (throughput, progress):
        assert not result.failed, result.failed
    # the first three claims; the large-batch and momentum ones need grids of their own
    rate, skipped, gap, *others = throughput.report.claims  # type: ignore[union-attr]
    assert [c.status for c in others] == ["skipped", "skipped"], others
    assert (skipped.status, gap.status) == ("skipped", "pass"), (skipped, gap)
    skipped, updates, gap, *others = progress.report.claims  # type: ignore[union-attr]
    assert [c.status for c in others] == ["skipped", "skipped"], others
    assert [c.status for c in (skipped, updates, gap)] == ["skipped", "pass", "pass"], (
        updates, gap)
    cores = os.cpu_count() or 1
    if rate.status == "fail" and load > 2 * cores:
        # wall-clock rates on a machine running more than twice as many processes as it
        # has cores measure the scheduler, not the consistency model
        pytest.xfail(f"load average {load:.1f} on {cores} cores: {rate.detail}")
    assert rate.status == "pass", rate
