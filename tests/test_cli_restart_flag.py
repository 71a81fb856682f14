"""`launch --restart-workers` restarts dead workers (ClusterSpec.on_worker_failure)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import paramserver.workers.launch.cluster
from paramserver.cli.main import main


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("args", "expected"), [
    (["--restart-workers"], "restart"),
    (["--on-worker-failure", "tolerate"], "tolerate"),
    ([], "fail"),
])
def test_restart_workers_flag(monkeypatch, tmp_path, args, expected):
    seen = {}

    def fake_run_cluster(spec, out, **kwargs):
        seen["policy"] = spec.on_worker_failure
        raise _Stop

    monkeypatch.setattr(paramserver.workers.launch.cluster, "run_cluster", fake_run_cluster)
    CliRunner().invoke(main, ["launch", "-s", "1", "-n", "1", "--steps", "2", "--quiet",
                              "--out", str(tmp_path), *args])
    assert seen["policy"] == expected
