"""Local SGD in experiments (issue 33): the h=/outer= modes, the local-sgd preset, the
report's communication figures from recorded logs, and the literature checks on local
SGD, both on synthetic summaries (their logic) and on the preset in virtual time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from paramserver.errors import ConfigError
from paramserver.workers.experiments.index import ConfigEntry
from paramserver.workers.experiments.localclaims import check_local_sgd
from paramserver.workers.experiments.report import (
    ConfigSummary,
    RunMetrics,
    Stat,
    aggregate,
    load_run,
    run_metrics,
)
from paramserver.workers.experiments.spec import ExperimentSpec, ModeChoice, preset
from tests.test_report import fake_run

# ---------------------------------------------------------------- modes and the spec


def test_h_and_outer_parse_and_round_trip() -> None:
    mode = ModeChoice.parse("async:h=32,outer=delayed-nesterov")
    assert (mode.mode, mode.sync_every, mode.outer) == ("async", 32, "delayed-nesterov")
    assert ModeChoice.parse(str(mode)) == mode
    assert mode.label == "async (H=32, outer delayed-nesterov)"
    assert ModeChoice.parse("sync:h=8").slug == "sync-h8"
    with pytest.raises(ConfigError, match="give h=H too"):
        ModeChoice.parse("sync:outer=sgd")
    with pytest.raises(ConfigError, match="h=H, outer=NAME"):
        ModeChoice.parse("sync:h=x")


def test_a_local_mode_runs_the_inner_and_outer_optimizers() -> None:
    spec = ExperimentSpec(modes=["sync", "async:h=4,outer=delayed-nesterov"], steps=8,
                          seeds=[0], scenarios=["none"], local_args={"lr": 0.01},
                          outer_args={"lr": 0.5, "momentum": 0.8})
    plain, local = spec.configurations()
    c = spec.cluster_spec(plain, 0)
    assert (c.server.optimizer, c.worker.local_optimizer, c.worker.sync_every) == ("sgd", None, 1)
    c = spec.cluster_spec(local, 0)
    assert (c.server.optimizer, c.server.optimizer_args) == (
        "delayed-nesterov", {"lr": 0.5, "momentum": 0.8})
    assert (c.worker.local_optimizer, c.worker.local_args, c.worker.sync_every) == (
        "adamw", {"lr": 0.01}, 4)
    entry = spec.entry(local)
    assert (entry.sync_every, entry.outer, entry.momentum) == (4, "delayed-nesterov", 0.8)
    assert ConfigEntry.from_json(json.loads(json.dumps(entry.to_json()))) == entry


def test_local_modes_must_run_whole_rounds_and_valid_optimizers() -> None:
    with pytest.raises(ConfigError, match="not whole rounds of 32"):
        ExperimentSpec(modes=["sync:h=32"], steps=40)
    with pytest.raises(ConfigError, match="not whole rounds"):
        ExperimentSpec(modes=["sync:h=32"], budget_gradients=4 * 40)
    with pytest.raises(ConfigError):
        ExperimentSpec(modes=["sync:h=8"], steps=16, outer_args={"nope": 1})


def test_the_preset_compares_at_equal_gradients() -> None:
    spec = preset("local-sgd")
    modes = [str(m) for m in spec.modes]
    assert modes == ["sync", "sync:h=8", "sync:h=32", "sync:h=128", "async:h=32",
                     "async:h=32,outer=delayed-nesterov"]
    assert spec.scenarios == ["none", "persistent"] and spec.workers == [4]
    assert all(spec.cluster_spec(c, 0).worker.steps == spec.steps
               for c in spec.configurations())  # steps count gradients, in every mode
    from paramserver.cli.grid import PRESET_NAMES

    assert "local-sgd" in PRESET_NAMES


# ---------------------------------------------------------------- the report's figures


def test_local_steps_and_bytes_come_from_the_step_events(tmp_path: Path) -> None:
    """A push of H local steps counts H gradients; bytes and rounds are the events'."""
    fake_run(tmp_path, mode="sync", workers=2, steps=6, final={"loss": 1.0, "accuracy": 0.75})
    plain = run_metrics(load_run(tmp_path), seed=0, target_loss=1.65)
    for r in (0, 1):
        path = tmp_path / "events" / f"worker{r}.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for rec in records:
            if rec["event"] == "step":
                rec["local_steps"], rec["bytes"] = 4, 100 + r
        path.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    m = run_metrics(load_run(tmp_path), seed=0, target_loss=1.65)
    assert (plain.gradients, m.gradients) == (12, 48)
    assert m.gradients_per_s == pytest.approx(4 * plain.gradients_per_s)
    assert m.gradients_to_target == 4 * plain.gradients_to_target  # type: ignore[operator]
    assert [g for g, _, _ in m.work_curve] == [4 * g for g, _, _ in plain.work_curve]
    assert (m.rounds, m.bytes_per_worker) == (6, 6 * 100.5)
    assert m.bytes_curve[-1] == (6 * 100.5, 1.0)  # the final loss after every byte
    assert [loss for _, loss in m.bytes_curve] == [loss for _, _, loss in m.curve]
    assert [b for b, _ in m.bytes_curve] == sorted(b for b, _ in m.bytes_curve)


# ---------------------------------------------------------------- the claims' logic


def _summary(mode: str, h: int | None, loss: float, mb: float, outer: str | None = None,
             scenario: str = "none") -> ConfigSummary:
    run = RunMetrics(seed=0, train_seconds=1.0, updates=1, updates_per_s=1.0, pct_rejected=0,
                     staleness_p50=0, staleness_p95=0, staleness_max=0, max_clock_gap=0,
                     server_max_gap=None, wait_s=0, time_to_target=None,
                     updates_to_target=None, final_loss=loss, final_accuracy=None,
                     gradients=1024, bytes_per_worker=mb * 1e6)
    entry = ConfigEntry(id=f"{mode}{h}{outer}", scenario=scenario, label=f"{mode} {h}",
                        mode=mode, workers=4, sync_every=h,
                        outer=outer or ("sgd" if h else None))
    return aggregate(entry, [run])


def test_the_claims_pass_fail_and_skip_on_what_they_are_given() -> None:
    good = [_summary("sync", None, 0.30, 10.0), _summary("sync", 32, 0.32, 0.3),
            _summary("async", 32, 0.50, 0.3), _summary("async", 32, 0.34, 0.3,
                                                         "delayed-nesterov")]
    assert [c.status for c in check_local_sgd(good)] == ["pass"] * 3
    bad = [_summary("sync", None, 0.30, 10.0), _summary("sync", 32, 0.34, 1.0),
           _summary("async", 32, 0.50, 1.0), _summary("async", 32, 0.45, 1.0,
                                                        "delayed-nesterov")]
    diloco, naive, delayed = check_local_sgd(bad)
    assert diloco.status == "fail" and "over 110%" in diloco.detail \
        and "only 10.0x fewer" in diloco.detail
    assert naive.status == "pass"
    assert delayed.status == "fail" and "closed 27% of the gap" in delayed.detail
    only_sync = [_summary("sync", None, 0.3, 10.0), _summary("sync", 8, 0.3, 1.0)]
    assert [c.status for c in check_local_sgd(only_sync)] == ["skipped"] * 3
    assert check_local_sgd([_summary("sync", None, 0.3, 10.0)]) == []
    assert math.isfinite(Stat.of([1.0]).median)


# ---------------------------------------------------------------- from the preset


def test_the_preset_s_claims_in_virtual_time(tmp_path: Path) -> None:
    """The literature checks on the preset's configurations without stragglers,
    simulated with its 4 workers and 256 gradients each (the report states the
    same figures for the real run: docs/research.md)."""
    from paramserver.workers.experiments.report import summarize
    from paramserver.workers.experiments.runner import simulate_experiment

    spec = preset("local-sgd", scenarios=["none"], modes=[
        "sync", "sync:h=32", "async:h=32", "async:h=32,outer=delayed-nesterov"])
    result = simulate_experiment(spec, tmp_path, report=False)
    assert not result.failed
    summaries = summarize(tmp_path)
    by_label = {s.label: s for s in summaries}
    assert by_label["sync"].stats["rounds"].median == 256
    assert by_label["sync (H=32)"].stats["rounds"].median == 8
    diloco, naive, delayed = check_local_sgd(summaries)
    assert diloco.status == "pass", diloco
    assert naive.status == "pass", naive
    assert delayed.status == "pass", delayed
