"""Nothing outlives its launcher: a `launch -- COMMAND` run whose launcher is SIGKILLed
leaves no shard and no script running (paramserver/util/lifeline.py).

The launcher is a real `python -m paramserver.cli launch` process, killed while its
scripts train. Its children are then no longer ours (the kernel gives them to init),
so the test tracks them by pid itself, and kills any still there at the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from paramserver.observe.events import read_events
from tests.test_cli_e2e import PARAMSERVER, ROOT, alive, children, env

#: how long every child may take to end once its launcher is gone (the lifeline's
#: grace is 10 s; a script ends at its SIGTERM, a shard after saving)
WITHIN = 15.0


@pytest.fixture
def tracked() -> Iterator[set[int]]:
    """Pids the test watches; any left at the end is killed (the kernel reparents them,
    so the suite's own leftover check would not see them)."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes],
              log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited ({proc.returncode}) before {what}:\n"
                        f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:g}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def test_killing_the_launcher_stops_every_shard_and_script(tmp_path: Path,
                                                           tracked: set[int]) -> None:
    out, log = tmp_path / "run", tmp_path / "launch.log"
    # cold starts: the shards too are the launcher's direct children, as its scripts are
    # (forked ones are stopped by their zygote, tests/test_zygote.py)
    with log.open("wb") as fh:
        launcher = subprocess.Popen(
            [*PARAMSERVER, "launch", "-s", "1", "-n", "2", "--mode", "async", "--out",
             str(out), "--quiet", "--", sys.executable, str(ROOT / "tests/forever_script.py")],
            cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
            env=env(PARAMSERVER_SPAWN="exec"))
    tracked.add(launcher.pid)
    events = [out / "events" / f"worker{r}.jsonl" for r in range(2)]
    _wait_for("steps from both scripts",
              lambda: all(p.exists() and read_events(p, "step") for p in events),
              launcher, log)
    started = {p["name"]: p["pid"] for p in json.loads((out / "processes.json").read_text())}
    assert set(started) == {"server0", "worker0", "worker1"}
    family = set(started.values()) | children(launcher.pid)
    tracked.update(family)

    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + WITHIN
    while (left := {p for p in family if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    names = {pid: name for name, pid in started.items()}
    assert not left, (f"still running {WITHIN:g}s after the launcher was SIGKILLed: "
                      + ", ".join(names.get(p, str(p)) for p in sorted(left)))
