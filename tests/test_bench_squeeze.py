"""``python -m paramserver.benchmarks.squeeze`` runs (a smoke run, ``--quick``): a row per
spec and call, and the selection's rows beside torch.topk."""

from __future__ import annotations

import pytest

from paramserver.benchmarks import squeeze


def test_quick_run_prints_a_row_per_spec_and_call(capsys: pytest.CaptureFixture[str]) -> None:
    squeeze.main(["--quick", "--spec", "int8", "--spec", "topk:ratio=0.01"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines()
            if line.startswith("| ") and "spec" not in line]
    calls = [(r[0][2:], r[1]) for r in rows]
    assert calls[:6] == [(s, c) for s in ("int8", "topk:ratio=0.01")
                         for c in ("push", "pull", "land")]
    assert [c for _, c in calls[6:]] == ["select 16384", "select 65536"]
    assert all(r[3].endswith("x |") for r in rows[6:])
