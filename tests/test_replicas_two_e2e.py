"""Two backups per shard (``--replicas 2``) over real processes and loopback sockets:
the shard survives its primary SIGKILLed, then the backup that took over SIGKILLed
too, without waiting for the launcher's replacements to rejoin. Exactly one backup
takes over each time (paramserver.core.replica.elect: both time out together), the
other one takes its snapshot before it answers any worker, and so the second takeover
starts from the same state. Sync: final weights bit-identical to a run without
replicas or failure. Async: every push a worker saw acknowledged is in the final
version exactly once. No worker restarts."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from paramserver.observe.events import read_events
from paramserver.server.config import ServerConfig
from paramserver.workers.config import WorkerConfig
from paramserver.workers.launch.cluster import ClusterSpec, ProcessInfo, Progress, run_cluster
from paramserver.workers.launch.results import ClusterResult
from paramserver.workers.stragglerspec import StragglerSpec

pytestmark = pytest.mark.integration

BACKUPS = ("server0r1", "server0r2")


def _spec(mode: str, workers: int, steps: int, step_time: float, replicas: int
          ) -> ClusterSpec:
    return ClusterSpec(
        num_servers=1, num_workers=workers, evaluate=False,
        server=ServerConfig(mode=mode, replicas=replicas, failover_timeout=1.0),
        worker=WorkerConfig(steps=steps, straggler=StragglerSpec(min_step_time=step_time)))


def _events(out: Path, name: str, kind: str) -> list[dict]:
    path = out / "events" / f"{name}.jsonl"
    return read_events(path, kind) if path.exists() else []


def _run_killing_two_primaries(spec: ClusterSpec, out: Path, first: int, then: int
                               ) -> tuple[ClusterResult, list[str]]:
    """SIGKILL shard 0's primary once the workers logged ``first`` steps in all, then
    the backup that took over once ``then`` more were logged under it."""
    pids: dict[str, int] = {}
    killed: list[str] = []
    at: list[int] = []

    def on_process(info: ProcessInfo) -> None:
        pids[info.name] = info.pid

    def on_progress(progress: Progress) -> None:
        if not killed and progress.done_steps >= first:
            os.kill(pids["server0"], signal.SIGKILL)
            killed.append("server0")
        elif len(killed) == 1:
            new = [name for name in BACKUPS if _events(out, name, "failover")]
            if new and not at:
                at.append(progress.done_steps)
            if new and progress.done_steps >= at[0] + then:
                os.kill(pids[new[0]], signal.SIGKILL)
                killed.append(new[0])

    result = run_cluster(spec, out, on_progress=on_progress, on_process=on_process)
    return result, killed


def _check_takeovers(out: Path, killed: list[str]) -> None:
    """One takeover per kill, by one backup each, the first one's rival brought to its
    state by a snapshot before it answered a worker."""
    assert len(killed) == 2, f"the run ended before the second kill: {killed}"
    first, second = killed[1], next(n for n in BACKUPS if n != killed[1])
    (takeover,) = _events(out, first, "failover")
    # the other backup held the same inputs: the lower index won (elect's tie rule)
    assert first == "server0r1" and takeover["epoch"] == 1
    rival = read_events(out / "events" / f"{second}.jsonl", "server_start")[0]["address"]
    assert takeover["backups"] == [rival]
    joined = _events(out, first, "backup_joined")
    assert joined and joined[0]["backup"] == rival and joined[0]["t"] >= takeover["t"]
    # the second death: the rival (or the first primary's replacement, if it rejoined
    # in time and holds as many inputs) took over, at an epoch of its own above 1
    later = [e for n in (second, "server0") for e in _events(out, n, "failover")
             if e["t"] > takeover["t"]]
    assert len(later) == 1 and later[0]["epoch"] > 1
    # no two replicas ever took over at one epoch
    epochs = [e["epoch"] for n in ("server0", *BACKUPS) for e in _events(out, n, "failover")]
    assert len(epochs) == len(set(epochs)) == 2


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, Path, ClusterResult, list[str]]:
    plain = tmp_path_factory.mktemp("sync-plain")
    run_cluster(_spec("sync", 3, 30, 0.03, 0), plain)
    failed = tmp_path_factory.mktemp("sync-two-kills")
    result, killed = _run_killing_two_primaries(_spec("sync", 3, 30, 0.1, 2), failed, 15, 3)
    return plain, failed, result, killed


def test_sync_two_primaries_killed_ends_bit_identical(sync_runs):
    plain, failed, result, killed = sync_runs
    _check_takeovers(failed, killed)
    assert result.restarts == () and result.updates_applied == (30,)
    assert [f.process for f in result.failures] == killed
    first = load_file(plain / "final_model.safetensors")
    second = load_file(failed / "final_model.safetensors")
    assert first.keys() == second.keys() and first
    for key in first:
        assert first[key].equal(second[key]), key


def test_async_two_primaries_killed_keep_every_acknowledged_push_once(tmp_path):
    result, killed = _run_killing_two_primaries(_spec("async", 2, 150, 0.01, 2), tmp_path,
                                                20, 10)
    _check_takeovers(tmp_path, killed)
    acknowledged = sum(w.accepted for w in result.workers)
    assert acknowledged == 2 * 150
    assert result.updates_applied == (acknowledged,)
    assert result.restarts == ()
