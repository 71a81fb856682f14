"""Async across an emulated cluster: does one slow NIC slow the other workers down?

N workers on N hosts push and pull as fast as they can (async, their N shards on N
server hosts, every NIC at the same rate). Then one worker host's NIC is cut to a
fraction of the rate, live, and the same is measured again. In async mode no worker
waits for another, so the other workers' updates/s should not move: a shard that let
a push's reply wait behind the slow worker's transfer, or a server NIC kept busy by
it, would show here. Windows alternate (fast, slow; then slow, fast, ...) so that a
load change on the machine hits both alike, and each repeat gives a paired ratio.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from paramserver.workers.launch.netcluster import (
    NetnsUnavailable,
    emulated_cluster,
    netns_problem,
    parse_rate,
)

from .common import Agent, Stats, close_all, number, text
from .records import ClusterAsyncRow

__all__ = ["DEFAULT_SLOW_FACTOR", "run_cluster_async"]

DEFAULT_SLOW_FACTOR = 4
_TIMEOUT = 600.0
_LR = 1e-3


def _window(workers: list[Agent], addrs: list[str], numel: int, seconds: float,
            warmup: int) -> list[float]:
    """Each worker's pushes/s over one window of about ``seconds``."""
    stop = Path(tempfile.mkdtemp(prefix="ps-bench-")) / "stop"
    try:
        for r, a in enumerate(workers):
            # one round checks the stop file: a round of a slow host is long
            a.send("ps_async", addresses=list(addrs), numel=numel, rank=r, warmup=warmup,
                   stop_file=str(stop), batch=1)
        for a in workers:
            a.read(_TIMEOUT)  # {"running": true}: connected and warmed up
        time.sleep(seconds)  # the measured window itself, not a wait for an event
        stop.touch()
        results = [a.read(_TIMEOUT) for a in workers]
    finally:
        stop.touch()
        shutil.rmtree(stop.parent, ignore_errors=True)
    return [number(r, "pushes") / number(r, "seconds") for r in results]


def run_cluster_async(workers: int = 4, nbytes: int = 2 << 20, rate: str = "400mbit",
                      slow_factor: int = DEFAULT_SLOW_FACTOR, repeats: int = 3,
                      seconds: float = 3.0, warmup: int = 3,
                      log_dir: Path | None = None) -> ClusterAsyncRow | str:
    """The async rows of the cluster part, or why they could not run (a line).

    Worker host 0 is the slow one (``rate / slow_factor`` both ways) in the slow windows.
    """
    if workers < 2:
        raise ValueError("the async cluster measure needs at least 2 workers (one slow)")
    bits = parse_rate(rate)
    slow_bits = max(1, bits // slow_factor)
    problem = netns_problem()
    if problem:
        return problem
    numel = nbytes // 4
    agents: list[Agent] = []
    try:
        with emulated_cluster(workers, workers, rate) as c:
            try:
                servers = [Agent(f"async-server{i}", log_dir, c.exec_prefix(h))
                           for i, h in enumerate(c.servers)]
                agents += servers
                for i, (a, h) in enumerate(zip(servers, c.servers, strict=True)):
                    a.send("ps_serve", config={
                        "shard": i, "num_shards": workers, "mode": "async",
                        "expected_workers": workers, "optimizer": "sgd",
                        "optimizer_args": {"lr": _LR}, "heartbeat_timeout": 120.0,
                        "bind": f"tcp://{h.ip}:0"})
                addrs = [text(a.read(_TIMEOUT), "address") for a in servers]
                ws = [Agent(f"async-worker{r}", log_dir, c.exec_prefix(h))
                      for r, h in enumerate(c.workers)]
                agents += ws
                fast: list[list[float]] = []
                slow: list[list[float]] = []
                for rep in range(repeats):
                    for is_slow in ((False, True) if rep % 2 == 0 else (True, False)):
                        c.set_rate(c.workers[0], slow_bits if is_slow else bits)
                        (slow if is_slow else fast).append(
                            _window(ws, addrs, numel, seconds, warmup))
                ws[0].call("ps_stop", 60.0, addresses=addrs)
                for a in servers:
                    a.read(_TIMEOUT)
            finally:
                close_all(agents)
    except NetnsUnavailable as exc:
        return str(exc)
    return _row(workers, nbytes, rate, slow_bits, fast, slow)


def _row(workers: int, nbytes: int, rate: str, slow_bits: int,
         fast: Sequence[Sequence[float]], slow: Sequence[Sequence[float]]) -> ClusterAsyncRow:
    """The others' (workers 1..N-1) mean updates/s, slow over fast, paired per repeat."""
    def others(rates: Sequence[float]) -> float:
        return sum(rates[1:]) / (len(rates) - 1)

    return ClusterAsyncRow(
        workers=workers, bytes=nbytes, rate=rate, slow_bits=slow_bits,
        fast_per_worker=tuple(tuple(r) for r in fast),
        slow_per_worker=tuple(tuple(r) for r in slow),
        others_vs_fast=Stats.of([others(s) / others(f) for f, s in zip(fast, slow,
                                                                       strict=True)]),
        slow_vs_fast=Stats.of([s[0] / f[0] for f, s in zip(fast, slow, strict=True)]))
