"""Worker and shard failures, and a lossy network, over real processes."""

from __future__ import annotations

import itertools
import os
import signal

import pytest

from paramserver.errors import RequestTimeoutError
from paramserver.observe.events import read_events
from paramserver.server.loop import ServerConfig
from paramserver.util import faults
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster, run_cluster
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig

pytestmark = pytest.mark.integration

HEARTBEAT_TIMEOUT = 2.0


def spec(mode, workers=3, steps=60, **kw):
    server = kw.pop("server", {})
    worker = kw.pop("worker", {})
    return ClusterSpec(
        num_servers=2, num_workers=workers,
        server=ServerConfig(**{"mode": mode, "staleness_bound": 2,
                               "heartbeat_timeout": HEARTBEAT_TIMEOUT, **server}),
        worker=WorkerConfig(**{"servers": [], "task": "digits-mlp", "steps": steps,
                               "request_timeout": 1.0, "heartbeat_interval": 0.25,
                               "straggler": StragglerSpec(min_step_time=0.01), **worker}),
        **kw,
    )


def kill_when(cluster, proc_of, at_steps, rank=None):
    """An on_progress callback that SIGKILLs one process once, after `at_steps` steps
    (all workers' together, or worker `rank`'s own)."""
    state = {"killed": None}

    def cb(progress):
        done = progress.done_steps if rank is None else progress.steps.get(rank, 0)
        if state["killed"] is None and done >= at_steps:
            proc = proc_of(cluster)
            os.kill(proc.popen.pid, signal.SIGKILL)
            state["killed"] = proc.name
    return cb, state


@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "sync-parts"])
def test_worker_killed_mid_run_the_others_finish(tmp_path, mode):
    # sync-parts: every push in many small parts, so the kill may land half-way
    # through one (the round is then void); the run must finish all the same
    parts = {"part_bytes": 1, "chunk_bytes": 1024} if mode == "sync-parts" else {}
    mode = mode.removesuffix("-parts")
    s = spec(mode, on_worker_failure="tolerate", worker=parts)
    with LocalCluster(s, tmp_path) as cluster:
        cluster.start_servers()
        cluster.start_workers()
        cb, state = kill_when(cluster, lambda c: c.workers[2], at_steps=45)
        cluster.wait_workers(cb, poll=0.05)
        assert state["killed"] == "worker2"
        assert [f.process for f in cluster.failures] == ["worker2"]
    for rank in (0, 1):
        end = read_events(tmp_path / "events" / f"worker{rank}.jsonl", "worker_end")
        assert end and end[0]["steps"] == 60
    dead = read_events(tmp_path / "events" / "server0.jsonl", "worker_dead")
    assert [d["worker"] for d in dead] == [2]
    if mode == "sync":
        # the longest time between two sync steps: at most the heartbeat timeout plus a step
        times = [p["t"] for p in read_events(tmp_path / "events" / "server0.jsonl", "push")
                 if p["accepted"]]
        stall = max(b - a for a, b in itertools.pairwise(times))
        assert stall <= HEARTBEAT_TIMEOUT + 1.0, stall


def test_restarted_worker_rejoins_and_completes(tmp_path):
    s = spec("ssp", on_worker_failure="restart")
    with LocalCluster(s, tmp_path) as cluster:
        cluster.start_servers()
        cluster.start_workers()
        # killed after its own 10th logged step, so that it has a clock to resume from
        # and its event log holds the torn tail a SIGKILL leaves, whatever the others do
        cb, _ = kill_when(cluster, lambda c: c.workers[1], at_steps=25, rank=1)
        cluster.wait_workers(cb, poll=0.05)
        assert [r.process for r in cluster.restarts] == ["worker1"]
    hellos = read_events(tmp_path / "events" / "server0.jsonl", "worker_hello")
    rejoin = [h for h in hellos if h["worker"] == 1][-1]
    assert rejoin["clock"] > 0  # resumed where the live workers were, not from 0
    end = read_events(tmp_path / "events" / "worker1.jsonl", "worker_end")[-1]
    assert end["clock"] == 60
    starts = read_events(tmp_path / "events" / "worker1.jsonl", "worker_start")
    assert [s["clock"] > 0 for s in starts] == [False, True]  # no record glued to a torn one


def test_shard_killed_and_restarted_from_checkpoint(tmp_path):
    base = spec("sync", steps=80)
    reference = run_cluster(base, tmp_path / "reference")
    # run_timeout: a hung run fails with every process's last log lines, before the
    # suite's per-test timeout would say only where the test was waiting
    s = spec("sync", steps=80, restart_servers=True, run_timeout=120,
             server={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 10})
    with LocalCluster(s, tmp_path / "run") as cluster:
        cluster.start_servers()
        cluster.start_workers()
        cb, state = kill_when(cluster, lambda c: c.servers[1], at_steps=120)
        cluster.wait_workers(cb, poll=0.05)
        assert state["killed"] == "server1"
        assert cluster.restarts and cluster.restarts[0].resumed
        from paramserver.workers.launch.finalfigures import final_eval
        final = final_eval(s, cluster.addresses, tmp_path / "run")
        from paramserver.workers.admin import shutdown_servers
        shutdown_servers(cluster.addresses)
    want = reference.eval["loss"]
    assert abs(final["loss"] - want) <= 0.1 * want, (final, reference.eval)


def test_run_timeout_names_who_is_still_running_and_what_they_logged(tmp_path):
    s = spec("async", workers=2, steps=100_000, run_timeout=1.5,
             worker={"straggler": StragglerSpec(min_step_time=0.05)})
    with LocalCluster(s, tmp_path) as cluster:
        cluster.start_servers()
        cluster.start_workers()
        with pytest.raises(RequestTimeoutError) as err:
            cluster.wait_workers(poll=0.05)
    text = str(err.value)
    assert text.startswith("workers still running after 1.5s: worker0, worker1")
    for name in ("worker0", "worker1", "server0", "server1"):
        assert f"--- {name} (" in text
    assert "serving at" in text  # a shard's own log line, not just its name


def test_a_stalled_run_is_reported_with_every_log_tail_and_so_is_its_resumption(
        tmp_path, caplog):
    # a worker frozen (SIGSTOP) while the shards still count it live holds every sync
    # round: the launcher says so, naming who runs and what each logged last
    s = spec("sync", workers=2, steps=40, stall_warning=2.0,
             server={"heartbeat_timeout": 60.0})
    frozen: dict[str, int] = {}
    with LocalCluster(s, tmp_path) as cluster:
        cluster.start_servers()
        cluster.start_workers()

        def cb(progress):
            pid = cluster.workers[1].popen.pid
            if not frozen and progress.steps.get(1, 0) >= 10:
                os.kill(pid, signal.SIGSTOP)
                frozen["at"] = progress.done_steps
            elif frozen and "thawed" not in frozen and cluster.stalls:
                os.kill(pid, signal.SIGCONT)
                frozen["thawed"] = progress.done_steps

        with caplog.at_level("WARNING", logger="paramserver.workers.launch.cluster"):
            cluster.wait_workers(cb, poll=0.05)
    assert "thawed" in frozen
    kinds = [stall.stalled for stall in cluster.stalls]
    assert kinds[:2] == [True, False]
    assert cluster.stalls[0].quiet >= 2.0
    warning = next(r.getMessage() for r in caplog.records
                   if r.getMessage().startswith("no worker has logged a step"))
    assert "still running: worker0, worker1" in warning
    for name in ("worker0", "worker1", "server0", "server1"):
        assert f"--- {name} (" in warning
    for rank in (0, 1):
        end = read_events(tmp_path / "events" / f"worker{rank}.jsonl", "worker_end")
        assert end and end[0]["steps"] == 40
    logged = read_events(tmp_path / "events" / "launcher.jsonl", "stall")
    assert [e["stalled"] for e in logged] == kinds
    assert logged[0]["running"] == ["worker0", "worker1"]
    end = read_events(tmp_path / "events" / "launcher.jsonl", "launcher_end")
    assert end[0]["stalls"] == kinds.count(True)


def test_lossy_network_sync_pushes_in_parts_added_once(tmp_path, monkeypatch):
    # every push in many parts, 10 % of messages lost: retried parts are not added twice
    monkeypatch.setenv(faults.DROP_RATE, "0.1")  # (the workers inherit it)
    s = spec("sync", workers=2, steps=20, worker={"request_timeout": 0.25,
                                                  "part_bytes": 1, "chunk_bytes": 8192})
    result = run_cluster(s, tmp_path)
    for shard in result.servers:
        assert shard["counters"]["push_parts_streamed"] >= 2 * 20 * 2
        assert shard["version"] == 20 and shard["rounds_voided"] == 0
        for w in shard["workers"].values():
            assert w["pushes"] == 20 == w["applied"]


def test_lossy_network_every_push_applied_once(tmp_path, monkeypatch):
    # a lost message costs one request timeout: short, so that the test is too
    monkeypatch.setenv(faults.DROP_RATE, "0.1")  # (the workers inherit it)
    s = spec("async", workers=2, steps=40, worker={"request_timeout": 0.25})
    result = run_cluster(s, tmp_path)
    for shard in result.servers:
        for w in shard["workers"].values():
            rejected = sum(w["rejected"].values())
            assert w["pushes"] == 40 == w["applied"] + rejected
        assert shard["version"] == 80  # no push applied twice, none lost
        assert shard["counters"].get("duplicate_pushes", 0) > 0  # retries did happen
    for rank in (0, 1):
        steps = read_events(tmp_path / "events" / f"worker{rank}.jsonl", "step")
        assert len(steps) == 40
