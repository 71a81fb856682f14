"""A replicated shard across hosts (issue 32): its primary on one "host", its backup on
another, and the link between them cut while the primary lives on.

Two network namespaces joined by a veth pair stand in for the hosts
(paramserver/benchmarks/netns.py): namespace A holds shard 0's primary and worker 1,
namespace B its backup and worker 0; every replica and worker is a real process
started by hand (tests/replicas_by_hand.py, ``python -m paramserver.workers.worker``).
An async or sync run goes, then the link is cut: each end of the pair drops every
packet it would send (a zero-length queue), while both ends stay up, so each namespace
still reaches its own addresses. A is partitioned: its primary lives but hears no one
of B.

* The backup takes over at epoch 1 and worker 0 (in B) moves to it (async: and
  finishes, as it is not the evaluator, which waits in ``final()`` for every worker;
  sync: its rounds wait for worker 1).
* Worker 1 (in A) reaches only the old primary, which answers nothing: it would
  first need the backup's acknowledgement (fencing by waiting; it never drops a
  backup whose connection is up). So no write is accepted beside the new primary.
* The link comes back: the old primary's held input, or keep-alive, is refused with
  epoch 1, so it steps down and rejoins as a backup of the new primary; worker 1
  moves to the new primary and finishes.
* Async: every push a worker saw acknowledged is in the new primary's version once.
  Sync: the final weights are bit-identical (``torch.equal``) to the same run on
  loopback without replicas or failure.

Needs root and iproute2 (skipped otherwise, with the reason).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paramserver.benchmarks.netns import Link, exec_prefix, netns_problem, two_namespaces
from paramserver.observe.events import read_events
from paramserver.server.config import ServerConfig
from paramserver.workers.config import WorkerConfig
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.stragglerspec import StragglerSpec
from tests.replicas_by_hand import ENV, Replica, replication_key, start

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(netns_problem() is not None, reason=str(netns_problem()))]

STEPS = 80
LIMIT = 60.0  # seconds for any one phase of the run
# failover timeouts the partition lasts at least: TCP takes the old primary's connection
# to its backup down within one (TCP_MAXRT), and it probes the backup's host once each
WAITS = 5
ROOT = Path(__file__).resolve().parents[1]  # (where `tests` is a package)


def _wait(what: str, done: Callable[[], bool], limit: float = LIMIT) -> None:
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.1)  # polling a file or a process, not standing in for an event


def _events(path: Path, event: str) -> list[dict]:
    return read_events(path, event) if path.exists() else []


def _veth(ns: str) -> str:
    """The name of the veth end inside namespace ``ns``."""
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "type", "veth"],
                         capture_output=True, text=True, check=True).stdout
    return out.split(":")[1].strip().split("@")[0]


def _link(link: Link, cut: bool) -> None:
    """Cut the link (both ends drop whatever they would send) or restore it."""
    for ns in (link.ns_a, link.ns_b):
        qdisc = ["add", "dev", _veth(ns), "root", "pfifo", "limit", "0"] if cut \
            else ["del", "dev", _veth(ns), "root"]
        subprocess.run([*exec_prefix(ns), "tc", "qdisc", *qdisc], check=True,
                       capture_output=True)


def _in_ns(ns: str, code: str) -> str:
    """Run Python ``code`` inside ``ns``; what it printed."""
    done = subprocess.run([*exec_prefix(ns), sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=ENV)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _roles_weights_stop(ns: str, addresses: list[str], mode: str, entry: str, out: Path
                        ) -> tuple[dict[str, tuple[str, int] | None], dict[str, torch.Tensor]]:
    """From inside ``ns``, in one interpreter (each start costs seconds): each replica's
    (role, epoch); then the shard's weights as the launcher saves them (an observer's
    pull); then both replicas asked to stop, each answering."""
    out.mkdir()
    code = ("import json\nfrom pathlib import Path\n"
            "from paramserver.workers.admin import shutdown_servers\n"
            "from paramserver.workers.failover import ask_roles\n"
            "from paramserver.workers.launch.finalfigures import final_eval\n"
            "from tests.test_replication_hosts_e2e import _spec\n"
            f"r = ask_roles({addresses!r}, timeout=3.0)\n"
            f"final_eval(_spec({mode!r}), [{entry!r}], Path({str(out)!r}))\n"
            f"assert shutdown_servers({addresses[::-1]!r}) == []\n"
            "print(json.dumps({a: v and [v.role, v.epoch] for a, v in r.items()}))")
    got = json.loads(_in_ns(ns, code).strip().splitlines()[-1])
    roles = {a: (v[0], v[1]) if v else None for a, v in got.items()}
    return roles, load_file(str(out / "final_model.safetensors"))


@pytest.fixture
def hosts() -> Iterator[Link]:
    with two_namespaces() as link:  # deleted with whatever still runs inside
        yield link


def _spec(mode: str) -> ClusterSpec:
    """The run without replicas: what the launcher would start for the hand-made one."""
    return ClusterSpec(num_servers=1, num_workers=2, evaluate=False,
                       server=ServerConfig(mode=mode),
                       worker=WorkerConfig(steps=STEPS))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_partitioned_primary_is_replaced_and_fenced(hosts: Link, tmp_path: Path,
                                                      mode: str) -> None:
    link = hosts
    procs: list[subprocess.Popen[bytes]] = []
    replicas: list[Replica] = []
    beside = ThreadPoolExecutor(1)  # the sync reference run, while the partition idles

    def server(name: str, ns: str, ip: str, **kw: object) -> Replica:
        cfg = ServerConfig(mode=mode, expected_workers=2, replicas=1,
                           failover_timeout=1.0, heartbeat_timeout=60.0, bind=f"tcp://{ip}:0",
                           event_log=str(tmp_path / f"{name}.jsonl"),
                           replication_key=replication_key(tmp_path), **kw)  # type: ignore[arg-type]
        r = start(name, cfg, tmp_path, prefix=exec_prefix(ns))
        replicas.append(r)
        return r

    def worker(rank: int, ns: str, entry: str) -> subprocess.Popen[bytes]:
        cfg = WorkerConfig(rank=rank, world_size=2, servers=[entry], steps=STEPS,
                           # paced, so that the cut lands while pushes stream
                           straggler=StragglerSpec(min_step_time=0.03),
                           # the evaluator waits in final() for every worker, so worker
                           # 0 could not finish while worker 1 is cut off: 1 evaluates
                           evaluator=1,
                           event_log=str(tmp_path / f"worker{rank}.jsonl"),
                           result_file=str(tmp_path / f"worker{rank}.result.json"))
        path = tmp_path / f"worker{rank}.json"
        path.write_text(json.dumps(cfg.to_dict()))
        with (tmp_path / f"worker{rank}.log").open("wb") as log:
            proc = subprocess.Popen([*exec_prefix(ns), sys.executable, "-m",
                                     "paramserver.workers.worker", str(path)],
                                    stdout=log, stderr=subprocess.STDOUT, env=ENV)
        procs.append(proc)
        return proc

    try:
        backup = server("backup", link.ns_b, link.ip_b, replica=1)
        primary = server("primary", link.ns_a, link.ip_a, replica_peers=[backup.address])
        entry = f"{primary.address}|{backup.address}"
        workers = [worker(0, link.ns_b, entry), worker(1, link.ns_a, entry)]
        _wait("the primary took 20 pushes",
              lambda: len(_events(tmp_path / "primary.jsonl", "push")) >= 20)
        _link(link, cut=True)
        cut_at = time.time()
        # B's side goes on: the backup takes over (async: worker 0 finishes with it)
        _wait("the backup took over",
              lambda: bool(_events(tmp_path / "backup.jsonl", "failover")))
        if mode == "async":
            _wait("worker 0 finished", lambda: workers[0].poll() is not None)
            assert workers[0].returncode == 0, (tmp_path / "worker0.log").read_text()[-3000:]
        (failover,) = _events(tmp_path / "backup.jsonl", "failover")
        assert failover["epoch"] == 1
        if mode == "sync":  # the run without replicas or failure, on loopback, meanwhile
            reference = beside.submit(run_cluster, _spec(mode), tmp_path / "reference")
        # the partition outlasts ten failover timeouts as the old primary counts them
        # (it warns once a timeout while it waits for its backup): its connection to
        # the backup went down meanwhile, and the backup does not refuse a connection
        _wait("the old primary waited for its backup ten times, or dropped it",
              lambda: (tmp_path / "primary.log").read_text().count(
                  "has not acknowledged input") >= WAITS
              or bool(_events(tmp_path / "primary.jsonl", "backup_lost")))
        # it did not go on alone: its backup may be (and is) the primary now
        assert _events(tmp_path / "primary.jsonl", "backup_lost") == []
        # A's side: the old primary, alive, accepted nothing meanwhile (worker 1 stalls)
        assert primary.popen.poll() is None and workers[1].poll() is None
        assert not [e for e in _events(tmp_path / "primary.jsonl", "push")
                    if e["t"] > cut_at + 1.0]
        _link(link, cut=False)
        # the old primary is refused with epoch 1, steps down and rejoins as a backup
        _wait("the old primary stepped down",
              lambda: bool(_events(tmp_path / "primary.jsonl", "stepped_down")))
        _wait("the old primary rejoined",
              lambda: bool(_events(tmp_path / "primary.jsonl", "rejoined")))
        for rank, proc in enumerate(workers):
            _wait(f"worker {rank} finished", lambda proc=proc: proc.poll() is not None)
            assert proc.returncode == 0, (tmp_path / f"worker{rank}.log").read_text()[-3000:]
        roles, weights = _roles_weights_stop(link.ns_b, [primary.address, backup.address],
                                             mode, entry, tmp_path / "final")
        assert roles == {backup.address: ("primary", 1), primary.address: ("backup", 1)}
        for r in replicas:
            assert r.popen.wait(60) == 0, r.log.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
        for r in replicas:
            r.stop()
        beside.shutdown(wait=True)  # (its processes end with it)
    (stepped,) = _events(tmp_path / "primary.jsonl", "stepped_down")
    assert stepped["epoch"] == 1
    if mode == "sync":  # the same weights, bit for bit, as the run without failure
        assert reference.result().failures == ()
        expected = load_file(str(tmp_path / "reference" / "final_model.safetensors"))
        assert weights.keys() == expected.keys()
        for key in expected:
            assert torch.equal(weights[key], expected[key]), key
    # every push a worker saw acknowledged is in the new primary's version, once
    results = [json.loads((tmp_path / f"worker{k}.result.json").read_text()) for k in (0, 1)]
    assert [r["steps"] for r in results] == [STEPS, STEPS]
    acknowledged = sum(r["accepted"] for r in results)
    assert acknowledged == 2 * STEPS
    (stop,) = _events(tmp_path / "backup.jsonl", "server_stop")
    assert stop["version"] == (acknowledged if mode == "async" else STEPS)
    # both workers moved to the new primary themselves
    for rank in (0, 1):
        assert "its primary is now" in (tmp_path / f"worker{rank}.log").read_text()
