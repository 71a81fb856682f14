"""A replica of ``paramserver run`` started again in place of a dead one rejoins its
shard, as under ``launch`` (issue 47 item 3), over real processes and loopback sockets.

Four ranks of ``run --num-servers 1 --replicas 1`` in torchrun's environment (its
agent's store, here the test's), sync: ranks 0 and 1 are shard 0's replicas, found
through the store; the backup (rank 1) is SIGKILLed, the same rank is started again
by hand with the same command and environment, takes the dead one's address and joins
the primary (its ``backup_joined``); then the primary is SIGKILLed, so the run ends on
the replacement, which must hold the shard's state bit for bit: the final weights equal
those of the same run under ``launch`` without replicas or kills. (The one test of
``run --replicas``: it carries the primary SIGKILL that tests/test_replicas_surfaces_e2e.py
once ran in a job of its own.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from safetensors.torch import load_file

from paramserver.observe.events import read_events
from paramserver.server.config import ServerConfig
from paramserver.workers.config import WorkerConfig
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from tests.ports import free_port
from tests.test_cli_e2e import LIMIT, PARAMSERVER, env, reaper, start  # noqa: F401

pytestmark = pytest.mark.integration

STEPS = 40


def _wait_for(what: str, ok: Callable[[], bool], procs: list[subprocess.Popen[bytes]],
              logs: list[Path]) -> None:
    deadline = time.monotonic() + LIMIT
    while not ok():
        for proc, log in zip(procs, logs, strict=True):
            assert proc.poll() is None, f"{log.name} exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {LIMIT}s"
        time.sleep(0.1)


def _events(path: Path, kind: str) -> list[dict]:
    return read_events(path, kind) if path.exists() else []


def test_a_replica_run_starts_again_rejoins_and_holds_the_shard(tmp_path: Path) -> None:
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                     wait_for_workers=False)  # torchrun's agent would host it
    out = tmp_path / "run"
    events = out / "events"
    args = [*PARAMSERVER, "run", "--num-servers", "1", "--replicas", "1",
            "--failover-timeout", "1", "--heartbeat-timeout", "120", "--mode", "sync",
            "--steps", str(STEPS), "--device", "cpu", "--out", str(out),
            "--min-step-time", "0.08"]  # paced, so that the second kill lands mid-run

    def rank_env(r: int) -> dict[str, str]:  # one compute thread: the same bits as launch
        return env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1")

    logs = [tmp_path / f"rank{r}.log" for r in range(4)]
    procs = [start(args, logs[r], env=rank_env(r)) for r in range(4)]
    try:
        primary, workers = events / "server0.jsonl", procs[2:]
        _wait_for("5 rounds", lambda: len(_events(primary, "push")) >= 10, procs, logs)
        # both replicas of shard 0 placed through the store
        assert b"is replica 0 of shard 0" in logs[0].read_bytes()
        assert b"is replica 1 of shard 0" in logs[1].read_bytes()
        for w in workers:  # held while the backup is replaced (the primary waits idle)
            w.send_signal(signal.SIGSTOP)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        logs.append(tmp_path / "rank1-again.log")
        procs.append(start(args, logs[-1], env=rank_env(1)))
        live = [0, 2, 3, 4]
        _wait_for("the replacement's rejoin", lambda: bool(_events(primary, "backup_joined")),
                  [procs[k] for k in live], [logs[k] for k in live])
        text = logs[-1].read_text()
        assert "replica 1 of shard 0 (started in place of a dead one" in text, text
        (joined,) = _events(primary, "backup_joined")
        backup = events / "server0r1.jsonl"
        assert joined["backup"] in text  # it took the dead one's address
        pushes = len(_events(primary, "push"))
        for w in workers:
            w.send_signal(signal.SIGCONT)
        # a few rounds forwarded to the replacement, then the primary dies: the
        # replacement takes over and ends the run
        _wait_for("2 more rounds", lambda: len(_events(primary, "push")) >= pushes + 4,
                  [procs[k] for k in live], [logs[k] for k in live])
        os.kill(procs[0].pid, signal.SIGKILL)
        for k in (2, 3, 4):
            assert procs[k].wait(LIMIT) == 0, logs[k].read_text()[-3000:]
    finally:
        for w in procs[2:4]:
            if w.poll() is None:
                w.send_signal(signal.SIGCONT)
        del store
    (failover,) = _events(backup, "failover")
    assert failover["epoch"] == 1
    results = [json.loads((out / "results" / f"worker{r}.json").read_text()) for r in (0, 1)]
    assert [r["accepted"] for r in results] == [STEPS, STEPS]
    stops = _events(backup, "server_stop")
    assert stops[-1]["version"] == STEPS  # the replacement's stop: every round, once
    assert sum(1 for p in _events(backup, "push") if p["t"] > failover["t"]) > 0
    # the run ends as the same run without replicas or kills does, bit for bit
    plain = tmp_path / "plain"
    run_cluster(ClusterSpec(num_servers=1, num_workers=2, evaluate=False,
                            server=ServerConfig(mode="sync"),
                            worker=WorkerConfig(steps=STEPS, device="cpu")), plain)
    want = load_file(plain / "final_model.safetensors")
    got = load_file(out / "final_model.safetensors")
    assert want.keys() == got.keys() and want
    for key in want:
        assert want[key].equal(got[key]), key
