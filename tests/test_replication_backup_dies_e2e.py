"""A backup SIGKILLed while its primary serves (issue 32): the primary sees its
connection down for the failover timeout and its host refusing the port
(paramserver/server/peerprobe.py: a dead process, not a partition), drops it, and
goes on alone; nothing a worker saw acknowledged is lost. Real processes on loopback,
started by hand (tests/replicas_by_hand.py)."""

from __future__ import annotations

import contextlib
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


def _pair(tmp_path: Path, replicas: list[Replica]) -> tuple[Replica, Replica]:
    """A backup, then its primary, each added to ``replicas`` (stopped by the caller)."""
    backup = start("backup", _config(tmp_path, "backup", replica=1), tmp_path)
    replicas.append(backup)
    primary = start("primary", _config(tmp_path, "primary", replica_peers=[backup.address]),
                    tmp_path)
    replicas.append(primary)
    return primary, backup


def test_a_dead_backup_is_dropped_and_the_primary_goes_on(tmp_path: Path) -> None:
    replicas: list[Replica] = []
    try:
        primary, backup = _pair(tmp_path, replicas)
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


def test_a_paused_backup_is_dropped_and_joins_again_when_it_wakes(tmp_path: Path) -> None:
    """A backup SIGSTOPped (issue 42): its connection stays up (its kernel answers TCP)
    but it acknowledges nothing. The primary drops it once an input waited the
    failover timeout plus the TCP margin (backuplink.SILENCE), answers the worker
    again and says why; SIGCONTed, the backup asks the primary before it would take
    over, learns it is no longer counted, and joins again from a snapshot."""
    import time

    from paramserver.server.backuplink import SILENCE

    replicas: list[Replica] = []
    try:
        primary, backup = _pair(tmp_path, replicas)
        numel = 1024
        params = {"w": torch.zeros(numel)}
        with PSClient([f"{primary.address}|{backup.address}"], flat_plan(numel, 1), 0,
                      timeout=60.0) as client:
            clock = client.connect()
            client.initialize(params)
            versions = client.pull(params, clock).versions
            os.kill(backup.popen.pid, signal.SIGSTOP)
            began = time.monotonic()
            pushed, pulled = client.push_pull({"w": torch.ones(numel)}, versions, 1,
                                              clock, params)
            waited = time.monotonic() - began
            assert pushed.accepted and pulled.versions == (1,)
            assert 0.5 + SILENCE <= waited < 0.5 + SILENCE + 20.0
            (lost,) = read_events(tmp_path / "primary.jsonl", "backup_lost")
            assert lost["backup"] == backup.address
            assert "acknowledged nothing" in lost["reason"]
            os.kill(backup.popen.pid, signal.SIGCONT)
            versions, clock = pulled.versions, clock + 1
            deadline = time.monotonic() + 60.0
            while not read_events(tmp_path / "primary.jsonl", "backup_joined"):
                assert time.monotonic() < deadline, backup.log.read_text()[-3000:]
                pushed, pulled = client.push_pull({"w": torch.ones(numel)}, versions, 1,
                                                  clock, params)
                versions, clock = pulled.versions, clock + 1
            client.bye()
        assert read_events(tmp_path / "backup.jsonl", "failover") == []
        assert shutdown_servers([primary.address, backup.address]) == []
        for r in replicas:
            assert r.popen.wait(30) == 0, r.log.read_text()[-2000:]
    finally:
        for r in replicas:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.popen.pid, signal.SIGCONT)
            r.stop()
    (joined,) = read_events(tmp_path / "primary.jsonl", "backup_joined")
    assert joined["backup"] == backup.address
