"""Live resharding (issue 47, item 2): shard processes on loopback moved to another
shard count while three workers train, by ``paramserver reshard``'s driver
(workers/reshard.py); the workers learn each new plan from a ``plan_moved`` answer
and go on without restarting (workers/planmove.py).

* sync, 2 -> 4 -> 3 shards during one run ends bit-identical to the run kept on 2;
* async and SSP, two moves: every push the shards acknowledged is counted exactly
  once (each adds 1 to ``count``: the final weight is minus their number); under a
  staleness policy, at its weight, through shared memory;
* a move whose new shard never answers fails, and the old plan serves on; one whose
  old shard is SIGKILLed fails in one line, and the shards left are not frozen;
* ``launch --reshard-at`` with the other features: compression, local SGD under
  delayed Nesterov across a resume on another shard count, a script's own optimizer
  on emulated hosts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from paramserver.cli.main import main
from paramserver.server.loop import ServerConfig
from paramserver.server.process import Ready
from paramserver.workers.admin import pull_weights, server_stats, shutdown_servers
from paramserver.workers.client import PSClient
from paramserver.workers.reshard import MoveFailed, live_reshard
from tests.ports import free_port
from tests.procs import reap
from tests.reshard_worker import plan
from tests.test_resume_e2e import ROOT, _env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKERS = 3


class Job:
    """Shard processes started by hand (more can join), and the workers."""

    def __init__(self, tmp: Path, mode: str, workers: int = WORKERS, **server: Any) -> None:
        self.tmp, self.mode, self.server, self.n = tmp, mode, server, workers
        self.procs: list[subprocess.Popen[str]] = []
        self.workers: list[subprocess.Popen[str]] = []

    def start_server(self, shard: int, num_shards: int) -> str:
        cfg = ServerConfig(shard=shard, num_shards=num_shards, mode=self.mode,
                           expected_workers=self.n, heartbeat_timeout=30.0,
                           event_log=str(self.tmp / f"events{len(self.procs)}.jsonl"),
                           **self.server)
        path = self.tmp / f"server{len(self.procs)}.json"
        path.write_text(json.dumps(cfg.to_dict()))
        proc = subprocess.Popen([sys.executable, "-m", "paramserver.server.loop", str(path)],
                                cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        self.procs.append(proc)
        assert proc.stdout is not None
        return Ready.parse(proc.stdout.readline()).address

    def start_workers(self, servers: list[str], steps: str, tag: str, big: bool = False
                      ) -> None:
        self.workers = [subprocess.Popen(
            [sys.executable, "-m", "tests.reshard_worker", str(rank), ",".join(servers),
             self.mode, steps, str(self.tmp / f"{tag}{rank}"), *(["big"] if big else [])],
            cwd=ROOT, env=_env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(self.n)]

    def finish(self, tag: str) -> list[dict[str, Any]]:
        for w in self.workers:
            out, _ = w.communicate(timeout=240)
            assert w.returncode == 0, out[-3000:]
        return [json.loads((self.tmp / f"{tag}{r}.json").read_text()) for r in range(self.n)]

    def close(self) -> None:
        for p in self.workers + self.procs:
            reap(p)


@contextmanager
def job(tmp: Path, mode: str, workers: int = WORKERS, **server: Any) -> Iterator[Job]:
    j = Job(tmp, mode, workers, **server)
    try:
        yield j
    finally:
        j.close()


def _weights(tmp: Path, tag: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp / f"{tag}0.safetensors"))


def test_sync_2_then_4_then_3_shards_live_ends_as_kept_on_2(tmp_path: Path) -> None:
    server = {"optimizer": "sgd", "optimizer_args": {"lr": 0.05, "momentum": 0.9}}
    with job(tmp_path / "moved", "sync", **server) as moved:
        moved.tmp.mkdir()
        servers = [moved.start_server(s, 2) for s in range(2)]
        added = [moved.start_server(s, 4) for s in (2, 3)]
        # the first move by the command line, at round 2 (the workers wait there for it)
        cli = subprocess.Popen([sys.executable, "-m", "paramserver.cli", "reshard", "--servers",
                                ",".join(servers), "--to", "4", "--add", ",".join(added),
                                "--at", "2", "--timeout", "120", "--json"], cwd=ROOT,
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        try:
            moved.start_workers(servers, "+3", "w")  # until both moves were seen, then 3
            out, err = cli.communicate(timeout=200)
        finally:
            reap(cli)
        assert cli.returncode == 0, err
        first = json.loads(out)
        assert (first["from_shards"], first["to_shards"], first["epoch"]) == (2, 4, 1)
        assert first["rounds"] == 2 and first["pause_s"] > 0 and first["bytes"] > 0
        # the second at the next round boundary: the first three shards stay
        second = live_reshard(first["servers"], 3, timeout=120)
        assert (second.to_shards, second.epoch) == (3, 2)
        assert list(second.servers) == first["servers"][:3]
        said = moved.finish("w")
        assert [s["moves"] for s in said] == [2] * WORKERS
        assert said[0]["servers"] == list(second.servers)
        rounds = said[0]["rounds"]
        assert [s["rounds"] for s in said] == [rounds] * WORKERS
        final = pull_weights(list(second.servers), plan(3))
        stats = server_stats(list(second.servers))
        assert [s.counters.get("plan_epoch") for s in stats] == [2, 2, 2]
        shown = CliRunner().invoke(main, ["status", "--servers", ",".join(second.servers)])
        assert shown.exit_code == 0 and "plan epoch 2" in shown.output, shown.output
        # the removed shard stops by itself once every worker was told
        assert moved.procs[3].wait(timeout=60) == 0
        assert shutdown_servers(list(second.servers)) == []
        for p in moved.procs:
            assert p.wait(timeout=60) == 0
    with job(tmp_path / "kept", "sync", **server) as kept:  # the same rounds, on 2 shards
        kept.tmp.mkdir()
        kept.start_workers([kept.start_server(s, 2) for s in range(2)], str(rounds), "w")
        kept.finish("w")
    a, b = _weights(kept.tmp, "w"), _weights(moved.tmp, "w")
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(final[name], a[name]), name
    events = [json.loads(line) for i in range(4)
              for line in (moved.tmp / f"events{i}.jsonl").read_text().splitlines()]
    moves = [e for e in events if e["event"] == "resharded"]
    assert sorted((e["epoch"], e["role"]) for e in moves) == [
        (1, "added"), (1, "added"), (1, "kept"), (1, "kept"),
        (2, "kept"), (2, "kept"), (2, "kept"), (2, "removed")]
    assert all(e["paused_s"] >= 0 for e in moves)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_two_moves_count_each_acknowledged_push_once_after_failed_ones(
        tmp_path: Path, mode: str) -> None:
    # (ssp: pulls held at the gate when the plan moves; the clocks carry over)
    extra = {"staleness_bound": 1} if mode == "ssp" else {}
    with job(tmp_path, mode, optimizer="sgd", optimizer_args={"lr": 1.0}, **extra) as j:
        servers = [j.start_server(s, 2) for s in range(2)]
        victim = j.start_server(2, 3)
        added = j.start_server(2, 3)
        j.start_workers(servers, "+30", "w")
        # a shard to add that never answers: refused before anything froze
        dead = f"tcp://127.0.0.1:{free_port()}"
        with pytest.raises(MoveFailed, match="nothing moved"):
            live_reshard(servers, 3, [dead], timeout=3, freeze_timeout=120)

        # a shard to add killed once the old ones froze: the move fails half-way
        # (frozen, captured, not adopted) and the old plan serves on with what it held
        def kill(said: str) -> None:
            if said.startswith("frozen"):
                j.procs[2].kill()
                j.procs[2].wait()

        with pytest.raises(MoveFailed, match="serves on"):
            live_reshard(servers, 3, [victim], timeout=3, freeze_timeout=120, progress=kill)
        assert [s.counters.get("plan_epoch", 0) for s in server_stats(servers)] == [0, 0]
        first = live_reshard(servers, 3, [added], timeout=60)
        second = live_reshard(list(first.servers), 2, timeout=60)
        assert (first.epoch, second.epoch, second.servers) == (1, 2, tuple(servers))
        said = j.finish("w")
        assert [s["moves"] for s in said] == [2] * WORKERS
        assert sum(s["refused"] for s in said) == 0
        acked = sum(s["acked"] for s in said)
        final = pull_weights(servers, plan(2))
        # each acknowledged push took 1 off every element of count, once
        assert torch.equal(final["count"], torch.full((8,), -float(acked))), (
            final["count"], acked)
        assert shutdown_servers(servers) == []


def _answers(address: str, shards: int, big: bool = False) -> bool:
    """Whether a shard of a plan of ``shards`` answers a data request (an observer's
    HELLO, then PULL) now: a frozen one holds it unanswered."""
    import os

    from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op
    from paramserver.wire.transport import Channel

    ch: Channel[Any] = Channel(address, peer="shard")
    try:
        the_plan = plan(shards, big)
        ch.request(Message(Op.HELLO, 0, {
            "worker": 0, "role": "observer", "protocol": PROTOCOL_VERSION,
            "plan_hash": the_plan.hash, "plan": the_plan.describe(), "incarnation": "probe",
            "host": "test", "pid": os.getpid()}), 10.0)
        got = ch.request(Message(Op.PULL, 0, {"worker": 0, "clock": 0, "observer": True}),
                         10.0)
        return got.op is Op.REPLY and got.fields.get("re") == "pull"
    finally:
        ch.close()


@pytest.mark.parametrize(("policy", "args"), [("reject", {"max_staleness": 1000}),
                                              ("exponential", {"decay": 0.5}),
                                              ("inverse", {})])
def test_async_moves_under_a_policy_and_an_old_shard_lost_mid_move(
        tmp_path: Path, policy: str, args: dict[str, Any]) -> None:
    """Two moves under a staleness policy, through shared memory: count's shard took
    each acknowledged push once, at the weight it answered (reject, exponential:
    powers of two, so the sums are exact; inverse: to float32's rounding). Then a
    shard of the old plan SIGKILLed in the middle of a move (the removed one once
    frozen, or the kept one after the capture): the move fails in one line within
    its timeouts, and the shard left answers again, not frozen."""
    with job(tmp_path, "async", 2, optimizer="sgd", optimizer_args={"lr": 1.0}, policy=policy,
             policy_args=args) as j:
        servers = [j.start_server(s, 2) for s in range(2)]
        added = j.start_server(2, 3)
        j.start_workers(servers, "+5", "w", big=True)
        first = live_reshard(servers, 3, [added], timeout=60)
        live_reshard(list(first.servers), 2, timeout=60)
        said = j.finish("w")
        assert [s["moves"] for s in said] == [2, 2]
        assert sum(s["refused"] for s in said) == 0
        weighted = sum(s["weighted"] for s in said)
        final = pull_weights(servers, plan(2, True))
        assert torch.allclose(final["count"], torch.full((8,), -weighted),
                              rtol=1e-6 if policy == "inverse" else 0, atol=0), (
            final["count"], weighted)
        if policy == "exponential":  # (it acted: some push was late)
            assert weighted < sum(s["acked"] for s in said)
        # shared memory: granted again at each worker's HELLO to each moved plan, from a
        # board of the shard's new slices (a worker here reads it: what TCP reads)
        with PSClient(servers, plan(2, True), worker=0, heartbeat_interval=0,
                      timeout=30) as reader:
            reader.connect()
            got = {k: torch.zeros_like(v) for k, v in final.items()}
            reader.pull(got)
            assert all(ch.shm is not None and ch.shm.active for ch in reader.channels)
        for name in final:
            assert torch.equal(got[name], final[name]), name
        for st in server_stats(servers):
            assert st.counters.get("shm_peers", 0) >= 2 * 2, st.counters
            assert st.counters.get("shm_pulls", 0) > 0, st.counters

        if policy == "inverse":  # (the lost shards: reject's and exponential's)
            return
        victim, left = (1, 0) if policy == "reject" else (0, 1)
        when = "frozen" if policy == "reject" else "sending"

        def kill(text: str) -> None:
            if text.startswith(when):
                j.procs[victim].kill()
                j.procs[victim].wait()

        began = time.monotonic()
        with pytest.raises(MoveFailed, match="stopped answering") as failed:
            live_reshard(servers, 1, timeout=2, progress=kill)
        # (a step's answers and the aborts each wait 2 s at most: a bound on a hang, far
        # above what a loaded machine adds, not a speed figure)
        assert time.monotonic() - began < 120
        assert servers[victim] in str(failed.value) and "\n" not in str(failed.value)
        assert _answers(servers[left], 2, big=True)
        if policy == "reject":  # the command line says so, and exits 1
            cli = subprocess.run(
                [sys.executable, "-m", "paramserver.cli", "reshard", "--servers",
                 ",".join(servers), "--to", "1", "--timeout", "1"], cwd=ROOT, env=_env(),
                capture_output=True, text=True, timeout=120)
            errors = [line for line in cli.stderr.splitlines() if line.startswith("Error")]
            assert cli.returncode == 1 and len(errors) == 1, cli.stderr
            assert "stopped answering" in errors[0] and servers[victim] in errors[0]
            assert _answers(servers[left], 2, big=True)


def _curve(tmp: Path) -> list[str]:
    from paramserver.wire.curve import generate_curve_keys

    made = generate_curve_keys(tmp / "keys")
    return ["--curve-secret-key", str(made.server_secret), "--curve-clients-dir",
            str(made.authorized_dir), "--curve-key", str(made.clients["client"][1]),
            "--curve-server-key", str(made.server_public)]


def _moves(out: Path) -> list[tuple[int, str]]:
    events = [json.loads(line) for path in (out / "events").glob("server*.jsonl")
              for line in path.read_text().splitlines()]
    return sorted((e["epoch"], e["role"]) for e in events if e["event"] == "resharded")


def test_launch_reshard_at_across_a_resume_on_another_shard_count_ends_as_kept_on_2(
        tmp_path: Path) -> None:
    """Local SGD under delayed Nesterov, a bf16 wire, early parts, CURVE: moved live
    2 -> 4 shards, checkpointed there, resumed on 3 (the checkpoint resharded as it
    loads) and moved live to 2, it ends bit-identical to the run kept on 2."""
    from tests.test_reshard_e2e import _finish, _launch
    from tests.test_resume_e2e import _assert_identical, _final

    args = ["--task", "digits-mlp", "--optimizer", "delayed-nesterov", "--lr", "0.01",
            "--local-optimizer", "sgd", "--sync-every", "2", "--wire-dtype", "bfloat16",
            "--early-parts", *_curve(tmp_path)]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    kept = _launch(tmp_path / "kept", 2, 16, args)
    _finish(_launch(tmp_path / "half", 2, 8, [*args, *ckpt, "--reshard-at", "2:4"]))
    said = _finish(_launch(tmp_path / "moved", 3, 16, [
        *args, *ckpt, "--resume", str(tmp_path / "ckpt"), "--reshard-at", "6:2"]))
    _finish(kept)
    _assert_identical(_final(tmp_path / "moved"), _final(tmp_path / "kept"))
    assert _moves(tmp_path / "half") == [(1, "added"), (1, "added"), (1, "kept"),
                                         (1, "kept")]
    assert _moves(tmp_path / "moved") == [(1, "kept"), (1, "kept"), (1, "removed")], said


def test_launch_reshard_at_moves_a_compressed_run_2_to_4_to_3_and_ends_as_kept_on_2(
        tmp_path: Path) -> None:
    """int8 with error feedback, pushes streamed bucket by bucket as backward makes them
    (--overlap): a push the move answers ``plan_moved`` goes again whole on the new plan,
    encoded from the residuals it began with (workers/planmove.py, PSClient's
    _stream_moved), so the moved run ends as kept."""
    from tests.test_reshard_e2e import _finish, _launch
    from tests.test_resume_e2e import _assert_identical, _final

    args = ["--task", "digits-mlp", "--optimizer", "adam", "--lr", "0.01",
            "--compression", "int8", "--overlap"]
    kept = _launch(tmp_path / "kept", 2, 8, args)
    moved = _launch(tmp_path / "moved", 2, 8, [*args, "--reshard-at", "2:4",
                                              "--reshard-at", "5:3"])
    said = _finish(moved)
    _finish(kept)
    _assert_identical(_final(tmp_path / "moved"), _final(tmp_path / "kept"))
    assert _moves(tmp_path / "moved") == [
        (1, "added"), (1, "added"), (1, "kept"), (1, "kept"),
        (2, "kept"), (2, "kept"), (2, "kept"), (2, "removed")], said[-3000:]


def test_a_scripts_own_optimizer_moved_2_to_3_to_1_shards_equals_single_process_torch(
        tmp_path: Path) -> None:
    """A command run (DistributedOptimizer wrapping torch.optim.SGD, its lr changed
    between the moves) moved live by --reshard-at, on emulated hosts where this
    machine can make them (the added shard starts on a server host): the final
    model, which the launcher reads from the shards of the last plan, is torch's on
    one process."""
    from paramserver.workers.launch.netcluster import netns_problem
    from tests.test_reshard_e2e import _finish
    from tests.test_resume_e2e import _final
    from tests.test_wrapped_optimizer_e2e import (
        LR,
        MOMENTUM,
        NEW_LR,
        SCRIPT,
        STEPS,
        _reference,
    )

    out = tmp_path / "run"
    hosts = ["--hosts", "1+2"] if netns_problem() is None else []
    _finish(subprocess.Popen(
        [sys.executable, "-m", "paramserver.cli", "launch", "-s", "2", "-n", "1", "--mode",
         "sync", "--out", str(out), "-q", *hosts, "--reshard-at", "2:3", "--reshard-at", "5:1",
         "--",
         *SCRIPT, "--steps", str(STEPS), "--lr", str(LR), "--momentum", str(MOMENTUM),
         "--change-at", "4", "--new-lr", str(NEW_LR)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    got, want = _final(out), _reference(1, change_at=4)
    assert set(got) == set(want)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-6), key
    assert _moves(out) == [(1, "added"), (1, "kept"), (1, "kept"),
                           (2, "kept"), (2, "removed"), (2, "removed")]
    if hosts:  # the shard the move added listened on server host 2 % 2, as shard 0 does
        s0 = {h["name"]: h for h in json.loads((out / "result.json").read_text())["hosts"]
              }["s0"]["address"]
        said = (out / "logs" / "worker0.log").read_text()
        moved = said.split("the plan moved to 3 shard(s) (epoch 1): ", 1)[1].split("\n")[0]
        assert moved.split(", ")[2].startswith(f"tcp://{s0}:"), (moved, s0)
