"""A backup SIGKILLed while its primary serves (issue 32): the primary sees its
connection down for the failover timeout and its host refusing the port
(paramserver/server/peerprobe.py: a dead process, not a partition), drops it, and
goes on alone; nothing a worker saw acknowledged is lost. Real processes on loopback,
started by hand (tests/replicas_by_hand.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from paramserver.benchmarks.ps import flat_plan
from paramserver.observe.events import read_events
from paramserver.server.config import ServerConfig
from paramserver.workers.admin import shutdown_servers
from paramserver.workers.client import PSClient
from tests.replicas_by_hand import Replica, replica_config, start

pytestmark = pytest.mark.integration


def _config(out: Path, name: str, **kw: object) -> ServerConfig:
    return replica_config(out, name, 0.5, **kw)


def test_a_dead_backup_is_dropped_and_the_primary_goes_on(tmp_path: Path) -> None:
    replicas: list[Replica] = []
    try:
        backup = start("backup", _config(tmp_path, "backup", replica=1), tmp_path)
        replicas.append(backup)
        primary = start("primary", _config(tmp_path, "primary",
                                           replica_peers=[backup.address]), tmp_path)
        replicas.append(primary)
        numel = 1024
        params = {"w": torch.zeros(numel)}
        accepted = 0
        with PSClient([f"{primary.address}|{backup.address}"], flat_plan(numel, 1), 0,
                      timeout=60.0) as client:
            clock = client.connect()
            client.initialize(params)
            versions = client.pull(params, clock).versions
            for step in range(6):
                if step == 3:
                    os.kill(backup.popen.pid, signal.SIGKILL)
                    backup.popen.wait(30)
                pushed, pulled = client.push_pull({"w": torch.ones(numel)}, versions, 1,
                                                  clock, params)
                accepted += pushed.accepted and all(o.applied for o in pushed.outcomes)
                versions, clock = pulled.versions, clock + 1
            client.bye()
        assert accepted == 6 and versions == (6,)
        assert shutdown_servers([primary.address]) == []
        assert primary.popen.wait(30) == 0, primary.log.read_text()[-2000:]
    finally:
        for r in replicas:
            r.stop()
    (lost,) = read_events(tmp_path / "primary.jsonl", "backup_lost")
    assert lost["backup"] == backup.address and "down for 0.5s" in lost["reason"]
    assert lost["backups"] == 0
    (stop,) = read_events(tmp_path / "primary.jsonl", "server_stop")
    assert stop["version"] == 6
