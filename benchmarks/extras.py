"""Async throughput, shard memory and overlap: the measurements besides the sweep.

* :func:`run_async`: updates applied per second in async mode, a small model
  (4 KiB by default, as several tensors so it spreads over shards) and W
  workers pushing + pulling as fast as they can, for 1, 2, 4 shards. Counted
  on the servers (their versions), in a window that starts after every
  worker is running.
* :func:`run_async_ray`: the same for Ray's actor parameter server (one actor,
  a step per push), counted on the actor.
* :func:`run_async_raw`: the same for the raw pyzmq loop (one shard, a step
  per push, the model as one array): the limit on this machine, counted on
  the workers.
* :func:`run_memory`: peak RSS of one sync shard with N workers, above the
  RSS it had when it started listening (interpreter, torch, zmq), against its
  weights + optimizer state + one aggregation buffer.
* :func:`run_overlap`: :mod:`paramserver.benchmarks.overlap` with one sync shard.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from paramserver.workers.admin import server_stats, shutdown_servers

from .common import Agent, close_all, cpu_seconds, descendants
from .raw import stop as raw_stop

__all__ = ["run_async", "run_async_raw", "run_async_ray", "run_memory", "run_overlap"]

_TIMEOUT = 600.0


def _start_servers(label: str, shards: int, config: dict[str, Any], log_dir: Path | None
                   ) -> tuple[list[Agent], list[str]]:
    servers = [Agent(f"{label}-server{i}", log_dir) for i in range(shards)]
    try:
        for i, a in enumerate(servers):
            a.send("ps_serve", config={"shard": i, "num_shards": shards, **config})
        return servers, [a.read(_TIMEOUT)["address"] for a in servers]
    except BaseException:
        close_all(servers)
        raise


def run_async(workers: int = 4, shards: tuple[int, ...] = (1, 2, 4), nbytes: int = 4096,
              pieces: int = 8, seconds: float = 3.0, lr: float = 1e-3,
              log_dir: Path | None = None, server: dict[str, Any] | None = None
              ) -> list[dict[str, Any]]:
    """One record per shard count: model updates/s, shard updates/s, CPU per update."""
    out = []
    for s in shards:
        agents: list[Agent] = []
        addrs: list[str] = []
        stop = Path(tempfile.mkdtemp(prefix="ps-bench-")) / "stop"
        try:
            servers, addrs = _start_servers(f"async-s{s}", s, {
                "mode": "async", "expected_workers": workers, "optimizer": "sgd",
                "optimizer_args": {"lr": lr}, "heartbeat_timeout": 60.0, **(server or {})},
                log_dir)
            agents += servers
            ws = [Agent(f"async-s{s}-worker{r}", log_dir) for r in range(workers)]
            agents += ws
            for r, a in enumerate(ws):
                a.send("ps_async", addresses=addrs, numel=nbytes // 4, rank=r, pieces=pieces,
                       warmup=20, stop_file=str(stop))
            for a in ws:
                a.read(_TIMEOUT)  # {"running": true}: connected and warmed up
            time.sleep(0.5)
            pids = [a.pid for a in agents]
            shard_pids = [a.pid for a in servers]
            v0 = sum(st["version"] for st in server_stats(addrs))
            c0, s0, t0 = cpu_seconds(pids), cpu_seconds(shard_pids), time.perf_counter()
            time.sleep(seconds)
            v1 = sum(st["version"] for st in server_stats(addrs))
            c1, s1, t1 = cpu_seconds(pids), cpu_seconds(shard_pids), time.perf_counter()
            stop.touch()
            results = [a.read(_TIMEOUT) for a in ws]
            shutdown_servers(addrs)
            for a in servers:
                a.read(_TIMEOUT)
            addrs = []
            shard_rate = (v1 - v0) / (t1 - t0)
            out.append({
                "workers": workers, "shards": s, "bytes": nbytes, "tensors": pieces,
                "system": "ps",
                # a model update = one push applied on every shard
                "model_updates_per_s": shard_rate / s,
                "shard_updates_per_s": shard_rate,
                "cpu_s_per_model_update": (c1 - c0) / max(1e-9, (v1 - v0) / s),
                # the shards' part of it (the rest: the workers'): which side is the limit
                "shard_cpu_s_per_model_update": (s1 - s0) / max(1e-9, (v1 - v0) / s),
                "shard_busy": (s1 - s0) / s / (t1 - t0),  # per shard, 1.0: a core all the time
                "worker_pushes_per_s": [r["pushes"] / r["seconds"] for r in results],
                "window_s": t1 - t0,
            })
        finally:
            stop.touch()
            if addrs:
                shutdown_servers(addrs, timeout=2.0)
            close_all(agents)
            shutil.rmtree(stop.parent, ignore_errors=True)
    return out


def run_async_ray(workers: int = 4, nbytes: int = 4096, pieces: int = 8,
                  seconds: float = 3.0, lr: float = 1e-3, log_dir: Path | None = None
                  ) -> dict[str, Any]:
    """Model updates/s of Ray's actor parameter server, as :func:`run_async` counts them."""
    head = Agent("async-ray-head", log_dir)
    agents = [head]
    stop = Path(tempfile.mkdtemp(prefix="ps-bench-")) / "stop"
    try:
        address = head.call("ray_serve", _TIMEOUT, workers=1, lr=lr)["address"]
        ws = [Agent(f"async-ray-worker{r}", log_dir) for r in range(workers)]
        agents += ws
        for a in ws:
            a.send("ray_async", address=address, numel=nbytes // 4, pieces=pieces, warmup=20,
                   stop_file=str(stop))
        for a in ws:
            a.read(_TIMEOUT)
        time.sleep(0.5)
        pids = [a.pid for a in ws] + descendants(head.pid)  # with Ray's own processes
        v0 = head.call("ray_version", _TIMEOUT)["version"]
        c0, t0 = cpu_seconds(pids), time.perf_counter()
        time.sleep(seconds)
        v1 = head.call("ray_version", _TIMEOUT)["version"]
        c1, t1 = cpu_seconds(pids), time.perf_counter()
        stop.touch()
        results = [a.read(_TIMEOUT) for a in ws]
        head.call("ray_stop", _TIMEOUT)
        return {"workers": workers, "shards": None, "bytes": nbytes, "tensors": pieces,
                "system": "ray", "model_updates_per_s": (v1 - v0) / (t1 - t0),
                "shard_updates_per_s": (v1 - v0) / (t1 - t0),
                "cpu_s_per_model_update": (c1 - c0) / max(1, v1 - v0),
                "worker_pushes_per_s": [r["pushes"] / r["seconds"] for r in results],
                "window_s": t1 - t0}
    finally:
        stop.touch()
        close_all(agents)
        shutil.rmtree(stop.parent, ignore_errors=True)


def run_async_raw(workers: int = 4, nbytes: int = 4096, seconds: float = 3.0,
                  lr: float = 1e-3, log_dir: Path | None = None) -> dict[str, Any]:
    """Model updates/s of the raw pyzmq loop, as :func:`run_async` counts them: a raw
    shard that steps on every push (raw.serve with one worker per step) and
    ``workers`` raw workers pushing + pulling as fast as they can. Counted on the
    workers (the raw shard keeps no count a peer can ask for): the sum of their
    rates over the same window. With several workers a zero-copy reply may still
    be read while the next push's step writes the array: the loop measures speed,
    not content."""
    server = Agent("async-raw-server", log_dir)
    agents = [server]
    stop = Path(tempfile.mkdtemp(prefix="ps-bench-")) / "stop"
    address = None
    try:
        server.send("raw_serve", workers=1, lr=lr)
        address = server.read(_TIMEOUT)["address"]
        ws = [Agent(f"async-raw-worker{r}", log_dir) for r in range(workers)]
        agents += ws
        for a in ws:
            a.send("raw_async", addresses=[address], numel=nbytes // 4, warmup=20,
                   stop_file=str(stop))
        for a in ws:
            a.read(_TIMEOUT)
        time.sleep(0.5)
        pids = [a.pid for a in agents]
        c0, s0, t0 = cpu_seconds(pids), cpu_seconds([server.pid]), time.perf_counter()
        time.sleep(seconds)
        c1, s1, t1 = cpu_seconds(pids), cpu_seconds([server.pid]), time.perf_counter()
        stop.touch()
        results = [a.read(_TIMEOUT) for a in ws]
        rates = [r["pushes"] / r["seconds"] for r in results]
        rate = sum(rates)
        return {"workers": workers, "shards": 1, "bytes": nbytes, "tensors": 1,
                "system": "raw", "model_updates_per_s": rate, "shard_updates_per_s": rate,
                "cpu_s_per_model_update": (c1 - c0) / max(1e-9, rate * (t1 - t0)),
                "shard_cpu_s_per_model_update": (s1 - s0) / max(1e-9, rate * (t1 - t0)),
                "shard_busy": (s1 - s0) / (t1 - t0),
                "worker_pushes_per_s": rates, "window_s": t1 - t0}
    finally:
        stop.touch()
        if address is not None:
            raw_stop([address], timeout_ms=2000)
        close_all(agents)
        shutil.rmtree(stop.parent, ignore_errors=True)


def run_memory(workers: tuple[int, ...] = (1, 2, 4), nbytes: int = 64 << 20, rounds: int = 4,
               momentum: float = 0.9, lr: float = 1e-3, log_dir: Path | None = None,
               server: dict[str, Any] | None = None, worker: dict[str, Any] | None = None
               ) -> list[dict[str, Any]]:
    """One record per worker count: the shard's peak RSS over its start, and the budget.

    ``server``: extra ShardServer settings; ``worker``: extra PSSession ones
    (chunk_bytes, part_bytes)."""
    out = []
    numel = nbytes // 4
    for n in workers:
        agents: list[Agent] = []
        addrs: list[str] = []
        try:
            servers, addrs = _start_servers(f"mem-n{n}", 1, {
                "mode": "sync", "expected_workers": n, "optimizer": "sgd",
                "optimizer_args": {"lr": lr, "momentum": momentum},
                "heartbeat_timeout": 60.0, **(server or {})}, log_dir)
            agents += servers
            ws = [Agent(f"mem-n{n}-worker{r}", log_dir) for r in range(n)]
            agents += ws
            for r, a in enumerate(ws):
                a.send("open", system="ps", addresses=addrs, numel=numel, rank=r,
                       **(worker or {}))
            for a in ws:
                a.read(_TIMEOUT)
            for a in ws:
                a.send("measure", system="ps", numel=numel, iters=rounds)
            for a in ws:
                a.read(_TIMEOUT)
            for a in ws:
                a.call("close", _TIMEOUT, system="ps")
            shutdown_servers(addrs)
            addrs = []
            rep = servers[0].read(_TIMEOUT)
            weights, state = rep["weight_bytes"], rep["optimizer_state_bytes"]
            expected = 2 * weights + state  # weights, optimizer state, one aggregation buffer
            grown = rep["peak_rss"] - rep["rss_base"]
            out.append({
                "workers": n, "bytes": nbytes, "momentum": momentum,
                "weight_bytes": weights, "optimizer_state_bytes": state,
                "aggregation_bytes": weights, "expected_bytes": expected,
                "rss_base": rep["rss_base"], "peak_rss": rep["peak_rss"],
                "peak_over_base": grown, "ratio": grown / expected,
                "copy_on_write": rep["counters"].get("copy_on_write", 0),
                "shm_peers": rep["counters"].get("shm_peers", 0),
                "shm_release": (server or {}).get("shm_release"),  # None: the default
            })
        finally:
            if addrs:
                shutdown_servers(addrs, timeout=2.0)
            close_all(agents)
    return out


def run_overlap(width: int = 1024, depth: int = 6, batch: int = 64, steps: int = 2,
                repeats: int = 5, bucket_bytes: int = 4 << 20, device: str = "cpu",
                lr: float = 1e-3, log_dir: Path | None = None,
                server: dict[str, Any] | None = None, threads: int = 0) -> dict[str, Any]:
    agents: list[Agent] = []
    addrs: list[str] = []
    try:
        servers, addrs = _start_servers("overlap", 1, {
            "mode": "sync", "expected_workers": 1, "optimizer": "sgd",
            "optimizer_args": {"lr": lr}, "heartbeat_timeout": 60.0, **(server or {})}, log_dir)
        agents += servers
        worker = Agent("overlap-worker", log_dir)
        agents.append(worker)
        res = worker.call("overlap", _TIMEOUT, addresses=addrs, width=width, depth=depth,
                          batch=batch, steps=steps, repeats=repeats, bucket_bytes=bucket_bytes,
                          device=device, threads=threads)
        shutdown_servers(addrs)
        addrs = []
        for a in servers:
            a.read(_TIMEOUT)
        return res
    finally:
        if addrs:
            shutdown_servers(addrs, timeout=2.0)
        close_all(agents)
