"""A replicated shard's primary SIGKILLed at chosen moments, checkpoints on (issue 32):
sync, 2 shards x 2 replicas (``--replicas 1``), 3 workers.

The moments: mid-round (some but not all of a round's pushes accepted), between two
rounds, while the backup writes a checkpoint (the primary killed; or the writing
backup itself), and twice in a row (the new primary killed once the launcher's
replacement for the first rejoined). Each is picked by watching the shard, never by
sleeping: its primary's STATS (a round is open while some worker's clock is ahead of
the others'), the replicas' event logs (``backup_joined``), and a checkpoint write
held mid-way by the writer (paramserver/server/replicackpt.py's fault hook) until
the kill is done. Every faulted run ends with final weights bit-identical to the run
without a failure, no worker restarted, and its checkpoints resume.

CI runs one faulted launch covering every moment; ``PARAMSERVER_FAULT_RUNS=20``
runs that many launches, each at a random moment (``-k random``)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paramserver.errors import ParamServerError
from paramserver.observe.events import read_events
from paramserver.persist.checkpoint import export_model
from paramserver.server.config import ServerConfig
from paramserver.server.loop import ShardServer
from paramserver.server.replicackpt import HOLD_ENV, LOCK_NAME
from paramserver.workers.admin import server_stats
from paramserver.workers.config import WorkerConfig
from paramserver.workers.launch.cluster import ClusterSpec, ProcessInfo, run_cluster
from paramserver.workers.launch.replicas import replacement_name
from paramserver.workers.launch.results import ClusterResult
from paramserver.workers.stragglerspec import StragglerSpec
from tests.replicas_by_hand import lives

pytestmark = pytest.mark.integration

SHARDS, WORKERS = 2, 3
#: how long one watched moment may take to come (a loaded machine)
PATIENCE = 60.0


def _spec(out: Path, steps: int, paced: bool) -> ClusterSpec:
    # paced: worker 2 is slow, so a round stays open (two pushes in) for a while, and
    # closed (none in) for a while too; the weights do not depend on the pace
    fast, slow = (StragglerSpec(min_step_time=0.08), StragglerSpec(min_step_time=0.2)) \
        if paced else (StragglerSpec(), StragglerSpec())
    return ClusterSpec(
        num_servers=SHARDS, num_workers=WORKERS, evaluate=False,
        server=ServerConfig(mode="sync", replicas=1, failover_timeout=1.0,
                            checkpoint_dir=str(out / "ckpt"), checkpoint_every=1),
        worker=WorkerConfig(steps=steps, straggler=fast), stragglers={2: slow})


@dataclasses.dataclass
class _Shard:
    """What the watcher knows of one shard's replicas: names by role, and whether a
    replacement is still to rejoin (how many ``backup_joined`` its primary logged)."""

    primary: str
    backup: str
    joined_seen: int = 0
    rejoin_due: bool = False


@dataclasses.dataclass
class _Kill:
    """One kill done: when, whom, at which moment, and the write held (if any)."""

    t: float
    shard: int
    name: str
    moment: str
    held: str | None = None


class Faults:
    """Runs ``actions`` one after the other on a thread while the cluster runs, each
    a moment of one shard at which a replica is SIGKILLed:

    * ``("mid", s)`` / ``("between", s)``: shard s's primary, just after a round
      opened (its first push accepted) / just after one closed;
    * ``("ckpt-primary", s)``: the primary, while the backup writes a checkpoint;
    * ``("ckpt-writer", s)``: the backup, in the middle of writing one.
    """

    def __init__(self, out: Path, actions: list[tuple[str, int, int]]) -> None:
        self.out = out
        self.hold = out / "hold"
        self.hold.mkdir(parents=True, exist_ok=True)
        self.actions = actions
        self.pids: dict[str, int] = {}
        self.entries: list[list[str]] = []
        self.shards = [_Shard(f"server{s}", f"server{s}r1") for s in range(SHARDS)]
        self.kills: list[_Kill] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    # the launcher's callbacks
    def on_process(self, info: ProcessInfo) -> None:
        self.pids[info.name] = info.pid
        if info.name == "worker0" and not self.entries:  # the servers are up
            servers = json.loads((self.out / "configs" / "worker0.json").read_text())["servers"]
            self.entries = [e.split("|") for e in servers]
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for f in self.hold.glob("hold-*"):
            f.unlink()

    def _run(self) -> None:
        try:
            for moment, shard, rounds in self.actions:
                self._await_rejoin(shard)
                self._await_rounds(shard, rounds)
                if moment in ("mid", "between"):
                    self._kill_in_round(shard, moment)
                else:
                    self._kill_while_writing(shard, moment)
        except BaseException as exc:  # the test reports it
            self.error = exc

    # waiting for a condition, with a deadline
    def _until(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + PATIENCE
        while not ready():
            if self._stop.is_set():
                raise RuntimeError(f"the run ended before {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {PATIENCE:g}s")
            self._stop.wait(0.01)

    def _joined(self, name: str) -> int:
        path = self.out / "events" / f"{name}.jsonl"
        return len(read_events(path, "backup_joined")) if path.exists() else 0

    def _await_rejoin(self, shard: int) -> None:
        """The shard's killed replica was replaced, and its primary counts it."""
        s = self.shards[shard]
        if s.rejoin_due:
            self._until(f"rejoin on shard {shard}",
                        lambda: self._joined(s.primary) > s.joined_seen)
            s.joined_seen, s.rejoin_due = self._joined(s.primary), False

    def _address(self, shard: int, name: str) -> str:
        replica = 0 if name == f"server{shard}" else int(name.rsplit("r", 1)[1])
        return self.entries[shard][replica]

    def _round(self, shard: int) -> tuple[int, bool] | None:
        """The primary's version and whether a round is open (None: no answer)."""
        try:
            (stats,) = server_stats([self._address(shard, self.shards[shard].primary)], 1.0)
        except ParamServerError:
            return None
        core = stats.figures
        if core is None or not core.workers:
            return None
        return core.version, any(w.clock > core.min_clock for w in core.workers.values())

    def _await_rounds(self, shard: int, rounds: int) -> None:
        """``rounds`` more rounds closed on the shard (its primary answering STATS)."""
        got: list[int] = []

        def answered() -> bool:
            now = self._round(shard)
            got.extend([] if now is None else [now[0]])
            return now is not None
        self._until(f"shard {shard}'s primary answering", answered)
        floor = got[0] + rounds
        self._until(f"{rounds} rounds on shard {shard}",
                    lambda: (now := self._round(shard)) is not None and now[0] >= floor)

    def _kill_in_round(self, shard: int, moment: str) -> None:
        """Kill the primary at the first poll that sees the round state change to
        ``moment``: early in it, so no push crosses the kill."""
        want_open = moment == "mid"
        state = {"last": want_open}

        def moment_came() -> bool:
            now = self._round(shard)
            if now is None:
                return False
            came = now[1] == want_open and state["last"] != want_open
            state["last"] = now[1]
            return came

        self._until(f"a {moment} moment on shard {shard}", moment_came)
        self._kill(shard, self.shards[shard].primary, moment)

    def _kill_while_writing(self, shard: int, moment: str) -> None:
        """Hold the backup's next checkpoint write mid-way, kill the primary (or the
        backup itself), then let the write go on."""
        s = self.shards[shard]
        hold = self.hold / f"hold-shard{shard}"
        mine = self.hold / f"held-shard{shard}-{self.pids[s.backup]}"
        while True:
            hold.touch()
            try:
                self._until(f"a checkpoint write on shard {shard}",
                            lambda: any(self.hold.glob(f"held-shard{shard}-*")))
                (held,) = self.hold.glob(f"held-shard{shard}-*")
                if held == mine:
                    victim = s.primary if moment == "ckpt-primary" else s.backup
                    self._kill(shard, victim, moment, held.read_text())
                    if moment == "ckpt-writer":
                        held.unlink()  # (a writer killed while held leaves its marker)
                    return
            finally:
                hold.unlink()
            # the primary's last write as the lone replica: let it end, hold the next
            self._until("the primary's write", lambda gone=held: not gone.exists())

    def _kill(self, shard: int, name: str, moment: str, held: str | None = None) -> None:
        os.kill(self.pids[name], signal.SIGKILL)
        self.kills.append(_Kill(time.time(), shard, name, moment, held))
        s = self.shards[shard]
        replica = 0 if name == f"server{shard}" else int(name.rsplit("r", 1)[1])
        if name == s.primary:  # the backup takes over; the replacement will back it
            s.primary, s.backup = s.backup, replacement_name(shard, replica)
        else:
            s.backup = replacement_name(shard, replica)
        s.joined_seen, s.rejoin_due = self._joined(s.primary), True


def _run(out: Path, steps: int, actions: list[tuple[str, int, int]] | None,
         monkeypatch: pytest.MonkeyPatch) -> tuple[ClusterResult, Faults | None]:
    if actions is None:
        return run_cluster(_spec(out, steps, paced=False), out), None
    faults = Faults(out, actions)
    monkeypatch.setenv(HOLD_ENV, str(faults.hold))
    try:
        result = run_cluster(_spec(out, steps, paced=True), out,
                             on_process=faults.on_process)
    finally:
        faults.stop()
        monkeypatch.delenv(HOLD_ENV)
    if faults.error is not None:
        raise AssertionError(f"the fault script failed: {faults.error}") from faults.error
    return result, faults


def _events(out: Path, name: str, kind: str) -> list[dict]:
    path = out / "events" / f"{name}.jsonl"
    return read_events(path, kind) if path.exists() else []


def _check_ends_as_baseline(out: Path, base: Path, result: ClusterResult,
                            steps: int) -> None:
    """Bit-identical final weights, no worker restarted, every shard's checkpoints
    whole and resumable at the final version, equal to the final weights."""
    assert result.restarts == () and result.updates_applied == (steps,) * SHARDS
    assert json.loads((out / "result.json").read_text())["restarts"] == []
    first = load_file(base / "final_model.safetensors")
    second = load_file(out / "final_model.safetensors")
    assert first.keys() == second.keys() and first
    for key in first:
        assert torch.equal(first[key], second[key]), key
    export_model(out / "ckpt", out / "exported.safetensors")
    exported = load_file(out / "exported.safetensors")
    for key in first:
        assert torch.equal(exported[key], first[key]), key
    for shard in range(SHARDS):
        folder = out / "ckpt" / f"shard{shard}"
        assert not list(folder.glob(".*.tmp")), "a killed write's leftovers stayed"
        assert (folder / LOCK_NAME).exists()
        server = ShardServer(ServerConfig(mode="sync", shard=shard, num_shards=SHARDS,
                                          resume=str(out / "ckpt")))
        try:
            server.start()
            assert server.core is not None and server.core.version == steps
        finally:
            server.close(linger=0)


def _pushes_before_failover(out: Path, name: str) -> int:
    """Pushes ``name`` applied before it took over: the state it took over with."""
    (failover,) = _events(out, name, "failover")
    return sum(1 for p in _events(out, name, "push") if p["t"] < failover["t"])


STEPS = 40


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("baseline")
    result, _ = run_cluster(_spec(out, STEPS, paced=False), out), None
    assert result.restarts == () and result.failures == ()
    return out


def test_without_failure_the_backups_write_the_checkpoints(baseline):
    """The primaries write none; each backup wrote them, the final one last (a
    periodic one is due at every version, as the loop finds it between messages)."""
    for shard in range(SHARDS):
        assert _events(baseline, f"server{shard}", "checkpoint") == []
        written = _events(baseline, f"server{shard}r1", "checkpoint")
        assert written[-1]["version"] == STEPS and len(written) >= 3


def test_every_moment_ends_bit_identical(baseline, tmp_path, monkeypatch):
    """One run, four kills: shard 0's primary mid-round, shard 1's between rounds;
    then shard 0's new primary while its backup (the first kill's replacement) writes
    a checkpoint (twice in a row), and shard 1's backup in the middle of writing."""
    actions = [("mid", 0, 2), ("between", 1, 0), ("ckpt-primary", 0, 0),
               ("ckpt-writer", 1, 0)]
    result, faults = _run(tmp_path, STEPS, actions, monkeypatch)
    assert faults is not None
    assert [(k.moment, k.name) for k in faults.kills] == [
        ("mid", "server0"), ("between", "server1"), ("ckpt-primary", "server0r1"),
        ("ckpt-writer", "server1")]  # (the second kill's replacement keeps its name)
    # the moments were as meant: the state each new primary took over with
    assert _pushes_before_failover(tmp_path, "server0r1") % WORKERS != 0  # a round open
    assert _pushes_before_failover(tmp_path, "server1r1") % WORKERS == 0  # none open
    # twice in a row: the first kill's replacement (server0's second process, in the
    # same event log) took over at epoch 2, and the write it was holding when its
    # primary died was completed
    first, replacement = lives(tmp_path / "events" / "server0.jsonl")
    assert [e["epoch"] for e in first if e["event"] == "failover"] == []
    assert [e["epoch"] for e in replacement if e["event"] == "failover"] == [2]
    held = faults.kills[2].held
    assert held is not None
    version = int(Path(held).name[2:12])  # (".v0000000012.safetensors.tmp")
    assert version in [e["version"] for e in replacement if e["event"] == "checkpoint"]
    # the writer killed mid-write: another process wrote the checkpoints after it (the
    # primary, or the writer's replacement)
    killed_at = faults.kills[3].t
    later = [e for name in ("server1r1", "server1")
             for e in _events(tmp_path, name, "checkpoint") if e["t"] > killed_at]
    assert later
    _check_ends_as_baseline(tmp_path, baseline, result, STEPS)


MOMENTS = ("mid", "between", "ckpt-primary", "ckpt-writer")


@pytest.mark.skipif(not os.environ.get("PARAMSERVER_FAULT_RUNS"),
                    reason="PARAMSERVER_FAULT_RUNS=N runs N random-moment launches")
@pytest.mark.timeout(60 * int(os.environ.get("PARAMSERVER_FAULT_RUNS") or 1))
def test_random_moments(baseline, tmp_path, monkeypatch):
    """N launches, each with one or two kills (twice in a row) at random moments on a
    random shard; each ends bit-identical to the baseline."""
    runs = int(os.environ["PARAMSERVER_FAULT_RUNS"])
    rng = random.Random(int(os.environ.get("PARAMSERVER_FAULT_SEED", time.time_ns())))
    passed = []
    for i in range(runs):
        shard = rng.randrange(SHARDS)
        actions = [(rng.choice(MOMENTS), shard, rng.randrange(1, 8))
                   for _ in range(rng.choice((1, 2)))]
        out = tmp_path / f"run{i}"
        result, _ = _run(out, STEPS, actions, monkeypatch)
        _check_ends_as_baseline(out, baseline, result, STEPS)
        passed.append(actions)
    print(f"{len(passed)} of {runs} random-moment runs ended bit-identical: {passed}")
