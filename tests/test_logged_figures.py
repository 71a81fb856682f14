"""Figures a script logs are its own, bounded and finite (issue 42, item 6).

On main ``opt.log(worker=nan)`` or ``clock=inf`` overwrote the optimizer's own fields
of a step record and the launcher's observer raised from its wait loop; 100,000
distinct names made 100,000 Prometheus series and 6 MB ``metrics`` records. Now the
launcher skips records whose own fields are not the optimizer's, keeps only finite
figures, at most MAX_FIGURES names per worker (one warning, then a drop), and nothing
in a worker's log raises. (The rule is observe/figures.py; opt.log drops the
optimizer's names through it.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from paramserver.observe.figures import MAX_FIGURES, FigureGate, reserved
from paramserver.observe.recorder import LauncherObserver

GOOD = {"event": "step", "worker": 0, "clock": 1, "t": 1.0, "loss": 0.5, "staleness": 0}


def _observe(tmp_path: Path, records: list[Any]) -> tuple[LauncherObserver, list[dict]]:
    (tmp_path / "events").mkdir()
    with (tmp_path / "events" / "worker0.jsonl").open("w") as fh:
        for rec in records:  # json writes NaN and Infinity, as a script's log may hold
            fh.write(json.dumps(rec) + "\n")
    obs = LauncherObserver(tmp_path)
    obs.poll()
    obs.close()
    lines = (tmp_path / "events" / "launcher.jsonl").read_text().splitlines()
    return obs, [json.loads(line) for line in lines]


@pytest.mark.parametrize("own", [
    {"worker": float("nan")}, {"clock": float("inf")}, {"worker": "0"}, {"worker": True},
    {"worker": -1}, {"clock": [1]}, {"t": float("nan")}, {"worker": 7},
])
def test_a_record_whose_own_fields_are_broken_is_skipped(tmp_path: Path,
                                                         own: dict[str, Any]) -> None:
    obs, _ = _observe(tmp_path, [GOOD, {**GOOD, **own, "clock": own.get("clock", 2)}, 5, "x",
                                 {"event": "eval"}, {**GOOD, "clock": 3}])
    snap = obs.registry.snapshot()
    assert json.dumps(snap)  # and nothing raised
    assert obs._steps == 2  # the two good step records of worker 0, the others skipped


def test_only_finite_figures_are_kept_and_odd_fields_do_not_raise(tmp_path: Path) -> None:
    rec = {**GOOD, "lr": float("nan"), "f1": float("inf"), "ok": 2.5, "staleness": "x",
           "push_s": [1], "bytes": float("inf"), "accepted": "no"}
    obs, _ = _observe(tmp_path, [rec, {"event": "eval", "worker": 0, "clock": 1,
                                       "loss": float("nan"), "accuracy": 0.5}])
    text = json.dumps(obs.registry.snapshot(), allow_nan=False)  # nothing non-finite in it
    assert '"ok"' in text and '"lr"' not in text and '"f1"' not in text
    assert obs._steps == 1


def test_names_are_capped_per_worker_with_one_warning(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    many = {**GOOD, **{f"m{i}": float(i) for i in range(100_000)}}
    with caplog.at_level(logging.WARNING):
        obs, lines = _observe(tmp_path, [many, {**many, "clock": 2}])
    text = json.dumps(obs.registry.snapshot())
    assert text.count('"m') <= MAX_FIGURES
    assert max(len(json.dumps(r)) for r in lines) < 64 * 1024  # not 6 MB
    assert sum("distinct logged figure names" in r.message for r in caplog.records) == 1


def test_the_gate_and_the_optimizers_names() -> None:
    gate = FigureGate("worker 0", limit=3)
    assert gate.admit({"a": 1, "b": float("nan"), "c": True, "d": 2.0, 5: 1.0}) == {"a": 1.0,
                                                                                  "d": 2.0}
    assert gate.admit({"e": 1.0, "f": 1.0, "a": 3.0}) == {"e": 1.0, "a": 3.0}
    for name in ("worker", "clock", "staleness", "t", "event", "accepted", "local_steps"):
        assert reserved(name, False)
    for name in ("worker", "clock", "versions"):
        assert reserved(name, True)
    assert not reserved("loss", False) and not reserved("accuracy", True)


def test_a_script_never_overwrites_the_optimizers_fields(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    gate = FigureGate("worker 0")
    with caplog.at_level(logging.WARNING):
        step = gate.unreserved({"worker": float("nan"), "clock": float("inf"), "lr": 0.1},
                               held_out=False)
        held = gate.unreserved({"versions": 1.0, "accuracy": 0.5}, held_out=True)
    assert step == {"lr": 0.1} and held == {"accuracy": 0.5}
    assert sum("writes itself" in r.message for r in caplog.records) == 1
