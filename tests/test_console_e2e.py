"""The console of a foreground ``paramserver server`` (issue 31, item 4): a real shard
process over loopback, two workers (clients in this process) that join, one that dies
and comes back as a new process, both finishing; the server's stderr tells that
story, in order, from its event records; ``--quiet`` silences it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from paramserver.observe.console import render
from paramserver.observe.events import read_events
from paramserver.wire.protocol import Message, Op
from paramserver.workers.client import PSClient
from tests.test_hostile_e2e import PLAN

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 60.0


def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-1, 1, 128), "b": torch.zeros(16)}


def _grads() -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, 0.01) for k, v in _params().items()}


def _until(what: str, ok: Callable[[], bool], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + LIMIT
    while not ok():
        assert proc.poll() is None, f"the server exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[str], str, Path]]]:
    """Start ``paramserver server ARGS``: (the process, its address, its stderr file)."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], str, Path]:
        err = tmp_path / f"server{len(procs)}.err"
        proc = subprocess.Popen(
            [sys.executable, "-m", "paramserver.cli", "server", "--port", "0",
             "--mode", "async", "--expected-workers", "2", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err.open("w"), text=True)
        procs.append(proc)
        assert proc.stdout is not None
        ready = proc.stdout.readline()  # PARAMSERVER_READY tcp://HOST:PORT pid=N
        assert ready.startswith("PARAMSERVER_READY "), err.read_text()
        return proc, ready.split()[1], err

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(LIMIT)


def _train(client: PSClient, steps: int, clock: int) -> int:
    params = _params()
    for _ in range(steps):
        pulled = client.pull(params, clock)
        assert client.push(_grads(), pulled.versions, 4, clock).accepted
        clock += 1
    return clock


def _console(err: Path) -> list[str]:
    """The console's lines, without their time of day."""
    return [re.sub(r" \d\d:\d\d:\d\d ", " ", line, count=1)
            for line in err.read_text().splitlines()
            if re.match(r"paramserver: \d\d:\d\d:\d\d ", line)]


def test_the_server_console_tells_join_death_rejoin_and_done_in_order(
        server: Callable[..., tuple[subprocess.Popen[str], str, Path]], tmp_path: Path) -> None:
    events = tmp_path / "server.jsonl"
    proc, address, err = server("--heartbeat-timeout", "0.5", "--checkpoint-dir",
                                str(tmp_path / "ckpt"), "--event-log", str(events))
    w0 = PSClient([address], PLAN, worker=0, heartbeat_interval=0.1, timeout=20)
    w1 = PSClient([address], PLAN, worker=1, heartbeat_interval=0.1, timeout=20)
    try:
        assert w0.connect() == 0 and w1.connect() == 0
        w0.initialize(_params())
        clock1 = _train(w1, 2, 0)
        clock0 = _train(w0, 5, 0)
        w1.close()  # no BYE, no heartbeats: it died
        _until("worker 1 declared dead", lambda: "worker 1 dead" in err.read_text(), proc)
        back = PSClient([address], PLAN, worker=1, heartbeat_interval=0.1, timeout=20)
        try:  # a new process with the id: it resumes at the slowest live clock, worker 0's
            assert back.connect() == clock0 == 5
            _train(back, 1, clock0)
            back.bye()
        finally:
            back.close()
        w0.bye()
        _until("all done", lambda: "done at version" in err.read_text(), proc)
    finally:
        w0.close()
        w1.close()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(LIMIT) == 0, err.read_text()

    lines = _console(err)
    version = 8  # async: one step per push, 2 + 5 + 1
    expected = [
        "paramserver: shard 0 of 1 listening on " + address + " (async, policy ",
        "paramserver: worker 0 joined at clock 0",
        "paramserver: worker 1 joined at clock 0",
        "paramserver: training started: 2 worker(s) (0, 1), async, at version 0",
        f"paramserver: worker 1 dead at clock {clock1}: no heartbeat for 0.5s",
        f"paramserver: worker 1 restarted: rejoined at clock {clock1} -> resumes at "
        f"{clock0}, the slowest live worker's clock",
        f"paramserver: worker 1 finished at clock {clock0 + 1}",
        f"paramserver: worker 0 finished at clock {clock0}",
        f"paramserver: all 2 worker(s) done at version {version} after ",
        f"paramserver: checkpoint written at version {version}: ",
        f"paramserver: shard 0 stopped at version {version}",
    ]
    assert len(lines) == len(expected), "\n".join(lines)
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start), f"{line!r} does not start with {start!r}"
    # each line is its event record's, in the log's order
    rendered = [render(r["event"], r) for r in read_events(events)]
    assert [f"paramserver: {x}" for x in rendered if x is not None] == lines


def test_a_worker_declared_dead_that_heartbeats_again_is_back(
        server: Callable[..., tuple[subprocess.Popen[str], str, Path]]) -> None:
    """The same process, silent past the timeout and then heard again: no new HELLO,
    a worker_back record, and the clock it resumes at."""
    proc, address, err = server("--heartbeat-timeout", "0.5")
    w0 = PSClient([address], PLAN, worker=0, heartbeat_interval=0.1, timeout=20)
    w1 = PSClient([address], PLAN, worker=1, heartbeat_interval=600, timeout=20)  # silent
    try:
        w0.connect(), w1.connect()
        w0.initialize(_params())
        clock1, clock0 = _train(w1, 1, 0), _train(w0, 3, 0)
        _until("worker 1 declared dead", lambda: "worker 1 dead" in err.read_text(), proc)
        w1.call([Message(Op.HEARTBEAT, 0, {"worker": 1})], "HEARTBEAT")
        w1.bye()
        w0.bye()
    finally:
        w0.close()
        w1.close()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(LIMIT) == 0, err.read_text()
    lines = _console(err)
    dead = lines.index(f"paramserver: worker 1 dead at clock {clock1}: no heartbeat for 0.5s")
    assert lines[dead + 1:dead + 3] == [
        f"paramserver: worker 1 heartbeats again after it was declared dead: rejoined at "
        f"clock {clock1} -> resumes at {clock0}, the slowest live worker's clock",
        f"paramserver: worker 1 finished at clock {clock0}"], "\n".join(lines)


def test_quiet_prints_none_of_it(
        server: Callable[..., tuple[subprocess.Popen[str], str, Path]], tmp_path: Path) -> None:
    """A quiet server and a quiet `paramserver worker` process: nothing on stderr, though
    the records are written and the worker's summary is on stdout."""
    events = tmp_path / "server.jsonl"
    # (a later flag wins: one worker, one process less to start)
    proc, address, err = server("--quiet", "--event-log", str(events), "--expected-workers", "1")
    worker_err = tmp_path / "worker.err"
    worker = subprocess.Popen(
        [sys.executable, "-m", "paramserver.cli", "worker", "--quiet", "--servers", address,
         "--rank", "0", "--world-size", "1", "--steps", "3", "--device", "cpu"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=worker_err.open("w"), text=True)
    try:
        out = worker.communicate(timeout=LIMIT)[0]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(LIMIT)
    assert worker.returncode == 0, worker_err.read_text()
    assert "worker 0: 3 steps" in out, out
    proc.send_signal(signal.SIGINT)
    assert proc.wait(LIMIT) == 0, err.read_text()
    # the records are there, and not one line of them on the console
    assert {"server_start", "training_start", "worker_bye", "all_done", "server_stop"} <= \
        {r["event"] for r in read_events(events)}
    assert [err.read_text(), worker_err.read_text()] == ["", ""]
