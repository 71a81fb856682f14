"""The side-by-side sweep: raw ZeroMQ (the limit), this project, torch RPC, gloo, Ray.

For every cell (workers N, shards S, payload P) the systems compared are alive
at the same time and their repeats are interleaved (raw, ps, gloo, then again
in a rotated order), so a change in machine load hits them alike and each
repeat gives a *paired* ratio to the limit. A round is one worker pushing P
bytes of float32 gradient and getting P bytes of weights back (gloo: one
all_reduce of P bytes plus the optimizer step); GB/s counts the 2 x P x N
bytes of a round. torch RPC and gloo do not shard: they are measured once per
(N, P), with the first S that has P. TensorPipe polls while idle (about a
fifth of a core per process here), so torch RPC runs in a phase of its own,
interleaved with a raw loop of its own. Ray's actor parameter server is measured
like gloo, beside raw and this project, once per (N, P); its cluster (a head
agent and the actor) lives for a whole N.

Processes are agents (:mod:`paramserver.benchmarks.agent`) kept for a whole (N, S) group:
a shard server agent runs a fresh ShardServer per payload. A :class:`Placement`
puts the shard agents and the worker agents of raw and this project elsewhere
(another network namespace: :mod:`paramserver.benchmarks.hosts`); the sweep then
stops the shards through a worker agent, the one side that can reach them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from paramserver.core.sharding import ShardPlan
from paramserver.errors import RequestTimeoutError
from paramserver.util.jsontypes import JSONObject
from paramserver.workers.admin import shutdown_servers

from . import raw
from .common import (
    Agent,
    AgentError,
    Stats,
    close_all,
    cpu_seconds,
    descendants,
    free_port,
    integer,
    number,
    obj,
    text,
)
from .records import ShmPath, SweepRow

__all__ = ["SYSTEMS", "Cell", "PSVariant", "Placement", "SweepConfig", "run_sweep"]

log = logging.getLogger(__name__)

SYSTEMS: tuple[str, ...] = ("raw", "ps", "rpc", "gloo", "ray")
#: systems that do not shard: one row per (workers, payload)
UNSHARDED = ("rpc", "gloo", "ray")
_TIMEOUT = 600.0


@dataclass(frozen=True)
class Cell:
    workers: int
    shards: int
    nbytes: int


@dataclass(frozen=True)
class PSVariant:
    """A configuration of this project measured as its own row."""

    label: str
    # free-form overrides, passed on as they are: PSSession args (e.g. wire_dtype), and
    # ServerConfig fields (e.g. {"watchdog": {"enabled": false}})
    session: JSONObject = field(default_factory=dict)
    server: JSONObject = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where the shard and worker agents run and the address shards bind (default:
    all on this host, over loopback)."""

    server_prefix: tuple[str, ...] = ()  # e.g. ("ip", "netns", "exec", "nsA")
    worker_prefix: tuple[str, ...] = ()
    server_host: str = "127.0.0.1"

    @property
    def local(self) -> bool:
        return not self.server_prefix and not self.worker_prefix


@dataclass
class SweepConfig:
    cells: list[Cell]
    systems: tuple[str, ...] = SYSTEMS
    variants: list[PSVariant] = field(default_factory=lambda: [PSVariant("ps")])
    repeats: int = 5
    repeat_seconds: float = 0.25  # each repeat runs about this long (iterations adapt)
    max_iters: int = 2000
    lr: float = 1e-3
    chunk_bytes: int = ShardPlan.DEFAULT_CHUNK_BYTES
    log_dir: Path | None = None
    placement: Placement = field(default_factory=Placement)


def _groups(cells: Iterable[Cell]) -> dict[int, dict[int, list[int]]]:
    """workers -> shards -> sorted payload sizes."""
    out: dict[int, dict[int, list[int]]] = {}
    for c in cells:
        sizes = out.setdefault(c.workers, {}).setdefault(c.shards, [])
        if c.nbytes not in sizes:
            sizes.append(c.nbytes)
    for by_shards in out.values():
        for sizes in by_shards.values():
            sizes.sort()
    return {n: dict(sorted(v.items())) for n, v in sorted(out.items())}


def _broadcast(agents: Sequence[Agent], op: str, args: Sequence[JSONObject] | JSONObject,
               timeout: float = _TIMEOUT) -> list[JSONObject]:
    """Send one command to every agent, then read every answer (they run together)."""
    per_agent = list(args) if isinstance(args, Sequence) else [args] * len(agents)
    for agent, a in zip(agents, per_agent, strict=True):
        agent.send(op, **a)
    return [agent.read(timeout) for agent in agents]


class _System:
    """The worker-side agents of one system, measured together."""

    def __init__(self, name: str, workers: list[Agent], session: str,
                 members: list[Agent] | None = None, servers: Sequence[Agent] = ()) -> None:
        self.name, self.workers, self.session = name, workers, session
        self.members = members if members is not None else workers  # all to close
        # every process doing this system's work, for its CPU time per round
        self.pids = [a.pid for a in self.members] + [a.pid for a in servers]
        self.cpu_per_round: list[float] = []

    def open(self, args: Sequence[JSONObject]) -> None:
        _broadcast(self.workers, "open", [{"system": self.session, **a} for a in args])

    def measure(self, numel: int, iters: int) -> float:
        cpu0 = cpu_seconds(self.pids)
        res = _broadcast(self.workers, "measure",
                         {"system": self.session, "numel": numel, "iters": iters})
        self.cpu_per_round.append((cpu_seconds(self.pids) - cpu0) / iters)
        return max(number(r, "round_s") for r in res)  # the round ends when the slowest has it

    def close(self) -> list[JSONObject]:
        return _broadcast(self.members, "close", {"system": self.session})


def _iters_for(round_s: float, cfg: SweepConfig) -> int:
    return int(min(cfg.max_iters, max(1, round(cfg.repeat_seconds / max(round_s, 1e-6)))))


def _measure(systems: Sequence[_System], numel: int, cfg: SweepConfig) -> dict[str, list[float]]:
    """Warm up, then interleave ``cfg.repeats`` repeats of every system."""
    iters: dict[str, int] = {}
    for s in systems:
        s.measure(numel, 2)  # first rounds: connections, page faults, lazy allocations
        iters[s.name] = _iters_for(s.measure(numel, 2), cfg)
    rounds: dict[str, list[float]] = {s.name: [] for s in systems}
    for s in systems:
        s.cpu_per_round.clear()
    for r in range(cfg.repeats):
        k = r % len(systems)
        for s in list(systems[k:]) + list(systems[:k]):
            rounds[s.name].append(s.measure(numel, iters[s.name]))
    return rounds


def _record(cell: Cell, system: str, rounds: list[float], limit: list[float] | None,
            cpu: list[float], shm: ShmPath | None = None) -> SweepRow:
    moved = 2 * cell.nbytes * cell.workers
    return SweepRow(
        # torch RPC has one server and gloo none: no shards to speak of
        cell.workers, None if system in UNSHARDED else cell.shards, cell.nbytes, system,
        Stats.of(rounds), Stats.of([moved / t / 1e9 for t in rounds]), tuple(rounds),
        # CPU seconds per round of all its processes (workers and servers): what a
        # round costs, whatever else the machine was doing
        Stats.of(cpu) if cpu else None, shm,
        # paired per repeat (they ran back to back): limit time / system time = throughput ratio
        Stats.of([a / b for a, b in zip(limit, rounds, strict=True)]) if limit else None)


class _Group:
    """The raw and project agents of one (N, S), kept across payloads."""

    def __init__(self, n: int, s: int, cfg: SweepConfig, with_ps: bool) -> None:
        self.n, self.s, self.cfg = n, s, cfg
        self.agents: list[Agent] = []
        self.raw_addrs: list[str] = []
        try:
            self.raw_servers = self._spawn("raw-server", s, server=True)
            for a in self.raw_servers:
                a.send("raw_serve", workers=n, lr=cfg.lr, host=cfg.placement.server_host)
            self.raw_addrs = [text(a.read(_TIMEOUT), "address") for a in self.raw_servers]
            self.raw = _System("raw", self._spawn("raw-worker", n), "raw",
                               servers=self.raw_servers)
            self.ps: list[tuple[PSVariant, list[Agent], _System]] = []
            for v in cfg.variants if with_ps else []:
                servers = self._spawn(f"{v.label}-server", s, server=True)
                self.ps.append((v, servers, _System(v.label, self._spawn(f"{v.label}-worker", n),
                                                    "ps", servers=servers)))
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, count: int, server: bool = False) -> list[Agent]:
        where = self.cfg.placement
        prefix = where.server_prefix if server else where.worker_prefix
        agents = [Agent(f"{name}{i}-n{self.n}s{self.s}", self.cfg.log_dir, prefix)
                  for i in range(count)]
        self.agents += agents
        return agents

    def _stop(self, op: str, addresses: list[str], via: _System | None) -> None:
        """Stop shards: from here when they listen on this host's loopback, else
        through a worker agent of ``via``, beside the workers that reach them (with
        none, the shard agents are killed when the group closes)."""
        if self.cfg.placement.local:
            if op == "raw_stop":
                raw.stop(addresses, timeout_ms=5000)
            else:
                shutdown_servers(addresses)
        elif via is not None:
            via.workers[0].call(op, 60.0, addresses=addresses, timeout_ms=5000)

    def cell(self, nbytes: int, peers: list[_System]) -> list[SweepRow]:
        n, s, cfg, numel = self.n, self.s, self.cfg, nbytes // 4
        self.raw.open([{"addresses": list(self.raw_addrs), "numel": numel,
                        "chunk_bytes": cfg.chunk_bytes}] * n)
        systems = [self.raw]
        ps_addrs: list[str] = []
        for v, servers, system in self.ps:
            bind = ({} if cfg.placement.local
                    else {"bind": f"tcp://{cfg.placement.server_host}:0"})
            for i, a in enumerate(servers):
                a.send("ps_serve", config={
                    "shard": i, "num_shards": s, "mode": "sync", "expected_workers": n,
                    "optimizer": "sgd", "optimizer_args": {"lr": cfg.lr},
                    "heartbeat_timeout": 60.0, **bind, **v.server})
            addrs = [text(a.read(_TIMEOUT), "address") for a in servers]
            ps_addrs += addrs
            system.open([{"addresses": list(addrs), "numel": numel, "rank": r,
                          "chunk_bytes": cfg.chunk_bytes, **v.session} for r in range(n)])
            systems.append(system)
        rounds = _measure(systems + peers, numel, cfg)
        closed = {system.name: system.close() for system in systems}
        shm: dict[str, ShmPath] = {}
        if self.ps:
            self._stop("ps_stop", ps_addrs, self.ps[0][2])
        for v, servers, _ in self.ps:
            served = [a.read(_TIMEOUT) for a in servers]
            # the path the tensors took: shards that granted shared memory, and the
            # workers' side of it (a shard grants it only to a same-host worker)
            shm[v.label] = ShmPath(
                sum(integer(obj(r, "counters", {}), "shm_peers", 0) for r in served),
                sum(integer(r, "shm_used", 0) for r in closed[v.label]),
                sum(integer(r, "shm_offered", 0) for r in closed[v.label]))
        cpu = {x.name: x.cpu_per_round for x in systems + peers}
        cell = Cell(n, s, nbytes)
        return [_record(cell, name, r, rounds["raw"] if name != "raw" else None, cpu[name],
                        shm.get(name)) for name, r in rounds.items()]

    def close(self) -> None:
        try:
            if self.raw_addrs:
                addrs, self.raw_addrs = self.raw_addrs, []
                self._stop("raw_stop", addrs, getattr(self, "raw", None))
        finally:
            close_all(self.agents)


def _open_world(kind: str, n: int, sizes: list[int], cfg: SweepConfig
                ) -> tuple[_System, list[Agent]]:
    """Start the N (+1 server for RPC) processes of a torch.distributed world."""
    port = free_port()
    ranks = n + 1 if kind == "rpc" else n
    agents = [Agent(f"{kind}{r}-n{n}", cfg.log_dir) for r in range(ranks)]
    try:
        _broadcast(agents, "open", [
            {"system": kind, "rank": r, "world": ranks, "port": port,
             "sizes": [b // 4 for b in sizes], "lr": cfg.lr} for r in range(ranks)])
    except BaseException:
        close_all(agents)
        raise
    measured = agents[1:] if kind == "rpc" else agents  # rank 0 of RPC only serves
    return _System(kind, measured, kind, members=agents), agents


def _open_ray(n: int, cfg: SweepConfig) -> tuple[_System, list[Agent]]:
    """A Ray head agent with the actor, and N worker agents connected to it."""
    head = Agent(f"ray-head-n{n}", cfg.log_dir)
    agents = [head]
    try:
        address = text(head.call("ray_serve", _TIMEOUT, workers=n, lr=cfg.lr), "address")
        agents += [Agent(f"ray-worker{r}-n{n}", cfg.log_dir) for r in range(n)]
        system = _System("ray", agents[1:], "ray", members=agents[1:], servers=[head])
        system.open([{"address": address}] * n)
        # the CPU of a round includes Ray's own processes: raylet, GCS, the actor's worker
        system.pids = [a.pid for a in agents[1:]] + descendants(head.pid)
    except BaseException:
        close_all(agents)
        raise
    return system, agents


def _close_world(world: _System, agents: list[Agent]) -> None:
    try:
        world.close()
    finally:
        if world.name == "ray":  # the head stops its cluster before it exits (not killed)
            with contextlib.suppress(AgentError, RequestTimeoutError):
                agents[0].call("ray_stop", 60.0)
        close_all(agents)


def run_sweep(cfg: SweepConfig, on_row: Callable[[SweepRow], None] | None = None
              ) -> list[SweepRow]:
    """Measure every cell; returns one record per (cell, system)."""
    unknown = set(cfg.systems) - set(SYSTEMS)
    if unknown or "raw" not in cfg.systems:
        raise ValueError(f"systems must include raw and be among {SYSTEMS}; got {cfg.systems}")
    records: list[SweepRow] = []

    def emit(recs: list[SweepRow]) -> None:
        for rec in recs:
            records.append(rec)
            if on_row is not None:
                on_row(rec)

    for n, by_shards in _groups(cfg.cells).items():
        # gloo with one process reduces nothing: it is compared from two workers on
        worlds: list[tuple[_System, list[Agent]]] = []
        try:
            if "gloo" in cfg.systems and n > 1:
                worlds.append(_open_world("gloo", n, [], cfg))
            if "ray" in cfg.systems:
                worlds.append(_open_ray(n, cfg))
            seen: set[int] = set()
            for s, sizes in by_shards.items():
                group = _Group(n, s, cfg, with_ps="ps" in cfg.systems)
                try:
                    for nbytes in sizes:
                        peers = [w[0] for w in worlds] if nbytes not in seen else []
                        seen.add(nbytes)
                        emit(group.cell(nbytes, peers))
                finally:
                    group.close()
        finally:
            for world in worlds:
                _close_world(*world)
        if "rpc" in cfg.systems:
            first = {b: s for s, sizes in reversed(by_shards.items()) for b in sizes}
            rpc = _open_world("rpc", n, sorted(first), cfg)
            try:
                for s in sorted(set(first.values())):
                    group = _Group(n, s, cfg, with_ps=False)
                    try:
                        for nbytes in sorted(b for b, fs in first.items() if fs == s):
                            emit([r for r in group.cell(nbytes, [rpc[0]])
                                  if r.system == "rpc"])
                    finally:
                        group.close()
            finally:
                _close_world(*rpc)
    return records
