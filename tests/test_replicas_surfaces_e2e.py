"""``--replicas`` outside ``paramserver launch``'s own loop, over real processes and
loopback sockets: a shard's replicas started by hand with ``paramserver server``
(the commands docs/cli.md shows, run as written but for the ports), its primary
SIGKILLed mid-run, and the run ends with every acknowledged push in the version once;
a user's script run by ``launch --replicas 1 -- COMMAND`` through the same SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from zmq.utils.monitor import recv_monitor_message

from paramserver import ClusterSpec, ServerConfig, WorkerConfig, run_cluster
from paramserver.observe.events import read_events
from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys, generate_curve_keys
from paramserver.workers.launch.clusterspec import Progress
from paramserver.workers.launch.results import ClusterResult
from paramserver.workers.stragglerspec import StragglerSpec
from tests import exact_tasks as T
from tests.ports import free_port
from tests.replicas_by_hand import lives
from tests.test_cli_e2e import LIMIT, PARAMSERVER, env, reaper, start  # noqa: F401

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
STEPS = 200


def _doc_commands() -> list[list[str]]:
    """The hand-started replicas block of docs/cli.md, one argument list per command."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    block = text.split("runs these five commands) -->", 1)[1].split("\n\n")[1]
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
    assert [c[1] for c in commands] == ["keys", "server", "server", "worker", "worker"]
    ports = {"5610": str(free_port()), "5611": str(free_port())}

    def local(args: list[str]) -> list[str]:
        return [str(tmp_path / a) if a == "run.key" else
                re.sub(r"\b(5610|5611)\b", lambda m: ports[m.group(1)], a) for a in args]

    keys_args, backup_args, primary_args, *worker_args = (local(c[1:]) for c in commands)
    made = subprocess.run([*PARAMSERVER, *keys_args], capture_output=True, text=True,
                          env=env(), timeout=LIMIT)
    assert made.returncode == 0, made.stderr
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


# --------------------------------------------------------------------------- launch -- COMMAND

SCRIPT = [sys.executable, str(ROOT / "tests" / "own_loop_script.py")]
COMMAND_STEPS = 40


def _single_process(workers: int, steps: int) -> dict[str, torch.Tensor]:
    """torch alone on the union of every rank's batches (the script halves its gradients,
    so the servers' lr 0.2 is lr 0.1 here)."""
    model = T.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(steps):
        parts = [T.batch(r, k, T.batch_size(r, False)) for r in range(workers)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat([p[0] for p in parts])),
                                     torch.cat([p[1] for p in parts])).backward()
        opt.step()
    return model.state_dict()


def test_a_command_run_with_replicas_survives_a_primary_sigkill(tmp_path: Path) -> None:
    """`launch --replicas 1 -- python own_loop_script.py`: the script finds the replicas
    in PARAMSERVER_SERVERS, follows the backup when the primary dies, and the sync run's
    weights are single-process torch's."""
    out = tmp_path / "run"
    spec = ClusterSpec(
        num_servers=1, num_workers=2, evaluate=False,
        server=ServerConfig(mode="sync", optimizer_args={"lr": 0.2}, replicas=1,
                            failover_timeout=1.0),
        worker=WorkerConfig(servers=[]),
        # rank 1 sleeps 0.05 s a step, so that the kill lands mid-run
        command=[*SCRIPT, str(tmp_path / "ranks"), "--steps", str(COMMAND_STEPS),
                 "--slow-rank", "1"])
    result = _run_killing(spec, out, after_pushes=10)
    assert result.updates_applied == (COMMAND_STEPS,) and result.restarts == ()
    want = _single_process(2, COMMAND_STEPS)
    got = load_file(str(out / "final_model.safetensors"))
    assert set(got) == set(want)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    for rank in (0, 1):  # the script's own client moved to the new primary
        assert "its primary is now" in (out / "logs" / f"worker{rank}.log").read_text()


# --------------------------------------------------------------------------- experiment

GRID = """\
name = "replicas"
task = "digits-mlp"
steps = 20
seeds = 1
num_servers = 1
workers = [2]
modes = ["async"]
scenarios = ["none"]
min_step_time = 0.005
eval_every = 10
replicas = [0, 1]
"""


def test_an_experiment_compares_replicas_0_and_1(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from click.testing import CliRunner

    from paramserver.cli.experiment import experiment
    from paramserver.workers.experiments.spec import load_spec

    (tmp_path / "grid.toml").write_text(GRID)
    out = tmp_path / "exp"
    result = CliRunner().invoke(experiment, ["--spec", str(tmp_path / "grid.toml"),
                                             "--out", str(out)])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "experiment.json").read_text())
    assert [(c["id"], c["label"], c["replicas"]) for c in index["configurations"]] == [
        ("none-async-none-w2", "async, 0 replicas", 0),
        ("none-async-none-w2-r1", "async, 1 replica", 1)]
    assert [(r["config"], r["ok"]) for r in index["runs"]] == [
        ("none-async-none-w2", True), ("none-async-none-w2-r1", True)]
    for config, replicas in (("none-async-none-w2", 0), ("none-async-none-w2-r1", 1)):
        run = json.loads((out / "runs" / config / "seed0" / "result.json").read_text())
        assert run["spec"]["server"]["replicas"] == replicas
        names = {p["name"] for p in run["processes"]}
        assert ("server0r1" in names) == bool(replicas), names
        assert run["updates_applied"] == [2 * 20]
    report = (out / "report.md").read_text()
    assert "async, 0 replicas" in report and "async, 1 replica" in report
    assert load_spec(out / "spec.toml").replicas == [0, 1]  # it reruns the same grid
    assert "unusable logs" not in caplog.text


# --------------------------------------------------------------------------- run

# `paramserver run --replicas 1` (both replicas placed through torchrun's store, the
# primary SIGKILLed mid-run) is tests/test_run_rejoin_e2e.py's job, which also starts
# a dead backup again; an async run's every push once through a primary SIGKILL is
# test_replicas_started_by_hand_survive_a_primary_sigkill's, on the same shard code.


# --------------------------------------------------------------------------- --resume


def test_every_replica_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    """`launch --replicas 1 --resume DIR`: both replicas of the shard start from the
    checkpoint; the primary SIGKILLed mid-run, the backup's version is the checkpoint's
    plus every push acknowledged since, once."""
    ckpt = tmp_path / "ckpt"
    first = run_cluster(ClusterSpec(
        num_servers=1, num_workers=2, evaluate=False,
        server=ServerConfig(mode="async", checkpoint_dir=str(ckpt)),
        worker=WorkerConfig(steps=30)), tmp_path / "first")
    (resumed_at,) = first.updates_applied
    assert resumed_at == 60
    out = tmp_path / "second"
    spec = ClusterSpec(
        num_servers=1, num_workers=2, evaluate=False,
        server=ServerConfig(mode="async", replicas=1, failover_timeout=1.0, resume=str(ckpt)),
        worker=WorkerConfig(steps=STEPS, straggler=StragglerSpec(min_step_time=0.01)))
    pids: dict[str, int] = {}
    killed: list[int] = []

    def on_progress(_: Progress) -> None:
        path = out / "events" / "server0.jsonl"
        if not killed and path.exists() and len(read_events(path, "push")) >= 20:
            os.kill(pids["server0"], signal.SIGKILL)
            killed.append(pids["server0"])

    result = run_cluster(spec, out, on_progress=on_progress,
                         on_process=lambda info: pids.__setitem__(info.name, info.pid))
    assert killed, "the run ended before the primary could be killed"
    for name in ("server0", "server0r1"):
        assert f"resumed shard 0 from version {resumed_at}" in \
            (out / "logs" / f"{name}.log").read_text()
    (failover,) = read_events(out / "events" / "server0r1.jsonl", "failover")
    assert failover["epoch"] == 1
    acknowledged = sum(w.accepted for w in result.workers)
    assert acknowledged > 0 and result.updates_applied == (resumed_at + acknowledged,)


# --------------------------------------------------------------------------- CURVE


CURVE_STEPS = 1000  # paced: time for the replacement to rejoin before the second kill


def _handshake_refused(address: str, curve: CurveKeys | None) -> bool:
    """Whether a peer with ``curve`` (None: plaintext) that connects to ``address`` is
    refused at the handshake (True) rather than let in (False)."""
    import zmq

    from paramserver.wire.curve import secure_client

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        secure_client(sock, curve)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(address)
        # an input that would fence the primary, were it taken
        sock.send_multipart(wrepl.encode(wrepl.Apply(7, 0, 0.0, "ping")), zmq.NOBLOCK)
        assert monitor.poll(int(LIMIT * 1000)), "no handshake outcome"
        event = recv_monitor_message(monitor)["event"]
        return event != zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def _send_as(address: str, curve: CurveKeys, record: wrepl.Record) -> None:
    """One replication record to ``address``, from a peer holding ``curve``'s keys."""
    import zmq

    from paramserver.wire.curve import secure_client

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)  # (until it is out)
    secure_client(sock, curve)
    sock.connect(address)
    sock.send_multipart(wrepl.encode(record))
    sock.close()


def test_curve_replicas_refuse_strangers_and_survive_two_primary_sigkills(tmp_path: Path
                                                                         ) -> None:
    """Under CURVE with an allow-list the replicas replicate over the shard's own key: a
    plaintext peer and an unlisted key are refused at the backup's handshake; an admitted
    worker key that sends a replication record (a ping of a higher epoch to the backup,
    which would fence the primary; a Join to the primary, which would be sent the state)
    is refused by both. Then the primary is SIGKILLed; once the launcher's replacement
    rejoined over CURVE (the snapshot with the workers' key bindings), the new primary
    too; and the run ends with every acknowledged push in the version once."""
    made = generate_curve_keys(tmp_path / "keys")
    other = generate_curve_keys(tmp_path / "other")
    worker_keys = CurveKeys.load(made.clients["client"][1], made.server_public)
    stranger = CurveKeys.load(other.clients["client"][1], made.server_public)
    spec = ClusterSpec(
        num_servers=1, num_workers=2, evaluate=False,
        server=ServerConfig(mode="async", replicas=1, failover_timeout=1.0,
                            curve_secret_key=str(made.server_secret),
                            curve_clients_dir=str(made.authorized_dir)),
        worker=WorkerConfig(servers=[], steps=CURVE_STEPS,
                            straggler=StragglerSpec(min_step_time=0.01),
                            curve_key=str(made.clients["client"][1]),
                            curve_server_key=str(made.server_public)))
    out = tmp_path / "run"
    pids: dict[str, int] = {}
    seen: dict[str, bool] = {}
    killed: list[int] = []

    def log_has(name: str, text: str) -> bool:
        return text in (out / "logs" / f"{name}.log").read_text()

    def on_progress(_: Progress) -> None:
        if not seen:
            primary, backup = json.loads((out / "configs" / "worker0.json").read_text()
                                         )["servers"][0].split("|")
            seen["plaintext"] = _handshake_refused(backup, None)
            seen["stranger"] = _handshake_refused(backup, stranger)
            _send_as(backup, worker_keys, wrepl.Apply(7, 0, 0.0, "ping"))
            _send_as(primary, worker_keys, wrepl.Join(1, "tcp://127.0.0.1:1", "x"))
        def refused(what: str) -> str:
            return f"replication message(s) (the last a {what}) from key " \
                   f"{worker_keys.public_text}"

        if not killed and log_has("server0r1", refused("Apply")) \
                and log_has("server0", refused("Join")) \
                and len(read_events(out / "events" / "server0.jsonl", "push")) >= 20:
            os.kill(pids["server0"], signal.SIGKILL)
            killed.append(pids["server0"])
        elif len(killed) == 1 and read_events(out / "events" / "server0r1.jsonl",
                                              "backup_joined"):
            os.kill(pids["server0r1"], signal.SIGKILL)
            killed.append(pids["server0r1"])

    result = run_cluster(spec, out, on_progress=on_progress,
                         on_process=lambda info: pids.__setitem__(info.name, info.pid))
    assert seen == {"plaintext": True, "stranger": True}
    assert len(killed) == 2, "the run ended before both primaries could be killed"
    (failover,) = read_events(out / "events" / "server0r1.jsonl", "failover")
    assert failover["epoch"] == 1  # the hostile ping of epoch 7 was not taken
    # the replacement keeps the name server0: the first process never failed over,
    # the replacement took over from server0r1 at epoch 2
    first, replacement = lives(out / "events" / "server0.jsonl", "failover")
    assert first == [] and [e["epoch"] for e in replacement] == [2]
    acknowledged = sum(w.accepted for w in result.workers)
    assert acknowledged == 2 * CURVE_STEPS and result.updates_applied == (acknowledged,)
    assert result.restarts == ()


# --------------------------------------------------------------------------- backups, policies


def _run_killing(spec: ClusterSpec, out: Path, after_pushes: int = 20) -> ClusterResult:
    """Run ``spec``; SIGKILL shard 0's primary once it logged ``after_pushes`` pushes."""
    pids: dict[str, int] = {}
    killed: list[int] = []

    def on_progress(_: Progress) -> None:
        path = out / "events" / "server0.jsonl"
        if not killed and path.exists() and len(read_events(path, "push")) >= after_pushes:
            os.kill(pids["server0"], signal.SIGKILL)
            killed.append(pids["server0"])

    result = run_cluster(spec, out, on_progress=on_progress,
                         on_process=lambda info: pids.__setitem__(info.name, info.pid))
    assert killed, "the run ended before the primary could be killed"
    (failover,) = read_events(out / "events" / "server0r1.jsonl", "failover")
    assert failover["epoch"] == 1
    return result


def _decisions(out: Path, name: str) -> list[tuple]:
    """Each push ``name``'s first process decided on, in order, as what the shard's
    state follows from (not a replacement's, which took the state from a snapshot)."""
    first = lives(out / "events" / f"{name}.jsonl", "push")[0]
    return [(p["worker"], p["clock"], p["read_version"], p["version"], p["accepted"],
             p["reason"], p["weight"]) for p in first]


def test_backup_workers_replicate_through_a_primary_sigkill(tmp_path: Path) -> None:
    """sync with one backup worker of 3: the backup decided every push the primary did,
    alike and in the same order (which pushes a round closes on, which are late), and
    after the takeover every round closed once, on at most 2 pushes."""
    steps, out = 60, tmp_path / "run"
    result = _run_killing(ClusterSpec(
        num_servers=1, num_workers=3, evaluate=False,
        server=ServerConfig(mode="sync", backup_workers=1, expected_workers=3, replicas=1,
                            failover_timeout=1.0),
        worker=WorkerConfig(steps=steps, straggler=StragglerSpec(min_step_time=0.01))), out)
    before, after = _decisions(out, "server0"), _decisions(out, "server0r1")
    assert len(before) >= 20 and after[:len(before)] == before
    accepted = [d for d in after if d[4]]
    rounds = Counter(d[3] for d in accepted)  # a round's pushes carry its version
    (version,) = result.updates_applied
    # rounds 0 .. version - 1 closed, each on at most 2 pushes; the last may be open
    assert set(rounds) - {version} == set(range(version)) and max(rounds.values()) <= 2
    assert sum(w.accepted for w in result.workers) == len(accepted)
    assert all(w.accepted + w.rejected == steps for w in result.workers)
    assert result.restarts == ()


def test_a_staleness_policy_replicates_through_a_primary_sigkill(tmp_path: Path) -> None:
    """async under `reject max_staleness=1` with a slow worker: each push a worker saw
    accepted is in the version once, and the rest were refused, across the takeover."""
    result = _run_killing(ClusterSpec(
        num_servers=1, num_workers=2, evaluate=False,
        server=ServerConfig(mode="async", policy="reject", policy_args={"max_staleness": 1},
                            replicas=1, failover_timeout=1.0),
        worker=WorkerConfig(steps=STEPS, straggler=StragglerSpec(min_step_time=0.01)),
        stragglers={1: StragglerSpec(min_step_time=0.01, slowdown=3.0)}), tmp_path / "run")
    out = tmp_path / "run"
    before, after = _decisions(out, "server0"), _decisions(out, "server0r1")
    assert len(before) >= 20 and after[:len(before)] == before  # the backup decided alike
    accepted = sum(w.accepted for w in result.workers)
    assert sum(w.rejected for w in result.workers) > 0  # the policy acted
    assert accepted + sum(w.rejected for w in result.workers) == 2 * STEPS
    assert result.updates_applied == (accepted,) and result.restarts == ()
