"""Metrics, exports and the divergence watchdog over real shard and worker processes.

Each induced fault must raise its alarm within a bounded number of steps and
name the right worker; healthy runs must raise none. The faults live in
tests/observability_fixture.py (a task whose backward pass scales one rank's
gradient, a policy that rejects 19 pushes in 20): no test-only switches in the
production code.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from paramserver.cli.watch import render_status
from paramserver.observe.events import read_events
from paramserver.server.loop import ServerConfig
from paramserver.wire.stats import decode as decode_stats
from paramserver.workers.admin import shutdown_servers
from paramserver.workers.launch.cluster import ClusterError, ClusterSpec, LocalCluster, run_cluster
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig
from tests.observability_fixture import scrape

pytestmark = pytest.mark.integration

FIXTURE = "tests.observability_fixture"


def spec(mode="async", *, workers=3, shards=1, steps=40, seed=0, task="digits-mlp",
         task_args=None, stragglers=None, metrics_port=None, observe="every", **server):
    # every push measured: the delays asserted here are those of --observe every (the
    # default before issue 34); a budget's are tests/test_watchdog_delay.py's
    return ClusterSpec(
        num_servers=shards, num_workers=workers,
        server=ServerConfig(mode=mode, observe=observe, **server),
        worker=WorkerConfig(servers=[], task=task, task_args=task_args or {},
                            steps=steps, seed=seed),
        stragglers=stragglers or {}, evaluate=False, metrics_port=metrics_port,
    )


def alarms(out: Path, shards: int = 1) -> list[dict]:
    return [a for s in range(shards) for a in read_events(out / "events" / f"server{s}.jsonl",
                                                          "alarm")]


def first(found: list[dict], signal: str) -> dict:
    hits = [a for a in found if a["signal"] == signal]
    assert hits, f"no {signal} alarm among {[(a['signal'], a['worker']) for a in found]}"
    return hits[0]


# --------------------------------------------------------------------------- healthy runs


@pytest.mark.parametrize("mode,seed", [("sync", 0), ("sync", 1), ("async", 0), ("async", 1),
                                       ("ssp", 0), ("ssp", 1)])
def test_healthy_digits_runs_raise_no_alarm(tmp_path, mode, seed):
    # "stop": a divergence alarm would end the run with a ClusterError naming it (and
    # any alarm at all fails the assertion below)
    s = spec(mode, steps=70, seed=seed, staleness_bound=2, on_divergence="stop")
    result = run_cluster(s, tmp_path)
    assert result.alarms == () and alarms(tmp_path) == []
    pushes = read_events(tmp_path / "events" / "server0.jsonl", "push")
    # long enough for every rule but the lag rule to have judged
    assert len(pushes) == 210
    assert sum(p["cosine"] is not None for p in pushes) > 150
    assert all(p["loss"] is not None and p["grad_norm"] > 0 for p in pushes)


# --------------------------------------------------------------------------- exports


def test_prometheus_agrees_with_the_event_logs_and_staleness_with_the_workers(tmp_path):
    s = spec("async", shards=2, steps=30, metrics_port=0)
    with LocalCluster(s, tmp_path) as cluster:
        addresses = cluster.start_servers()
        ports = cluster.metrics_ports
        assert ports["launcher"] and ports["server0"] and ports["server1"]
        cluster.start_workers()
        cluster.wait_workers()
        cluster.observer.poll()  # everything the workers wrote
        scraped = [scrape(f"http://127.0.0.1:{ports[f'server{k}']}/metrics") for k in (0, 1)]
        launcher = scrape(f"http://127.0.0.1:{ports['launcher']}/metrics")
        shutdown_servers(addresses)
    events = tmp_path / "events"
    worker_steps = {r: read_events(events / f"worker{r}.jsonl", "step") for r in range(3)}
    per_push: dict[tuple[int, int], int] = {}  # (worker, clock) -> staleness, max over shards
    for k, got in enumerate(scraped):
        log = read_events(events / f"server{k}.jsonl")
        pushes = [e for e in log if e["event"] == "push"]
        for r in range(3):
            mine = [p for p in pushes if p["worker"] == r]
            labels = (("shard", str(k)), ("worker", str(r)))
            assert got[("paramserver_pushes_accepted_total", labels)] == len(mine) == 30
            hist = collections.Counter(p["staleness"] for p in mine)
            for le in (0, 1, 2, 3, 4, 8):
                bucket = ("paramserver_push_staleness_bucket", (("le", str(le)), *labels))
                assert got[bucket] == sum(n for tau, n in hist.items() if tau <= le)
            assert got[("paramserver_push_staleness_count", labels)] == 30
            assert got[("paramserver_push_grad_norm", labels)] == mine[-1]["grad_norm"]
            assert got[("paramserver_push_loss", labels)] == mine[-1]["loss"]
            for p in mine:
                key = (r, p["clock"])
                per_push[key] = max(per_push.get(key, 0), p["staleness"])
        assert got[("paramserver_shard_version", (("shard", str(k)),))] == 90
        # the last "metrics" snapshot (written at shutdown) holds what was scraped
        final = [e for e in log if e["event"] == "metrics"][-1]["metrics"]
        for name, rows in final.items():
            for row in rows:
                labels = tuple(sorted(row["labels"].items()))
                if "value" in row:
                    assert got[(name, labels)] == row["value"], (name, labels)
                else:
                    assert got[(f"{name}_count", labels)] == row["count"]
                    for le, n in row["buckets"].items():
                        assert got[(f"{name}_bucket", (("le", le), *labels))] == n
    # a worker's logged staleness is the max over shards of what each shard decided
    for r, steps in worker_steps.items():
        assert [st["staleness"] for st in steps] == [per_push[(r, st["clock"] - 1)]
                                                     for st in steps]
        labels = (("worker", str(r)),)
        hist = collections.Counter(st["staleness"] for st in steps)
        for le in (0, 1, 2, 4):
            bucket = ("paramserver_worker_staleness_bucket", (("le", str(le)), *labels))
            assert launcher[bucket] == sum(n for tau, n in hist.items() if tau <= le)
        assert launcher[("paramserver_worker_steps_total", labels)] == 30
    launcher_log = [e["event"] for e in read_events(events / "launcher.jsonl")]
    assert launcher_log[0] == "launcher_start" and launcher_log[-1] == "launcher_end"


def test_tensorboard_scalars_from_a_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = spec("async", workers=2, steps=10)
    s.tensorboard = str(tmp_path / "tb")
    run_cluster(s, tmp_path / "run")
    acc = EventAccumulator(str(tmp_path / "tb" / "shard0"))
    acc.Reload()
    versions = [e.value for e in acc.Scalars("paramserver_shard_version/shard=0")]
    assert versions and versions[-1] == 20
    launcher = EventAccumulator(str(tmp_path / "tb" / "launcher"))
    launcher.Reload()
    assert len(launcher.Scalars("loss/worker0")) == 10


# --------------------------------------------------------------------------- induced faults


def test_zero_and_negated_workers_are_named(tmp_path):
    seen: list[dict] = []
    s = spec("sync", workers=4, steps=30, task=f"{FIXTURE}:digits_bad_ranks",
             task_args={"zero_rank": 1, "negate_rank": 2})
    result = run_cluster(s, tmp_path, on_alarm=seen.append)
    found = alarms(tmp_path)
    zero = first(found, "zero_gradient")
    assert zero["worker"] == 1 and zero["version"] <= 6
    assert zero["figures"]["grad_norm"] == 0.0 < zero["figures"]["others_median_norm"]
    disagree = first(found, "gradient_disagrees")
    assert disagree["worker"] == 2 and disagree["version"] <= 25
    assert disagree["figures"]["cosine"] < 0 < disagree["figures"]["others_cosine"]
    named = {(a["signal"], a["worker"]) for a in found}
    assert named == {("zero_gradient", 1), ("gradient_disagrees", 2)}
    # the launcher handed each alarm to its callback as it came, and logged it
    assert [(a["signal"], a["worker"]) for a in seen] == [(a["signal"], a["worker"])
                                                          for a in found]
    assert [a["signal"] for a in result.alarms] == [a["signal"] for a in found]
    assert len(read_events(tmp_path / "events" / "launcher.jsonl", "alarm")) == len(found)
    # the live view shows both workers' figures and the alarms, from the STATS replies
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_status([decode_stats(s) for s in result.servers]))
    text = console.file.getvalue()
    assert "[zero_gradient] shard 0, worker 1" in text
    assert "[gradient_disagrees] shard 0, worker 2" in text
    rows = {line.split()[1]: line for line in text.splitlines()
            if line.startswith("│") and line.split()[1].isdigit()}
    assert set(rows) == {"0", "1", "2", "3"}


def test_learning_rate_zero_is_flagged_as_no_learning(tmp_path):
    s = spec("async", steps=80, optimizer_args={"lr": 0.0})
    run_cluster(s, tmp_path)
    found = alarms(tmp_path)
    low = first(found, "update_ratio_low")
    assert low["worker"] is None and low["version"] <= 12
    assert low["figures"]["ratio"] == 0.0 and low["figures"]["lr"] == 0.0
    stalled = first(found, "loss_stalled")
    assert stalled["version"] <= 240
    assert {a["signal"] for a in found} == {"update_ratio_low", "loss_stalled"}


def test_a_blow_up_stops_training_and_saves_a_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    s = spec("async", workers=2, steps=200, optimizer_args={"lr": 50.0},
             on_divergence="checkpoint-and-stop", checkpoint_dir=str(ckpt))
    with pytest.raises(ClusterError, match="divergence watchdog stopped training") as info:
        run_cluster(s, tmp_path / "run")
    found = alarms(tmp_path / "run")
    assert found[0]["signal"] == "update_ratio_high" and found[0]["version"] <= 5
    assert found[0]["figures"]["ratio"] > 0.5 and found[0]["figures"]["lr"] == 50.0
    assert "update_ratio_high" in str(info.value)
    diverged = read_events(tmp_path / "run" / "events" / "server0.jsonl", "diverged")
    assert diverged[0]["action"] == "checkpoint-and-stop"
    assert (ckpt / "diverged" / "shard0" / "LATEST").exists()
    assert not (ckpt / "shard0").exists()  # no shutdown checkpoint of diverged weights
    steps = [len(read_events(tmp_path / "run" / "events" / f"worker{r}.jsonl", "step"))
             for r in range(2)]
    assert max(steps) < 200  # training did stop


def test_gradient_ascent_is_a_rising_loss(tmp_path):
    s = spec("async", steps=100, optimizer_args={"lr": 0.03},
             task=f"{FIXTURE}:digits_bad_ranks", task_args={"ascend": True})
    run_cluster(s, tmp_path)
    rising = first(alarms(tmp_path), "loss_rising")
    assert rising["version"] <= 150  # the second block of 50 pushes
    assert rising["figures"]["loss"] > 2 * rising["figures"]["best_loss"]


def test_nan_applied_without_the_finite_check_breaks_the_weights(tmp_path):
    s = spec("async", workers=2, steps=20, check_finite=False,
             task=f"{FIXTURE}:digits_bad_ranks", task_args={"nan_rank": 1})
    run_cluster(s, tmp_path)
    found = alarms(tmp_path)
    nan_push = first(found, "nonfinite_gradient")
    assert nan_push["worker"] == 1
    assert "it was applied" in nan_push["message"]
    # the weights are broken by the step that applied it (when worker 1's first push
    # lands depends on how many worker 0 got in first: not a fixed version)
    assert first(found, "nonfinite_weights")["version"] <= nan_push["version"] + 1
    assert first(found, "nonfinite_loss")["worker"] in (0, 1)  # on the broken weights


def test_a_nan_gradient_names_its_worker_and_is_not_divergence(tmp_path):
    # "stop" acts on the model's own state only: a NaN push the shard refused is that
    # worker's fault (one worker key must not stop the run), so the shard serves on
    s = dataclasses.replace(spec("async", workers=2, steps=50, task=f"{FIXTURE}:digits_bad_ranks",
                                 task_args={"nan_rank": 1}, on_divergence="stop"),
                            on_worker_failure="tolerate")
    with LocalCluster(s, tmp_path) as cluster:
        cluster.start_servers()
        cluster.start_workers()
        cluster.wait_workers()  # worker 1 fails on its refused push; worker 0 finishes
        assert cluster.servers[0].popen.poll() is None
        assert [f.process for f in cluster.failures] == ["worker1"]
    found = alarms(tmp_path)
    assert found[0]["signal"] == "nonfinite_gradient" and found[0]["worker"] == 1
    assert "it was refused" in found[0]["message"]
    assert math.isnan(found[0]["figures"]["grad_norm"])
    assert not read_events(tmp_path / "events" / "server0.jsonl", "diverged")
    assert len(read_events(tmp_path / "events" / "worker0.jsonl", "step")) == 50
    assert "nonfinite" in (tmp_path / "logs" / "worker1.log").read_text()


def test_rejections_that_starve_training_and_a_worker_falling_behind(tmp_path):
    # lag_seconds: a lag must persist this long; 30 s by default, too long for a test
    s = spec("async", steps=400, policy=f"{FIXTURE}:KeepOneIn", policy_args={"every": 20},
             stragglers={0: StragglerSpec(delay="const:0.05")},
             watchdog={"lag_seconds": 0.3})
    with LocalCluster(s, tmp_path) as cluster:
        cluster.start_servers()
        cluster.start_workers()
        # the straggler would need 20 s to finish: stop as soon as the alarm is out
        deadline = time.monotonic() + 120
        while not any(a["signal"] == "worker_lag" for a in alarms(tmp_path)):
            assert time.monotonic() < deadline, "no worker_lag alarm"
            assert all(w.popen.poll() in (None, 0) for w in cluster.workers)
            time.sleep(0.2)  # polling the shard's event log
    found = alarms(tmp_path)
    starve = first(found, "rejection_rate")
    assert starve["worker"] is None and starve["version"] <= 10
    assert starve["figures"]["rejected_fraction"] > 0.9
    lag = first(found, "worker_lag")
    assert lag["worker"] == 0
    assert lag["figures"]["clock_lag"] > 50 and lag["figures"]["seconds"] >= 0.3
    assert {a["worker"] for a in found if a["signal"] == "worker_lag"} == {0}


def test_launch_prints_alarms_and_stops_on_divergence(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "paramserver.cli", "launch", "-s", "1", "-n", "1", "--steps", "40",
         "--lr", "0", "--on-divergence", "stop", "--watchdog-arg", "warmup_steps=0",
         "--watchdog-arg", "ratio_window=3", "--metrics-port", "0", "--no-eval", "--quiet",
         "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=170,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert proc.returncode == 1, proc.stderr
    assert "ALARM [update_ratio_low] shard 0" in proc.stderr
    assert "the divergence watchdog stopped training on server0 (--on-divergence stop)" \
        in proc.stderr
    launcher = read_events(out / "events" / "launcher.jsonl")
    assert launcher[0]["event"] == "launcher_start" and launcher[0]["metrics_port"] > 0
    assert launcher[-1]["event"] == "launcher_end" and launcher[-1]["alarms"] >= 1
    assert set(launcher[-1]["exit_codes"]) == {"server0", "worker0"}
    assert read_events(out / "events" / "server0.jsonl", "diverged")[0]["action"] == "stop"
