"""The command line over real processes: launch, four terminals, signals, torchrun,
Slurm and two network namespaces.

Every process is started the way a person would start it: ``python -m paramserver.cli ...``
is the ``paramserver`` console script (cli/__main__.py calls the same
``paramserver.cli.main:main``), and torchrun is ``python -m torch.distributed.run``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from paramserver.benchmarks.netns import netns_problem as _netns_problem
from paramserver.observe.events import read_events
from tests.ports import free_port

# Real processes on a shared, possibly busy machine: generous limits (one run takes
# ~20 s alone on 2 cores, and was seen to take 125 s under a load of 15).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
LIMIT = 450.0  # seconds any one command of a test may take

ROOT = Path(__file__).resolve().parent.parent
PARAMSERVER = [sys.executable, "-m", "paramserver.cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PARAMSERVER_", "SLURM_", "TORCHELASTIC_"))
            and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    base["OMP_NUM_THREADS"] = "1"
    base["PARAMSERVER_LOG_LEVEL"] = "INFO"
    base.update(extra)
    return base



def children(pid: int) -> set[int]:
    """Every live descendant of ``pid``, from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


_STARTED: list[subprocess.Popen[bytes]] = []


def start(args: Sequence[str], log: Path, **kwargs: object) -> subprocess.Popen[bytes]:
    with log.open("wb") as fh:
        proc = subprocess.Popen(list(args), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                env=kwargs.pop("env", None) or env(), **kwargs)  # type: ignore[call-overload]
    _STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def reaper() -> Iterator[None]:
    """Whatever a test leaves running (it failed half-way, say) is killed, children first."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            for pid in children(proc.pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()


def watch(proc: subprocess.Popen[bytes], timeout: float) -> set[int]:
    """Wait for ``proc``, collecting the pids of every process it started meanwhile."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        seen |= children(proc.pid)
        if time.monotonic() > deadline:
            pytest.fail(f"{proc.args} still running after {timeout}s")
        time.sleep(0.2)
    return seen


def assert_gone(pids: set[int]) -> None:
    time.sleep(0.2)
    left = sorted(p for p in pids if alive(p))
    assert not left, f"processes left behind: {left}"


# --------------------------------------------------------------------------- launch


def _quick_start(mode: str) -> list[str]:
    """The README's quick-start command of ``mode`` (which the docs test does not run:
    this one does), its ``--steps`` made 150 and its ``--out`` left for the caller."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("runs these three commands and checks their accuracy -->", 1)[1]
    block = block.split("\n\n")[1]
    (line,) = [ln.split() for ln in block.strip().splitlines() if f"--mode {mode} " in
               ln.replace("  ", " ")]
    assert line[:2] == ["paramserver", "launch"] and line[-2] == "--out", line
    line[line.index("--steps") + 1] = "150"
    return line[1:-2]


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_launch_trains_to_the_expected_accuracy(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "run"
    args = [*PARAMSERVER, *_quick_start(mode), "--out", str(out)]
    proc = start(args, tmp_path / "launch.log")
    pids = watch(proc, LIMIT)
    text = (tmp_path / "launch.log").read_text()
    assert proc.returncode == 0, text
    assert len(pids) >= 5  # 2 servers + 3 workers at least
    assert_gone(pids)

    result = json.loads((out / "result.json").read_text())
    # digits-mlp, sgd lr 0.1, 150 steps x 3 workers: ~0.91 (sync) to ~0.95 (async, ssp)
    assert 0.85 <= result["eval"]["accuracy"] <= 1.0
    assert result["eval"]["loss"] > 0
    assert result["seconds"] > 0 and len(result["addresses"]) == 2
    assert [w["worker"] for w in result["workers"]] == [0, 1, 2]
    for w in result["workers"]:
        assert w["steps"] == 150 and w["accepted"] + w["rejected"] == 150
        assert w["seconds"] > 0 and w["final_train_loss"] > 0
    versions = result["updates_applied"]
    assert versions == ([150, 150] if mode == "sync" else [450, 450])
    assert [s["shard"] for s in result["servers"]] == [0, 1]
    for name in ("server0", "server1", "worker0", "worker1", "worker2"):
        assert (out / "logs" / f"{name}.log").exists()
        assert (out / "events" / f"{name}.jsonl").exists()
    assert "held-out" in text and "accuracy" in text and "result.json" in text


def test_launch_names_the_process_that_failed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start([*PARAMSERVER, "launch", "-n", "2", "--steps", "20", "--device", "cpu",
                  "--task", "tests.cli_tasks:crash_on_rank_one", "--out", str(out), "--quiet"],
                 tmp_path / "launch.log")
    pids = watch(proc, LIMIT)
    text = (tmp_path / "launch.log").read_text()
    assert proc.returncode == 1, text
    assert "worker1 failed with exit code" in text
    assert "boom: worker 1 cannot build its task" in text  # the tail of its log
    assert_gone(pids)


def cmdline(pid: int) -> str:
    """What ``ps -o args`` shows for ``pid`` (its title, once it set one)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


@pytest.mark.parametrize("policy", ["tolerate", "restart", "fail"])
def test_launch_after_a_worker_is_killed(tmp_path: Path, policy: str) -> None:
    """kill -9 worker 1 mid-run, found by its pid in processes.json: what the summary
    says and the exit code, for every --on-worker-failure; and every process's title."""
    out = tmp_path / "run"
    proc = start([*PARAMSERVER, "launch", "-s", "2", "-n", "3", "--mode", "sync",
                  "--steps", "300", "--min-step-time", "0.01", "--device", "cpu",
                  "--on-worker-failure", policy, "--out", str(out)], tmp_path / "launch.log")
    worker1_log = out / "events" / "worker1.jsonl"
    deadline = time.monotonic() + LIMIT
    # wait until worker 1 has trained a little (its steps are in its event log)
    while not (worker1_log.exists() and worker1_log.read_bytes().count(b'"event":"step"') >= 20):
        assert proc.poll() is None, (tmp_path / "launch.log").read_text()
        assert time.monotonic() < deadline, "worker 1 never trained"
        time.sleep(0.1)
    seen = children(proc.pid)
    started = json.loads((out / "processes.json").read_text())
    roles = {p["name"]: p for p in started}
    assert set(roles) == {"server0", "server1", "worker0", "worker1", "worker2"}
    assert {p["role"] for p in started} == {"server", "worker"}
    titles = {name: cmdline(p["pid"]) for name, p in roles.items()}
    assert titles["worker1"] == "paramserver: worker 1/3 (digits-mlp)"
    assert titles["server0"].startswith("paramserver: server 0/2 tcp://127.0.0.1:")
    assert titles["server1"].endswith("(sync)")
    assert cmdline(proc.pid) == f"paramserver: launch (run {out})"
    os.kill(roles["worker1"]["pid"], signal.SIGKILL)
    seen |= watch(proc, LIMIT)
    text = (tmp_path / "launch.log").read_text()
    assert_gone(seen)
    for name, p in roles.items():  # the launcher printed every pid as it started them
        assert f"started {name} pid {p['pid']}" in text
    if policy == "fail":
        assert proc.returncode == 1, text
        assert "worker1 failed with killed by SIGKILL" in text
        assert "Traceback" not in text
        return
    assert proc.returncode == 0, text
    result = json.loads((out / "result.json").read_text())
    assert result["processes"][:5] == started
    assert "Traceback" not in text and "held-out" in text
    if policy == "tolerate":
        assert result["workers"][1] == {"worker": 1, "failed": True, "exit_code": -9,
                                        "reason": "killed by SIGKILL"}
        assert "workers: 2 of 3 finished, 1 dead, 0 restart(s) (--on-worker-failure " \
            "tolerate)" in text
        assert "worker 1 dead (killed by SIGKILL), tolerated" in text
    else:
        assert result["workers"][1]["clock"] == 300
        again = [p for p in result["processes"] if p["name"] == "worker1"]
        assert len(again) == 2 and again[0]["pid"] != again[1]["pid"]
        assert "workers: 3 of 3 finished, 0 dead, 1 restart(s) (--on-worker-failure " \
            "restart)" in text
        assert "worker 1 restarted once (last death: killed by SIGKILL), then finished at " \
            "clock 300" in text


def test_ctrl_c_takes_the_way_out_of_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             clean_env: None) -> None:
    """SIGINT and SIGTERM raise the same exception from one handler (cli/launch.py
    _Signals), which stops the run on its way out: SIGTERM's test below stops real
    processes; SIGINT here, in this process, reaches the same exit (130, the line)."""
    from click.testing import CliRunner

    from paramserver.cli.main import main

    def interrupted(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the run goes on
        time.sleep(30)  # (the handler raises at once)
        raise AssertionError("SIGINT did not stop the run")

    monkeypatch.setattr("paramserver.workers.launch.cluster.run_cluster", interrupted)
    before = signal.getsignal(signal.SIGINT)
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["launch", "-n", "2", "--steps", "5", "--device", "cpu",
                                       "--out", str(out), "--quiet"])
    assert result.exit_code == 130, result.output
    assert f"SIGINT: every process stopped; logs in {out / 'logs'}" in result.output
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143)])
def test_a_signal_stops_every_process(tmp_path: Path, signum: int, code: int) -> None:
    out = tmp_path / "run"
    proc = start([*PARAMSERVER, "launch", "-s", "2", "-n", "2", "--steps", "100000",
                  "--min-step-time", "0.01", "--device", "cpu", "--out", str(out), "--quiet"],
                 tmp_path / "launch.log")
    seen: set[int] = set()
    deadline = time.monotonic() + LIMIT
    events = [out / "events" / f"worker{r}.jsonl" for r in range(2)]
    while not all(p.exists() and b'"event":"step"' in p.read_bytes() for p in events):
        assert proc.poll() is None, (tmp_path / "launch.log").read_text()
        assert time.monotonic() < deadline, "workers never started training"
        seen |= children(proc.pid)
        time.sleep(0.2)
    seen |= children(proc.pid)
    assert len(seen) >= 4
    os.kill(proc.pid, signum)
    assert proc.wait(60) == code
    text = (tmp_path / "launch.log").read_text()
    assert f"{signal.Signals(signum).name}: every process stopped" in text
    assert_gone(seen)


# --------------------------------------------------------------------------- four terminals


def test_servers_and_workers_started_by_hand(tmp_path: Path) -> None:
    """Workers first (they wait for the servers), then two servers; then status; then Ctrl-C."""
    ports = [free_port() for _ in range(2)]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    workers = [start([*PARAMSERVER, "worker", "--servers", ",".join(addresses), "--rank", str(r),
                      "--world-size", "2", "--steps", "100", "--device", "cpu",
                      "--result-file", str(tmp_path / f"worker{r}.json")],
                     tmp_path / f"worker{r}.log") for r in range(2)]
    # the servers start once both workers are up and about to connect (each says so)
    deadline = time.monotonic() + LIMIT
    while not all(f"paramserver: worker {r} of 2".encode() in
                  (tmp_path / f"worker{r}.log").read_bytes() for r in range(2)):
        for r, w in enumerate(workers):
            assert w.poll() is None, (tmp_path / f"worker{r}.log").read_text()
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    servers = [start([*PARAMSERVER, "server", "--shard", str(i), "--num-shards", "2",
                      "--port", str(ports[i]), "--mode", "sync", "--expected-workers", "2"],
                     tmp_path / f"server{i}.log") for i in range(2)]
    try:
        for r, w in enumerate(workers):
            assert w.wait(LIMIT) == 0, (tmp_path / f"worker{r}.log").read_text()
        for i in range(2):
            text = (tmp_path / f"server{i}.log").read_text()
            assert f"PARAMSERVER_READY tcp://{addresses[i]} pid={servers[i].pid}" in text
            assert f"shard {i} of 2 listening on tcp://{addresses[i]}" in text
        results = [json.loads((tmp_path / f"worker{r}.json").read_text()) for r in range(2)]
        assert [r["steps"] for r in results] == [100, 100]
        assert results[0]["eval"]["accuracy"] > 0.5
        assert "worker 0: 100 steps (100 accepted, 0 rejected)" in \
            (tmp_path / "worker0.log").read_text()

        # the JSON and the table side by side: each is mostly an interpreter starting
        status = subprocess.Popen([*PARAMSERVER, "status", "--servers", ",".join(addresses),
                                   "--json"], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        _STARTED.append(status)  # killed by the reaper if the test fails half-way
        table = subprocess.run([*PARAMSERVER, "status", "--servers", ",".join(addresses)],
                               cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
        out, err = status.communicate(timeout=60)
        assert status.returncode == 0, err
        shards = json.loads(out)
        assert [s["version"] for s in shards] == [100, 100]  # sync: one step per round
        for shard in shards:
            assert {w["clock"] for w in shard["workers"].values()} == {100}
            assert all(w["finished"] for w in shard["workers"].values())
        assert table.returncode == 0, table.stderr
        assert "sync" in table.stdout and "workers (over all shards)" in table.stdout
    finally:
        for s in servers:
            s.send_signal(signal.SIGINT)  # Ctrl-C
        codes = [s.wait(60) for s in servers]
    assert codes == [0, 0]
    assert "shard 1 stopped" in (tmp_path / "server1.log").read_text()


# --------------------------------------------------------------------------- torchrun, Slurm


def _check_run(out: Path, workers: int = 2, steps: int = 100) -> None:
    for r in range(workers):
        result = json.loads((out / "results" / f"worker{r}.json").read_text())
        assert result["steps"] == steps
    for i in range(2):
        assert read_events(out / "events" / f"server{i}.jsonl", "server_stop")


def _run_args(out: Path, *extra: str) -> list[str]:
    return ["run", "--num-servers", "2", "--mode", "async", "--steps", "100",
            "--device", "cpu", "--out", str(out), *extra]


def test_torchrun_one_node(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start([*TORCHRUN, "--nnodes", "1", "--nproc-per-node", "4", "--master-port",
                  str(free_port()), "-m", "paramserver.cli", *_run_args(out)],
                 tmp_path / "torchrun.log")
    pids = watch(proc, LIMIT)
    text = (tmp_path / "torchrun.log").read_text()
    assert proc.returncode == 0, text
    assert "rank 0 of 4 (torchrun) is server (shard 0 of 2)" in text
    assert "rank 3 of 4 (torchrun) is worker 1 of 2" in text
    assert "every worker is done; stopping" in text
    _check_run(out)
    assert_gone(pids)


def test_torchrun_two_nodes_with_c10d_rendezvous(tmp_path: Path) -> None:
    out = tmp_path / "run"
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    nodes = [start([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
                    "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                    "-m", "paramserver.cli", *_run_args(out)], tmp_path / f"node{n}.log")
             for n in range(2)]
    for n, node in enumerate(nodes):
        watch(node, LIMIT)
        assert node.returncode == 0, (tmp_path / f"node{n}.log").read_text()
    _check_run(out)


def test_slurm_environment(tmp_path: Path) -> None:
    """Four tasks as srun would start them (without Slurm: the variables it sets)."""
    out, port = tmp_path / "run", free_port()
    procs = [start([*PARAMSERVER, *_run_args(out, "--store-port", str(port))],
                   tmp_path / f"task{i}.log",
                   env=env(SLURM_PROCID=str(i), SLURM_NTASKS="4", SLURM_LOCALID=str(i),
                           SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
                           SLURM_JOB_ID="4242"))
             for i in range(4)]
    for i, proc in enumerate(procs):
        watch(proc, LIMIT)
        assert proc.returncode == 0, (tmp_path / f"task{i}.log").read_text()
    assert "rank 2 of 4 (slurm) is worker 0 of 2" in (tmp_path / "task2.log").read_text()
    _check_run(out)


def test_rendezvous_that_never_completes_names_the_missing_ranks(tmp_path: Path) -> None:
    port = free_port()
    base = dict(SLURM_NTASKS="3", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost")
    procs = [start([*PARAMSERVER, "run", "--num-servers", "2", "--store-port", str(port),
                    "--rendezvous-timeout", "5", "--device", "cpu"],
                   tmp_path / f"task{i}.log", env=env(SLURM_PROCID=str(i), **base))
             for i in (0, 2)]  # rank 1 (shard 1) never starts
    worker = procs[1]
    assert worker.wait(LIMIT) == 1
    text = (tmp_path / "task2.log").read_text()
    assert "server rank(s) 1 (of 2) published no address" in text
    server = procs[0]  # the worker counted itself done, so the server stops by itself
    assert server.wait(60) == 0, (tmp_path / "task0.log").read_text()


# --------------------------------------------------------------------------- two hosts




@contextmanager
def two_hosts() -> Iterator[tuple[str, str, str, str]]:
    """Two network namespaces joined by a veth pair: (ns_a, ip_a, ns_b, ip_b)."""
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"psA{tag}", f"psB{tag}"
    ip_a, ip_b = "10.213.7.1", "10.213.7.2"
    steps = [
        ["ip", "netns", "add", ns_a], ["ip", "netns", "add", ns_b],
        ["ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"],
        ["ip", "link", "set", f"va{tag}", "netns", ns_a],
        ["ip", "link", "set", f"vb{tag}", "netns", ns_b],
        ["ip", "-n", ns_a, "addr", "add", f"{ip_a}/24", "dev", f"va{tag}"],
        ["ip", "-n", ns_b, "addr", "add", f"{ip_b}/24", "dev", f"vb{tag}"],
        *[["ip", "-n", ns, "link", "set", dev, "up"]
          for ns, dev in ((ns_a, f"va{tag}"), (ns_b, f"vb{tag}"), (ns_a, "lo"), (ns_b, "lo"))],
    ]
    try:
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot set up network namespaces here: {' '.join(cmd)}: "
                            f"{done.stderr.strip()}")
        yield ns_a, ip_a, ns_b, ip_b
    finally:
        for ns in (ns_a, ns_b):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.skipif(_netns_problem() is not None, reason=str(_netns_problem()))
def test_two_hosts_servers_in_one_namespace_workers_in_the_other(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with two_hosts() as (ns_a, ip_a, ns_b, _ip_b):
        port = "29517"  # namespaces have their own ports: no clash with this host
        nodes = [start(["ip", "netns", "exec", ns, *TORCHRUN, "--nnodes", "2", "--node-rank",
                        str(rank), "--nproc-per-node", "2", "--master-addr", ip_a,
                        "--master-port", port, "-m", "paramserver.cli", *_run_args(out)],
                       tmp_path / f"node{rank}.log")
                 for rank, ns in ((0, ns_a), (1, ns_b))]
        for rank, node in enumerate(nodes):
            watch(node, LIMIT)
            assert node.returncode == 0, (tmp_path / f"node{rank}.log").read_text()
    _check_run(out)
    for i in range(2):  # the servers listened on namespace A's address, not loopback
        start_event = read_events(out / "events" / f"server{i}.jsonl", "server_start")[0]
        assert start_event["address"].startswith(f"tcp://{ip_a}:")
    assert "worker 0 of 2" in (tmp_path / "node1.log").read_text()


