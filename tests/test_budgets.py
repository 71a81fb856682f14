"""Budgets (issue 16): an experiment to a fixed wall-clock time or a fixed total of
gradients computed, so that sync and async are compared on equal terms."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from paramserver.errors import ConfigError
from paramserver.observe.events import read_events
from paramserver.workers.experiments.runner import run_experiment, simulate_experiment
from paramserver.workers.experiments.spec import ExperimentSpec, dump_spec, load_spec
from paramserver.workers.launch.virtual import SimSpec


def _results(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "results").glob("worker*.json"))]


def _step_intervals(run_dir: Path) -> list[float]:
    """Seconds between consecutive steps of each worker (and from its start to its first)."""
    out = []
    for path in sorted((run_dir / "events").glob("worker*.jsonl")):
        starts = read_events(path, "worker_start")
        times = [starts[0]["t"]] + [e["t"] for e in read_events(path, "step")]
        out += [b - a for a, b in itertools.pairwise(times)]
    return out


def test_wall_budget_ends_every_mode_at_the_same_virtual_time(tmp_path):
    # worker 0 is 4x slower: 60 ms steps against 15 ms. 4 virtual seconds are more than
    # the default 250 steps of a fast async worker: the budget, not steps, stops it
    spec = ExperimentSpec(modes=["sync", "ssp:1", "async"], scenarios=["persistent"],
                          workers=[4], servers=1, seeds=1, eval_every=50, budget_seconds=4.0)
    result = simulate_experiment(spec, tmp_path / "sim", SimSpec(compute_time=0.01))
    assert not result.failed, result.failed
    slowest_step = 4 * spec.min_step_time
    ends: dict[str, list[float]] = {}
    steps: dict[str, list[int]] = {}
    for outcome in result.outcomes:
        workers = _results(tmp_path / "sim" / outcome.plan.path)
        assert len(workers) == 4 and all(w["budget_spent"] for w in workers)
        ends[str(outcome.plan.config.mode)] = [w["train_seconds"] for w in workers]
        steps[str(outcome.plan.config.mode)] = [w["steps"] for w in workers]
    every_end = [t for mode in ends.values() for t in mode]
    assert min(every_end) >= 4.0
    assert max(every_end) - min(every_end) <= slowest_step + 1e-9, ends
    # the same time, not the same steps: async's fast workers did many more than sync's
    assert min(steps["async"][1:]) > 250 > max(steps["sync"]), steps
    assert steps["async"][0] < 4.0 / slowest_step + 1
    report = (tmp_path / "sim" / "report.md").read_text()
    assert "budget: 4 s of training per worker" in report
    index = json.loads((tmp_path / "sim" / "experiment.json").read_text())
    assert {r["budget"] for r in index["runs"]} == {"4 s of training per worker"}


def test_gradients_budget_gives_every_mode_the_same_total(tmp_path):
    spec = ExperimentSpec(modes=["sync", "ssp:1", "async"], scenarios=["persistent"],
                          workers=[4], servers=1, seeds=1, eval_every=20,
                          budget_gradients=120)
    cluster = spec.cluster_spec(spec.configurations()[0], 0)
    assert cluster.worker.steps == 30 and cluster.worker.budget_seconds == 0
    result = simulate_experiment(spec, tmp_path / "sim", SimSpec(compute_time=0.01))
    assert not result.failed, result.failed
    assert result.report is not None
    totals = {s.label: s.runs[0].gradients for s in result.report.summaries}
    assert totals == {"sync": 120, "ssp s=1": 120, "async": 120}
    # the fast workers of async finished their share early and idled
    idle = {s.label: s.runs[0].idle_max_s for s in result.report.summaries}
    assert idle["async"] > idle["sync"]
    assert "budget: 120 gradients in total" in (tmp_path / "sim" / "report.md").read_text()


def test_budget_keys_are_checked_and_round_trip(tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        ExperimentSpec(budget_seconds=2.0, budget_gradients=40, workers=[4])
    with pytest.raises(ConfigError, match="not a multiple of 3 workers"):
        ExperimentSpec(budget_gradients=40, workers=[4, 3])
    with pytest.raises(ConfigError, match="budget_seconds must be >= 0"):
        ExperimentSpec(budget_seconds=-1.0)
    spec = ExperimentSpec(budget_seconds=2.5)
    cluster = spec.cluster_spec(spec.configurations()[0], 0)
    assert cluster.worker.steps is None and cluster.worker.budget_seconds == 2.5
    path = tmp_path / "spec.toml"
    path.write_text(dump_spec(spec))
    assert load_spec(path) == spec
    assert load_spec(path, budget_seconds=0.0).budget == "250 steps per worker"


@pytest.mark.timeout(300)
def test_real_wall_budget_trains_every_mode_for_the_same_seconds(tmp_path):
    """Real processes over loopback: sync and async with 2 workers and a 3 s budget train
    for the same seconds, within one step."""
    spec = ExperimentSpec(modes=["sync", "async"], scenarios=["none"], workers=[2],
                          servers=1, seeds=1, eval_every=50, min_step_time=0.02,
                          budget_seconds=3.0)
    result = run_experiment(spec, tmp_path / "real", report=False)
    assert [o.ok for o in result.outcomes] == [True, True], result.outcomes
    trained: dict[str, float] = {}
    longest_step = 0.0
    for outcome in result.outcomes:
        run_dir = tmp_path / "real" / outcome.plan.path
        workers = _results(run_dir)
        assert len(workers) == 2 and all(w["budget_spent"] for w in workers), workers
        assert all(w["train_seconds"] >= 3.0 for w in workers)
        trained[outcome.plan.config.mode.mode] = max(w["train_seconds"] for w in workers)
        longest_step = max(longest_step, *_step_intervals(run_dir))
    assert abs(trained["sync"] - trained["async"]) <= longest_step, (trained, longest_step)
