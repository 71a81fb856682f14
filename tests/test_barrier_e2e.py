"""Waiting at a barrier is not a dead shard (issue 15): a pull a live shard holds at
its sync barrier waits past --timeout (up to --barrier-timeout, with progress lines),
while a shard that stops answering is still named within --timeout.

Real processes over loopback; small timeouts, so each test takes seconds.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.test_cli_e2e import PARAMSERVER, assert_gone, reaper, start, watch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
__all__ = ["reaper"]  # the autouse fixture that kills what a failed test left running
LIMIT = 200.0
FAST = ["--timeout", "2", "--request-timeout", "0.5", "--heartbeat-interval", "0.2"]


def _launch(tmp_path: Path, *extra: str) -> tuple[int, str, str]:
    out = tmp_path / "run"
    proc = start([*PARAMSERVER, "launch", "-s", "1", "-n", "2", "--mode", "sync", "--steps",
                  "5", "--device", "cpu", "--task", "tests.cli_tasks:slow_load", "--out",
                  str(out), "--quiet", *FAST, *extra], tmp_path / "launch.log")
    pids = watch(proc, LIMIT)
    assert_gone(pids)
    worker0 = out / "logs" / "worker0.log"
    return (proc.returncode, (tmp_path / "launch.log").read_text(),
            worker0.read_text() if worker0.exists() else "")


def test_a_slow_peer_keeps_a_worker_at_the_barrier_past_the_timeout(tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, text, worker0 = _launch(tmp_path, "--task-arg", "seconds=7")
    assert code == 0, text + worker0
    assert time.monotonic() - t0 > 7  # worker 0 waited well past --timeout 2
    # the wait is reported as what it is, while it lasts
    assert "shard 0 is alive and holding your pull for worker 0 (clock 0)" in worker0
    assert "waiting for 2 workers to register (1 have)" in worker0
    assert "no reply within" not in worker0 + text


def test_the_barrier_timeout_bounds_the_wait_and_says_why(tmp_path: Path) -> None:
    code, text, worker0 = _launch(tmp_path, "--task-arg", "seconds=120",
                                  "--barrier-timeout", "4")
    assert code == 1, text
    assert "BarrierTimeoutError" in worker0 or "giving up after --barrier-timeout 4s" in text
    assert ("shard 0 is alive and holding your pull for worker 0 (clock 0), waited "
            in text + worker0)
    assert "giving up after --barrier-timeout 4s" in text + worker0
    assert "does not answer" not in text + worker0


def test_a_dead_shard_is_named_quickly_while_a_lone_worker_waits(tmp_path: Path) -> None:
    """A lone worker against --expected-workers 2 waits; kill the shard: it says so."""
    port = free_port()
    server = start([*PARAMSERVER, "server", "--port", str(port), "--mode", "sync",
                    "--expected-workers", "2"], tmp_path / "server.log")
    worker = start([*PARAMSERVER, "worker", "--servers", f"127.0.0.1:{port}", "--rank", "0",
                    "--world-size", "2", "--steps", "5", "--device", "cpu", *FAST],
                   tmp_path / "worker.log")
    log = tmp_path / "worker.log"
    deadline = time.monotonic() + LIMIT
    while "is alive and holding your pull" not in log.read_text():  # poll for the state
        assert worker.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    # still waiting after several --timeout periods: the barrier is not a failure
    assert worker.poll() is None, log.read_text()
    server.send_signal(signal.SIGKILL)
    server.wait(30)
    killed = time.monotonic()
    assert worker.wait(60) != 0
    took = time.monotonic() - killed
    text = log.read_text()
    assert f"shard 0 at tcp://127.0.0.1:{port} does not answer" in text, text
    assert "no reply to this request or to heartbeats" in text
    assert took < 20, f"the dead shard was named after {took:.1f}s"
