"""``--replicas`` outside ``paramserver launch``'s own loop, over real processes and
loopback sockets: a shard's replicas started by hand with ``paramserver server``
(the commands docs/cli.md shows, run as written but for the ports), its primary
SIGKILLed mid-run, and the run ends with every acknowledged push in the version once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from paramserver.observe.events import read_events
from tests.ports import free_port
from tests.test_cli_e2e import LIMIT, PARAMSERVER, env, reaper, start  # noqa: F401

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
STEPS = 200


def _doc_commands() -> list[list[str]]:
    """The hand-started replicas block of docs/cli.md, one argument list per command."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    block = text.split("runs these four commands) -->", 1)[1].split("\n\n")[1]
    return [shlex.split(line) for line in block.strip().splitlines()]


def _wait_for(what: str, ok: object, procs: list[subprocess.Popen[bytes]],
              logs: list[Path]) -> None:
    deadline = time.monotonic() + LIMIT
    while not ok():  # type: ignore[operator]
        for proc, log in zip(procs, logs, strict=True):
            assert proc.poll() is None, f"{log.name} exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {LIMIT}s"
        time.sleep(0.1)


def test_replicas_started_by_hand_survive_a_primary_sigkill(tmp_path: Path) -> None:
    commands = _doc_commands()
    assert [c[1] for c in commands] == ["server", "server", "worker", "worker"]
    ports = {"5610": str(free_port()), "5611": str(free_port())}

    def local(args: list[str]) -> list[str]:
        return [re.sub(r"\b(5610|5611)\b", lambda m: ports[m.group(1)], a) for a in args]

    backup_args, primary_args, *worker_args = (local(c[1:]) for c in commands)
    logs = [tmp_path / n for n in ("backup.log", "primary.log", "worker0.log", "worker1.log")]
    events = [tmp_path / "backup.jsonl", tmp_path / "primary.jsonl"]
    backup = start([*PARAMSERVER, *backup_args, "--event-log", str(events[0])], logs[0])
    _wait_for("the backup listening", lambda: b"PARAMSERVER_READY" in logs[0].read_bytes(),
              [backup], logs[:1])
    primary = start([*PARAMSERVER, *primary_args, "--event-log", str(events[1])], logs[1])
    # paced, so that the kill lands while pushes stream
    workers = [start([*PARAMSERVER, *args, "--device", "cpu", "--min-step-time", "0.01",
                      "--result-file", str(tmp_path / f"worker{r}.json")],
                     logs[2 + r]) for r, args in enumerate(worker_args)]
    procs = [backup, primary, *workers]

    def pushes() -> int:
        return len(read_events(events[1], "push")) if events[1].exists() else 0

    _wait_for("20 pushes", lambda: pushes() >= 20, procs, logs)
    os.kill(primary.pid, signal.SIGKILL)
    primary.wait()
    for r, w in enumerate(workers):
        assert w.wait(LIMIT) == 0, logs[2 + r].read_text()[-3000:]
    results = [json.loads((tmp_path / f"worker{r}.json").read_text()) for r in range(2)]
    assert [r["accepted"] for r in results] == [STEPS, STEPS]
    # the backup took over at epoch 1 and every acknowledged push is in its version once
    (failover,) = read_events(events[0], "failover")
    assert failover["epoch"] == 1
    entry = worker_args[0][worker_args[0].index("--servers") + 1]
    status = subprocess.run([*PARAMSERVER, "status", "--servers", entry, "--json"],
                            capture_output=True, text=True, env=env(), timeout=LIMIT)
    assert status.returncode == 0, status.stderr
    (shard,) = json.loads(status.stdout)
    assert shard["version"] == 2 * STEPS
    assert sum(1 for p in read_events(events[0], "push") if p["t"] > failover["t"]) > 0
    for r in range(2):
        assert "its primary is now" in logs[2 + r].read_text()
    backup.send_signal(signal.SIGINT)
    assert backup.wait(LIMIT) == 0, logs[0].read_text()[-3000:]
