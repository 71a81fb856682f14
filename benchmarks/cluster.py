"""Across an emulated cluster: the sync round against gloo's ring all_reduce and raw pyzmq
on the same links, beside the wire's limits.

N worker hosts and N server hosts (:mod:`paramserver.workers.launch.netcluster`),
every NIC shaped to the same rate B both ways. A round moves an M-byte float32
gradient up from each worker and the M-byte weights back. With a shard on each
server host, every worker's NIC carries M each way at once: the limit is M/B. A
ring all_reduce sends and receives 2(N-1)/N · M through each NIC: its limit.

Systems, alive together and their repeats interleaved (as in the sweep,
:func:`~paramserver.benchmarks.suite.run_sweep`), so that the machine's load hits
them alike and each repeat gives a paired ratio to gloo:

* ``raw``: the raw pyzmq loop (benchmarks/raw.py), N shards on the server hosts;
* ``ps``: this project's sync round, N shards on the server hosts;
* ``ps-colocated``: the same with shard i on worker host i (no server hosts used);
* ``ps-parts``: ``ps`` with each shard's share pushed in parts of ``EARLY_PART_BYTES``
  (a plan chunked as finely), its weights back in the round's answers;
* ``ps-early``: ``ps-parts`` with early parts asked for (``PSClient(early_parts=True)``:
  a part's weights come back while later parts still go up; pipelined per part), so
  that it differs from ``ps-parts`` in that alone;
* ``ps-int8``, ``ps-topk``: ``ps`` with the push compressed (``--compression int8``, and
  ``topk:ratio=0.01``, both with error feedback; paramserver/compress), the weights
  pulled dense;
* ``ps-int8-2way``, ``ps-topk-2way``: the same with the pulls compressed too (the
  shards' ``--pull-compression``, DoubleSqueeze: core/pullsqueeze.py);
* ``gloo``: torch.distributed all_reduce (gloo's ring) on the worker hosts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from paramserver.util.jsontypes import JSON, JSONObject
from paramserver.workers.launch.netcluster import (
    NIC,
    EmulatedCluster,
    Host,
    NetnsUnavailable,
    emulated_cluster,
    netns_problem,
    parse_rate,
)

from .common import Agent, Stats, close_all, free_port, text
from .records import ClusterResult, ClusterRow
from .suite import SweepConfig, _measure, _System

__all__ = ["DEFAULT_RATE", "DEFAULT_SIZES", "DEFAULT_WORKERS", "EARLY_PART_BYTES", "SYSTEMS",
           "limits",
           "run_cluster"]

log = logging.getLogger(__name__)

DEFAULT_SIZES: tuple[int, ...] = (8 << 20, 32 << 20)
DEFAULT_WORKERS: tuple[int, ...] = (2, 4)
DEFAULT_RATE = "400mbit"
SYSTEMS: tuple[str, ...] = ("raw", "ps", "ps-colocated", "ps-parts", "ps-early", "ps-int8",
                             "ps-topk", "ps-int8-2way", "ps-topk-2way", "gloo")
#: the project's variants (every system a shard serves)
_PS = tuple(s for s in SYSTEMS if s.startswith("ps"))
#: ps-parts' and ps-early's part (and chunk) size: an 8 MiB round over 4 shards is 4 parts
#: per shard, so a part's weights can come back while 3 more go up (a slice is never
#: split, hence the plan's chunks too)
EARLY_PART_BYTES = 512 << 10
#: the session arguments of the project's variants beyond where the shards are
_VARIANTS: dict[str, JSONObject] = {
    "ps-parts": {"chunk_bytes": EARLY_PART_BYTES, "part_bytes": EARLY_PART_BYTES},
    "ps-early": {"chunk_bytes": EARLY_PART_BYTES, "part_bytes": EARLY_PART_BYTES,
                 "early_parts": True},
    "ps-int8": {"compression": "int8"},
    "ps-topk": {"compression": "topk:ratio=0.01"},
    "ps-int8-2way": {"compression": "int8"},
    "ps-topk-2way": {"compression": "topk:ratio=0.01"},
}
#: the shards' configuration of the variants beyond the common one
_SERVED: dict[str, JSONObject] = {
    "ps-int8-2way": {"pull_compression": "int8"},
    "ps-topk-2way": {"pull_compression": "topk:ratio=0.01"},
}
_TIMEOUT = 600.0
_LR = 1e-3


def limits(workers: int, nbytes: int, bits: int) -> tuple[float, float]:
    """(M/B, 2(N-1)/N · M/B) in seconds for an M-byte round on B-bit/s NICs."""
    wire = nbytes * 8 / bits
    return wire, 2 * (workers - 1) / workers * wire


class _World:
    """The agents of one N: every system's processes on its hosts, kept across sizes."""

    def __init__(self, c: EmulatedCluster, n: int, systems: Sequence[str],
                 log_dir: Path | None) -> None:
        self.c, self.n, self.log_dir = c, n, log_dir
        self.agents: list[Agent] = []
        self.raw_addrs: list[str] = []
        self.systems: dict[str, _System] = {}
        self.servers: dict[str, tuple[list[Agent], list[str]]] = {}
        try:
            if "raw" in systems:
                servers = self._spawn("raw-server", c.servers)
                for a, h in zip(servers, c.servers, strict=True):
                    a.send("raw_serve", workers=n, lr=_LR, host=h.ip)
                self.raw_addrs = [text(a.read(_TIMEOUT), "address") for a in servers]
                self.systems["raw"] = _System("raw", self._spawn("raw-worker", c.workers),
                                              "raw", servers=servers)
            for name in _PS:
                if name in systems:
                    hosts = c.workers if name == "ps-colocated" else c.servers
                    servers = self._spawn(f"{name}-server", hosts)
                    self.servers[name] = (servers, [h.ip for h in hosts])
                    self.systems[name] = _System(name, self._spawn(f"{name}-worker", c.workers),
                                                 "ps", servers=servers)
            if "gloo" in systems:
                gloo = _System("gloo", self._spawn("gloo", c.workers), "gloo")
                port = free_port()
                gloo.open([{"rank": r, "world": n, "port": port, "lr": _LR,
                            "host": c.workers[0].ip, "ifname": NIC} for r in range(n)])
                self.systems["gloo"] = gloo
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, hosts: Sequence[Host]) -> list[Agent]:
        agents = [Agent(f"{name}{i}-n{self.n}", self.log_dir, self.c.exec_prefix(h))
                  for i, h in enumerate(hosts)]
        self.agents += agents
        return agents

    def cell(self, nbytes: int, cfg: SweepConfig) -> dict[str, list[float]]:
        """Every system's rounds of ``nbytes``, interleaved."""
        numel, n = nbytes // 4, self.n
        running: list[_System] = []
        served: list[tuple[str, list[str]]] = []
        if "raw" in self.systems:
            raw_addrs: list[JSON] = list(self.raw_addrs)
            self.systems["raw"].open([{"addresses": raw_addrs, "numel": numel}] * n)
            running.append(self.systems["raw"])
        try:
            for name, (servers, ips) in self.servers.items():
                for i, (a, ip) in enumerate(zip(servers, ips, strict=True)):
                    a.send("ps_serve", config={
                        "shard": i, "num_shards": n, "mode": "sync", "expected_workers": n,
                        "optimizer": "sgd", "optimizer_args": {"lr": _LR},
                        "heartbeat_timeout": 120.0, "bind": f"tcp://{ip}:0",
                        **_SERVED.get(name, {})})
                addrs = [text(a.read(_TIMEOUT), "address") for a in servers]
                served.append((name, addrs))
                listed: list[JSON] = list(addrs)
                self.systems[name].open([{"addresses": listed, "numel": numel, "rank": r,
                                          **_VARIANTS.get(name, {})} for r in range(n)])
                running.append(self.systems[name])
            if "gloo" in self.systems:
                running.append(self.systems["gloo"])
            return _measure(running, numel, cfg)
        finally:
            for s in running:
                if s.name != "gloo":
                    s.close()
            for name, addrs in served:  # stopped from a worker host: they reach the shards
                self.systems[name].workers[0].call("ps_stop", 60.0, addresses=addrs)
                for a in self.servers[name][0]:
                    a.read(_TIMEOUT)

    def close(self) -> None:
        try:
            if self.raw_addrs and "raw" in self.systems:
                self.systems["raw"].workers[0].call("raw_stop", 60.0,
                                                    addresses=self.raw_addrs, timeout_ms=5000)
            if "gloo" in self.systems:
                self.systems["gloo"].close()
        finally:
            close_all(self.agents)


def _rows(n: int, nbytes: int, bits: int, rounds: dict[str, list[float]]) -> list[ClusterRow]:
    wire, ring = limits(n, nbytes, bits)
    gloo = rounds.get("gloo")
    return [ClusterRow(n, None if name == "gloo" else n, nbytes, name, Stats.of(r), tuple(r),
                       wire, ring,
                       None if gloo is None or name == "gloo"
                       else Stats.of([a / b for a, b in zip(r, gloo, strict=True)]))
            for name, r in rounds.items()]


def run_cluster(sizes: Sequence[int] = DEFAULT_SIZES,
                workers: Sequence[int] = DEFAULT_WORKERS, rate: str = DEFAULT_RATE,
                systems: Sequence[str] = SYSTEMS, repeats: int = 5,
                repeat_seconds: float = 0.25, log_dir: Path | None = None,
                on_row: Callable[[ClusterRow], None] | None = None) -> ClusterResult:
    """Every system for every (N, size) on N worker and N server hosts at ``rate``.

    Returns a result ``skipped`` (and why) where namespaces cannot be made.
    """
    bits = parse_rate(rate)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"cluster systems are among {', '.join(SYSTEMS)}; got {sorted(unknown)}")
    problem = netns_problem()
    if problem:
        return ClusterResult(skipped=problem, rate=rate)
    cfg = SweepConfig(cells=[], repeats=repeats, repeat_seconds=repeat_seconds)
    rows: list[ClusterRow] = []
    try:
        for n in workers:
            # gloo with one rank reduces nothing
            here = [s for s in systems if s != "gloo" or n > 1]
            with emulated_cluster(n, n, rate) as c:
                world = _World(c, n, here, log_dir)
                try:
                    for nbytes in sizes:
                        for row in _rows(n, nbytes, bits, world.cell(nbytes, cfg)):
                            rows.append(row)
                            if on_row is not None:
                                on_row(row)
                finally:
                    world.close()
    except NetnsUnavailable as exc:
        return ClusterResult(skipped=str(exc), rate=rate)
    return ClusterResult(None, rate, tuple(rows))

