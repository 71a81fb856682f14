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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from paramserver.util.jsontypes import JSONObject
from paramserver.workers.admin import server_stats, shutdown_servers

from .common import Agent, close_all, cpu_seconds, descendants, integer, number, obj, text
from .raw import stop as raw_stop
from .records import AsyncRow, MemoryRow, OverlapResult

__all__ = ["run_async", "run_async_raw", "run_async_ray", "run_memory", "run_overlap"]

_TIMEOUT = 600.0


def _start_servers(label: str, shards: int, config: JSONObject, log_dir: Path | None
                   ) -> tuple[list[Agent], list[str]]:
    servers = [Agent(f"{label}-server{i}", log_dir) for i in range(shards)]
    try:
        for i, a in enumerate(servers):
            a.send("ps_serve", config={"shard": i, "num_shards": shards, **config})
        return servers, [text(a.read(_TIMEOUT), "address") for a in servers]
    except BaseException:
        close_all(servers)
        raise


@dataclass(frozen=True)
class _Window:
    """What moved over a measuring window of the async part."""

    counted: float  # what ``count`` moved by (versions applied), 0 without one
    cpu: float  # CPU seconds of every process measured
    shard_cpu: float  # ... of the shards' among them
    seconds: float
    results: list[JSONObject]  # each worker's return


def _window(workers: list[Agent], pids: list[int], shard_pids: list[int], seconds: float,
            stop: Path, count: Callable[[], float] | None = None) -> _Window:
    """Wait until every worker announced it is running, measure ``seconds``, then
    stop the workers (``stop`` touched) and collect what they return."""
    for a in workers:
        a.read(_TIMEOUT)  # {"running": true}: connected and warmed up
    time.sleep(0.5)
    v0 = count() if count else 0.0
    c0, s0, t0 = cpu_seconds(pids), cpu_seconds(shard_pids), time.perf_counter()
    time.sleep(seconds)
    v1 = count() if count else 0.0
    c1, s1, t1 = cpu_seconds(pids), cpu_seconds(shard_pids), time.perf_counter()
    stop.touch()
    return _Window(v1 - v0, c1 - c0, s1 - s0, t1 - t0, [a.read(_TIMEOUT) for a in workers])


def _rates(results: list[JSONObject]) -> tuple[float, ...]:
    """Each worker's pushes per second over its window."""
    return tuple(number(r, "pushes") / number(r, "seconds") for r in results)


def _versions(addrs: list[str]) -> float:
    """The versions of these shards, summed: the pushes they applied."""
    return float(sum(st.version for st in server_stats(addrs)))


def run_async(workers: int = 4, shards: tuple[int, ...] = (1, 2, 4), nbytes: int = 4096,
              pieces: int = 8, seconds: float = 3.0, lr: float = 1e-3,
              log_dir: Path | None = None, server: JSONObject | None = None
              ) -> list[AsyncRow]:
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
            w = _window(ws, [a.pid for a in agents], [a.pid for a in servers], seconds, stop,
                        partial(_versions, addrs))
            shutdown_servers(addrs)
            for a in servers:
                a.read(_TIMEOUT)
            addrs = []
            model_updates = max(1e-9, w.counted / s)  # one push applied on every shard
            out.append(AsyncRow(
                workers, s, nbytes, pieces, "ps",
                model_updates_per_s=w.counted / s / w.seconds,
                shard_updates_per_s=w.counted / w.seconds,
                cpu_s_per_model_update=w.cpu / model_updates,
                worker_pushes_per_s=_rates(w.results), window_s=w.seconds,
                # the shards' part of it (the rest: the workers'): which side is the limit
                shard_cpu_s_per_model_update=w.shard_cpu / model_updates,
                shard_busy=w.shard_cpu / s / w.seconds))  # per shard, 1.0: a core all the time
        finally:
            stop.touch()
            if addrs:
                shutdown_servers(addrs, timeout=2.0)
            close_all(agents)
            shutil.rmtree(stop.parent, ignore_errors=True)
    return out


def run_async_ray(workers: int = 4, nbytes: int = 4096, pieces: int = 8,
                  seconds: float = 3.0, lr: float = 1e-3, log_dir: Path | None = None
                  ) -> AsyncRow:
    """Model updates/s of Ray's actor parameter server, as :func:`run_async` counts them."""
    head = Agent("async-ray-head", log_dir)
    agents = [head]
    stop = Path(tempfile.mkdtemp(prefix="ps-bench-")) / "stop"
    try:
        address = text(head.call("ray_serve", _TIMEOUT, workers=1, lr=lr), "address")
        ws = [Agent(f"async-ray-worker{r}", log_dir) for r in range(workers)]
        agents += ws
        for a in ws:
            a.send("ray_async", address=address, numel=nbytes // 4, pieces=pieces, warmup=20,
                   stop_file=str(stop))
        pids = [a.pid for a in ws] + descendants(head.pid)  # with Ray's own processes
        w = _window(ws, pids, [], seconds, stop,
                    lambda: number(head.call("ray_version", _TIMEOUT), "version"))
        head.call("ray_stop", _TIMEOUT)
        return AsyncRow(workers, None, nbytes, pieces, "ray",
                        model_updates_per_s=w.counted / w.seconds,
                        shard_updates_per_s=w.counted / w.seconds,
                        cpu_s_per_model_update=w.cpu / max(1, w.counted),
                        worker_pushes_per_s=_rates(w.results), window_s=w.seconds)
    finally:
        stop.touch()
        close_all(agents)
        shutil.rmtree(stop.parent, ignore_errors=True)


def run_async_raw(workers: int = 4, nbytes: int = 4096, seconds: float = 3.0,
                  lr: float = 1e-3, log_dir: Path | None = None) -> AsyncRow:
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
        address = text(server.read(_TIMEOUT), "address")
        ws = [Agent(f"async-raw-worker{r}", log_dir) for r in range(workers)]
        agents += ws
        for a in ws:
            a.send("raw_async", addresses=[address], numel=nbytes // 4, warmup=20,
                   stop_file=str(stop))
        w = _window(ws, [a.pid for a in agents], [server.pid], seconds, stop)
        rates = _rates(w.results)
        updates = max(1e-9, sum(rates) * w.seconds)
        return AsyncRow(workers, 1, nbytes, 1, "raw", model_updates_per_s=sum(rates),
                        shard_updates_per_s=sum(rates), cpu_s_per_model_update=w.cpu / updates,
                        worker_pushes_per_s=rates, window_s=w.seconds,
                        shard_cpu_s_per_model_update=w.shard_cpu / updates,
                        shard_busy=w.shard_cpu / w.seconds)
    finally:
        stop.touch()
        if address is not None:
            raw_stop([address], timeout_ms=2000)
        close_all(agents)
        shutil.rmtree(stop.parent, ignore_errors=True)


def run_memory(workers: tuple[int, ...] = (1, 2, 4), nbytes: int = 64 << 20, rounds: int = 4,
               momentum: float = 0.9, lr: float = 1e-3, log_dir: Path | None = None,
               server: JSONObject | None = None, worker: JSONObject | None = None
               ) -> list[MemoryRow]:
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
            weights = integer(rep, "weight_bytes")
            state = integer(rep, "optimizer_state_bytes")
            expected = 2 * weights + state  # weights, optimizer state, one aggregation buffer
            base, peak = integer(rep, "rss_base"), integer(rep, "peak_rss")
            counters = obj(rep, "counters", {})
            release = (server or {}).get("shm_release")  # None: the default
            out.append(MemoryRow(
                n, nbytes, momentum, weights, state, aggregation_bytes=weights,
                expected_bytes=expected, rss_base=base, peak_rss=peak,
                peak_over_base=peak - base, ratio=(peak - base) / expected,
                copy_on_write=integer(counters, "copy_on_write", 0),
                shm_peers=integer(counters, "shm_peers", 0),
                shm_release=release if isinstance(release, bool) else None))
        finally:
            if addrs:
                shutdown_servers(addrs, timeout=2.0)
            close_all(agents)
    return out


def run_overlap(width: int = 1024, depth: int = 6, batch: int = 64, steps: int = 2,
                repeats: int = 5, bucket_bytes: int = 4 << 20, device: str = "cpu",
                lr: float = 1e-3, log_dir: Path | None = None,
                server: JSONObject | None = None, threads: int = 0,
                tcp: bool = False) -> OverlapResult:
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
                          device=device, threads=threads, tcp=tcp)
        shutdown_servers(addrs)
        addrs = []
        for a in servers:
            a.read(_TIMEOUT)
        return OverlapResult.from_json(res)
    finally:
        if addrs:
            shutdown_servers(addrs, timeout=2.0)
        close_all(agents)
