"""A primary busy in one handler for longer than the failover timeout is not failed
over (issue 32): its keep-alives go out from a thread of their own
(paramserver/server/keepalive.py), so the backup goes on hearing it while its loop
works through one large push. Real processes on loopback; the primary's first push
holds its loop for four times the timeout (tests/busy_primary_script.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paramserver.benchmarks.ps import flat_plan
from paramserver.observe.events import read_events
from paramserver.server.config import ServerConfig
from paramserver.workers.admin import shutdown_servers
from paramserver.workers.client import PSClient
from paramserver.workers.failover import ask_roles, primary_of
from tests.replicas_by_hand import Replica, replica_config, start

pytestmark = pytest.mark.integration

TIMEOUT = 0.5  # the failover timeout; the busy push takes BUSY
BUSY = 4 * TIMEOUT
SCRIPT = str(Path(__file__).with_name("busy_primary_script.py"))


def _config(out: Path, name: str, **kw: object) -> ServerConfig:
    return replica_config(out, name, TIMEOUT, **kw)


def test_a_primary_busy_longer_than_the_timeout_is_not_failed_over(tmp_path: Path) -> None:
    replicas: list[Replica] = []
    try:
        backup = start("backup", _config(tmp_path, "backup", replica=1), tmp_path)
        replicas.append(backup)
        primary = start("primary", _config(tmp_path, "primary",
                                           replica_peers=[backup.address]),
                        tmp_path, script=[SCRIPT, str(BUSY)])
        replicas.append(primary)
        entry = f"{primary.address}|{backup.address}"
        numel = 1024
        params = {"w": torch.zeros(numel)}
        with PSClient([entry], flat_plan(numel, 1), 0, timeout=60.0) as client:
            clock = client.connect()
            client.initialize(params)
            versions = client.pull(params, clock).versions
            for step in range(3):  # the first one keeps the primary busy for BUSY s
                pushed, pulled = client.push_pull({"w": torch.ones(numel)}, versions, 1,
                                                  clock, params)
                assert pushed.accepted and all(o.applied for o in pushed.outcomes), step
                versions, clock = pulled.versions, clock + 1
            assert versions == (3,)
            # the primary is still the primary at epoch 0, the backup still its backup
            roles = ask_roles([primary.address, backup.address], timeout=5.0)
            assert primary_of(roles) == (primary.address, 0)
            assert (r := roles[backup.address]) is not None and r.role == "backup"
            assert client.failover is not None and client.failover.moves == 0
            client.bye()
        assert shutdown_servers([primary.address, backup.address]) == []
        for r in replicas:
            assert r.popen.wait(30) == 0, r.log.read_text()[-2000:]
    finally:
        for r in replicas:
            r.stop()
    # the backup applied the three pushes and never took over
    assert read_events(tmp_path / "backup.jsonl", "failover") == []
    (stop,) = read_events(tmp_path / "backup.jsonl", "server_stop")
    assert stop["version"] == 3
    assert read_events(tmp_path / "primary.jsonl", "stepped_down") == []
