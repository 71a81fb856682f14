"""The same-host shared-memory path over real shard processes on loopback: the
same results as TCP, cleanup after SIGKILL, and no segment for an untrusted peer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from paramserver.core.sharding import ShardPlan
from paramserver.server.loop import ServerConfig
from paramserver.shm import link as shm
from paramserver.wire.curve import CurveKeys, generate_curve_keys
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.worker import WorkerConfig

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not shm.enabled(), reason="no shared memory here")]

STEPS = 6


def _spec(mode: str, workers: int, shards: int = 2, worker: dict | None = None,
          **server) -> ClusterSpec:
    server = {"optimizer_args": {"lr": 0.05, "momentum": 0.9}, **server}
    return ClusterSpec(num_servers=shards, num_workers=workers,
                       server=ServerConfig(mode=mode, optimizer="sgd", heartbeat_timeout=30,
                                           **server),
                       worker=WorkerConfig(servers=[], task="digits-mlp", **(worker or {})),
                       evaluate=False)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 600), torch.nn.Linear(600, 10))


def _train(addresses: list[str], rank: int, plan: ShardPlan, out: dict,
           model: torch.nn.Module) -> None:
    params = dict(model.named_parameters())
    with PSClient(addresses, plan, rank, timeout=30) as client:
        clock = client.connect()
        client.initialize(params)
        versions = client.pull(params, clock).versions
        out[f"shm{rank}"] = all(ch.shm is not None and ch.shm.active for ch in client.channels)
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * rank + step)
            grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
            if step % 2:  # in parts, bucket by bucket, as backward would send them
                stream = client.push_stream([[n] for n in params], versions, 1, clock + step)
                for n in params:
                    stream.send({n: grads[n]})
                pushed, pulled = stream.finish(params)
                assert pulled is not None
            else:
                pushed, pulled = client.push_pull(grads, versions, 1, clock + step, params)
            assert pushed.accepted
            versions = pulled.versions
        client.bye()
    out[rank] = {n: p.detach().clone() for n, p in params.items()}


def _run(tmp_path: Path, mode: str, workers: int, use_shm: bool,
         monkeypatch: pytest.MonkeyPatch, **server) -> tuple[dict, list[dict]]:
    monkeypatch.setenv(shm.ENV, "1" if use_shm else "0")  # the workers' side only:
    plan = ShardPlan.from_module(_model(), 2, chunk_bytes=32 << 10)
    assert min(plan.shard_bytes(s) for s in range(2)) >= shm.MIN_BYTES
    out: dict = {}
    with LocalCluster(_spec(mode, workers, **server), tmp_path) as cluster:
        monkeypatch.delenv(shm.ENV)
        addresses = cluster.start_servers()  # the shards always offer it
        monkeypatch.setenv(shm.ENV, "1" if use_shm else "0")
        # the models are made here: torch's global generator is not for threads
        threads = [threading.Thread(target=_train, args=(addresses, r, plan, out, _model()))
                   for r in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = server_stats(addresses)
    assert all(r in out for r in range(workers)), "a worker failed (see its traceback)"
    return out, stats


@pytest.mark.parametrize(("mode", "workers", "release", "momentum"),
                         [("sync", 2, True, 0.9), ("sync", 1, None, 0.0),
                          ("async", 1, False, 0.9)])
def test_shared_memory_gives_the_results_of_tcp(tmp_path, monkeypatch, mode, workers, release,
                                                momentum):
    """The weights live in the board (stepped in place in sync, moved aside in async);
    with --shm-release the shard also unmaps each push's pages once used; one sync
    worker's round steps straight from its segment (and by default keeps it mapped)."""
    opt = {"optimizer_args": {"lr": 0.05, "momentum": momentum}}
    on, on_stats = _run(tmp_path / "on", mode, workers, True, monkeypatch, shm_release=release,
                        **opt)
    off, off_stats = _run(tmp_path / "off", mode, workers, False, monkeypatch, **opt)
    assert all(on[f"shm{r}"] and not off[f"shm{r}"] for r in range(workers))
    for r in range(workers):
        for name, value in off[r].items():
            assert torch.equal(on[r][name], value), name
    assert not torch.equal(on[0]["0.weight"], dict(_model().named_parameters())["0.weight"])
    for s_on, s_off in zip(on_stats, off_stats, strict=True):
        assert s_on.version == s_off.version == (STEPS if mode == "sync"
                                                        else STEPS * workers)
        assert s_on.counters["shm_pulls"] >= STEPS and "shm_pulls" not in s_off.counters
        # headers only: far fewer bytes came in over the socket
        assert s_on.counters["bytes_in"] * 10 < s_off.counters["bytes_in"]
        # a lone worker's plain-SGD round steps from its own tensors, whatever the path
        lone = mode == "sync" and workers == 1 and momentum == 0.0
        assert (s_on.core.rounds_in_place == s_on.version) == lone
        assert (s_off.core.rounds_in_place == s_off.version) == lone


_WORKER = """
import sys, torch
from paramserver.core.sharding import ShardPlan
from paramserver.workers.client import PSClient
torch.manual_seed(0)
model = torch.nn.Linear(256, 128)  # over shm.MIN_BYTES
params = dict(model.named_parameters())
client = PSClient([sys.argv[1]], ShardPlan.from_module(model, 1), 0, timeout=30)
clock = client.connect()
client.initialize(params)
versions = client.pull(params, clock).versions
grads = {n: torch.ones_like(p) for n, p in params.items()}
client.push_pull(grads, versions, 1, clock, params)
print("active", client.channels[0].shm.active, flush=True)
sys.stdin.read()  # hold the segments until killed
"""


def _segments(pid: int) -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith("paramserver-shm.")
            and n.split(".")[2] == str(pid)]


def test_sigkilled_processes_leave_segments_that_the_sweep_removes(tmp_path, monkeypatch):
    monkeypatch.setenv(shm.ENV, "1")
    with LocalCluster(_spec("async", 1, shards=1), tmp_path) as cluster:
        (address,) = cluster.start_servers()
        worker = subprocess.Popen([sys.executable, "-c", _WORKER, address],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().split() == ["active", "True"]
            server_pid = cluster.servers[0].popen.pid
            assert _segments(worker.pid) and _segments(server_pid)  # gradients; the board
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            assert _segments(worker.pid)  # a killed process unlinks nothing itself
            removed = shm.sweep()  # what any process does at its first segment
            assert not _segments(worker.pid) and set(removed) >= set()
            assert _segments(server_pid)  # a live owner's segment stays
            os.kill(server_pid, signal.SIGKILL)
            cluster.servers[0].popen.wait(10)
            shm.sweep()
            assert not _segments(server_pid)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def test_curve_peer_without_an_allow_list_entry_gets_no_segment(tmp_path, monkeypatch):
    """Under CURVE a shard admitting any key trusts none of them with its memory;
    one whose allow-list names the key grants it."""
    monkeypatch.setenv(shm.ENV, "1")
    keys = generate_curve_keys(tmp_path / "keys", ["w0"])
    plan = ShardPlan.from_module(torch.nn.Linear(256, 128), 1)
    params = dict(torch.nn.Linear(256, 128).named_parameters())
    client_keys = CurveKeys.load(keys.clients["w0"][1], keys.server_public)
    for allow, granted in ((None, False), (str(keys.authorized_dir), True)):
        spec = _spec("async", 1, shards=1, curve_secret_key=str(keys.server_secret),
                     curve_clients_dir=allow,
                     worker={"curve_key": str(keys.clients["w0"][1]),
                             "curve_server_key": str(keys.server_public)})
        with LocalCluster(spec, tmp_path / str(granted)) as cluster:
            (address,) = cluster.start_servers()
            with PSClient([address], plan, 0, timeout=20, curve=client_keys,
                          heartbeat_interval=0) as client:
                client.connect()
                client.initialize(params)
                client.pull(params)
                assert client.channels[0].shm is not None
                assert client.channels[0].shm.active is granted
                stats = server_stats([address], curve=client_keys)[0]
                assert stats.counters.get("shm_peers", 0) == int(granted)
                assert stats.counters.get("shm_pulls", 0) == int(granted)
                client.bye()


def test_a_pull_whose_board_copies_are_always_overtaken_comes_over_tcp(tmp_path, monkeypatch):
    monkeypatch.setenv(shm.ENV, "1")
    monkeypatch.setattr(shm, "read_guarded", lambda *a, **k: None)  # every copy torn
    model = torch.nn.Linear(256, 128)
    params = dict(model.named_parameters())
    plan = ShardPlan.from_module(model, 1)
    start = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: torch.full_like(p, 0.5) for n, p in params.items()}
    with LocalCluster(_spec("async", 1, shards=1), tmp_path) as cluster:
        (address,) = cluster.start_servers()
        with PSClient([address], plan, 0, timeout=20, heartbeat_interval=0) as client:
            clock = client.connect()
            client.initialize(params)
            versions = client.pull(params, clock).versions
            assert client.channels[0].shm is not None and client.channels[0].shm.active
            _, pulled = client.push_pull(grads, versions, 1, clock, params)
            assert pulled.versions == (1,)
            client.bye()
        counters = server_stats([address])[0].counters
    assert counters["shm_pulls"] == 2  # answered with tickets, then pulled again by frames
    for n, p in params.items():  # the first SGD step (momentum starts at the gradient)
        assert torch.equal(p.detach(), start[n] - 0.05 * grads[n]), n
