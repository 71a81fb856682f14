"""Membership against real shard processes over loopback (issue 29, items 3, 12, 15): a
HELLO flood while a real worker lives, a silent member of a sync round and of an SSP
gate with bound 1, and two real worker processes with one rank."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.errors import TooManyWorkersError
from paramserver.observe.events import read_events
from paramserver.server.loop import ServerConfig
from paramserver.wire.protocol import PROTOCOL_VERSION
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig
from tests.test_hostile_e2e import PLAN, Hostile

pytestmark = pytest.mark.integration


def _cluster(tmp_path: Path, workers: int = 1, servers: int = 1,
             worker: dict[str, Any] | None = None, **server: Any) -> LocalCluster:
    spec = ClusterSpec(num_servers=servers, num_workers=workers,
                       server=ServerConfig(**server),
                       worker=WorkerConfig(**(worker or {})), evaluate=False)
    return LocalCluster(spec, tmp_path)


def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-1, 1, 128), "b": torch.zeros(16)}


def _grads() -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, 0.01) for k, v in _params().items()}


# ---------------------------------------------------------------- item 3


def test_a_hello_flood_does_not_evict_a_worker_between_its_init_and_first_pull(
        tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        params = _params()
        client = PSClient([address], PLAN, worker=0, heartbeat_interval=0.2, timeout=20)
        bad = Hostile(address)
        try:
            clock = client.connect()
            client.initialize(params)  # INIT sent, no pull yet
            hello = {"role": "worker", "protocol": PROTOCOL_VERSION, "plan_hash": PLAN.hash}
            codes: Counter[str] = Counter()
            for i in range(5000):
                bad.send("hello", {**hello, "worker": 10 + i, "incarnation": f"f{i}"})
                if i % 500 == 499:  # stay under zmq's high-water mark
                    for _ in range(500):
                        head = bad.recv()
                        codes[str(head["f"].get("code", "ok"))] += 1
            # bare HELLOs evict each other; the worker keeps its place
            assert codes == {"ok": 5000}
            stats = server_stats([address])[0]
            assert "0" in stats.workers and stats.core.workers_known <= 64
            # its pull (sent raw: the client would say HELLO again on not_registered)
            assert bad.code("pull", {"worker": 0, "clock": clock}) == "ok"
            pulled = client.pull(params, clock)
            out = client.push(_grads(), pulled.versions, 4, clock)
            assert out.accepted
        finally:
            bad.close()
            client.close()


def test_a_full_table_of_live_workers_refuses_a_newcomer_too_many_workers(
        tmp_path: Path) -> None:
    with _cluster(tmp_path, max_workers=1) as cluster:
        (address,) = cluster.start_servers()
        first = PSClient([address], PLAN, worker=0, heartbeat_interval=0.2, timeout=20)
        second = PSClient([address], PLAN, worker=1, heartbeat_interval=0.2, timeout=20)
        try:
            first.connect()
            first.initialize(_params())  # live, not pulled yet
            with pytest.raises(TooManyWorkersError) as exc:
                second.connect()
            assert "the worker table is full (1 of 1, all live workers)" in str(exc.value)
            assert "--max-workers" in str(exc.value)
            assert "0" in server_stats([address])[0].workers
        finally:
            second.close()
            first.close()


# ---------------------------------------------------------------- item 12


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_silent_member_is_left_out_at_the_round_deadline(tmp_path: Path, mode: str) -> None:
    """Worker 1 says HELLO, pulls once and then only heartbeats; worker 0's pull, held
    by the sync round or the SSP gate (bound 1), is released by --round-timeout."""
    with _cluster(tmp_path, workers=2, mode=mode, staleness_bound=1 if mode == "ssp" else 0,
                  heartbeat_timeout=120.0, round_timeout=1.0) as cluster:
        (address,) = cluster.start_servers()
        params = _params()
        # without the deadline the held pull would wait forever: bounded, it fails
        legit = PSClient([address], PLAN, worker=0, heartbeat_interval=0.2, timeout=30,
                         barrier_timeout=60)
        silent = PSClient([address], PLAN, worker=1, heartbeat_interval=0.2, timeout=30)
        try:
            legit.connect()
            silent.connect()
            legit.initialize(params)
            silent.pull(_params(), 0)  # once; its heartbeat thread keeps it live
            for clock in range(3):
                pulled = legit.pull(params, clock)  # sync: 1 held; ssp: 2 held
                out = legit.push(_grads(), pulled.versions, 4, clock)
                assert out.accepted
            stats = server_stats([address])[0]
            assert stats.workers["1"].live
            left = read_events(tmp_path / "events" / "server0.jsonl", "worker_left_out")
            assert [e["worker"] for e in left] == [1]
            assert left[0]["deadline"] == 1.0
            assert stats.version == 3  # every push stepped
        finally:
            silent.close()
            legit.close()


# ---------------------------------------------------------------- item 15


def test_two_worker_processes_with_one_rank_one_is_refused_naming_the_rank(
        tmp_path: Path) -> None:
    """Both started at once against two SSP shards: one trains, the other exits 1
    with ``rank 0 is already in use by a live worker (pid ... on ...)``."""
    worker = {"task": "digits-mlp", "steps": 100_000, "heartbeat_interval": 0.25,
              "request_timeout": 1.0, "timeout": 60.0,
              "straggler": StragglerSpec(min_step_time=0.01)}
    with _cluster(tmp_path, servers=2, worker=worker, mode="ssp", staleness_bound=2,
                  heartbeat_timeout=1.0) as cluster:
        addresses = cluster.start_servers()
        procs: list[subprocess.Popen[bytes]] = []
        done: queue.Queue[int] = queue.Queue()
        try:
            for twin in ("a", "b"):
                cfg = cluster.spec.worker_config(0, addresses, tmp_path / twin)
                (tmp_path / twin / "events").mkdir(parents=True)
                path = tmp_path / twin / "worker.json"
                path.write_text(json.dumps(cfg.to_dict()))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "paramserver.workers.worker", str(path)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            for i, proc in enumerate(procs):
                threading.Thread(target=lambda i=i, p=proc: (p.wait(), done.put(i)),
                                 daemon=True).start()
            loser = done.get(timeout=150)
            winner = procs[1 - loser]
            assert winner.poll() is None  # it trains on
            assert procs[loser].returncode == 1
            assert procs[loser].stderr is not None
            err = procs[loser].stderr.read().decode()
            last = err.strip().splitlines()[-1]
            assert last.startswith("worker 0: rank 0 is already in use by a live worker "
                                   f"(pid {winner.pid} on "), err[-2000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)
                if proc.stderr is not None:
                    proc.stderr.close()
