"""The cost of replicated shards (issue 32): push + pull with and without a backup,
and the failover time.

``paramserver bench --part replication`` runs it. This process is the worker, and
three agent processes serve: a shard without replicas, and a primary with its
backup (``--replicas 1``). For each payload (1 KiB and 100 MiB; quick: 1 KiB and
64 KiB) three sessions push and pull, one round at a time, in async mode: the
shard without replicas (through same-host shared memory where the payload takes
it), the same shard over TCP, and the replicated shard (TCP: a backup turns shared
memory off). Their repeats are interleaved, so each repeat gives a *paired* ratio
(time with the backup / time without, and / time over TCP: the forward's own cost).

The failover time: after a few rounds (async, a 256 KiB model, through shared
memory where the host allows it) this process
SIGKILLs the primary, between two rounds, and times from the kill to the end of
the first round the new primary acknowledges, with the given
``--failover-timeout`` (default: the server's). That first round pushes a zero
gradient, and its weights must come back bit-identical to those before the kill.
Each kill has a fresh primary; the backup's agent serves every trial.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from paramserver.server.config import ServerConfig
from paramserver.util.jsontypes import JSON, JSONObject
from paramserver.workers.admin import shutdown_servers
from paramserver.workers.failover import ask_roles, primary_of

from .common import Agent, Stats, close_all, format_size, integer, number, numbers, text

__all__ = ["DEFAULT_SIZES", "CostRow", "FailoverResult", "ReplicationResult",
           "run_replication"]

log = logging.getLogger(__name__)

_KIB, _MIB = 1 << 10, 1 << 20
DEFAULT_SIZES: tuple[int, ...] = (_KIB, 100 * _MIB)
QUICK_SIZES: tuple[int, ...] = (_KIB, 64 * _KIB)
_TIMEOUT = 600.0


def _obj(value: JSON) -> JSONObject:
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")
    return value


@dataclass(frozen=True)
class CostRow:
    """One payload's push + pull round trip without replicas and with one backup."""

    bytes: int
    without: Stats  # round trip seconds, no replicas (shared memory where possible)
    tcp: Stats  # no replicas, over TCP
    with_replica: Stats  # --replicas 1 (TCP: a backup turns shared memory off)
    ratio: Stats  # paired per repeat: with_replica / without
    ratio_tcp: Stats  # paired per repeat: with_replica / tcp
    shm_used: bool  # whether the row without replicas moved tensors through shared memory
    # each repeat's seconds per round, in the order they ran: without, tcp, with_replica
    repeats: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]

    replica_shm_used: bool = False  # the same, for the row with a backup

    @classmethod
    def of(cls, nbytes: int, without: list[float], tcp: list[float], with_replica: list[float],
           shm_used: bool, replica_shm_used: bool) -> CostRow:
        return cls(nbytes, Stats.of(without), Stats.of(tcp), Stats.of(with_replica),
                   Stats.of([a / b for a, b in zip(with_replica, without, strict=True)]),
                   Stats.of([a / b for a, b in zip(with_replica, tcp, strict=True)]),
                   shm_used, (tuple(without), tuple(tcp), tuple(with_replica)),
                   replica_shm_used)

    def to_json(self) -> JSONObject:
        return {"bytes": self.bytes, "without": self.without.to_json(),
                "tcp": self.tcp.to_json(), "with_replica": self.with_replica.to_json(),
                "ratio": self.ratio.to_json(), "ratio_tcp": self.ratio_tcp.to_json(),
                "shm_used": self.shm_used, "replica_shm_used": self.replica_shm_used,
                "repeats_round_s": {"without": list(self.repeats[0]),
                                    "tcp": list(self.repeats[1]),
                                    "with_replica": list(self.repeats[2])}}

    @classmethod
    def from_json(cls, value: JSON) -> CostRow:
        d = _obj(value)
        reps = _obj(d["repeats_round_s"])
        return cls(integer(d, "bytes"), Stats.from_json(d["without"]),
                   Stats.from_json(d["tcp"]), Stats.from_json(d["with_replica"]),
                   Stats.from_json(d["ratio"]), Stats.from_json(d["ratio_tcp"]),
                   d.get("shm_used") is True,
                   (tuple(numbers(reps, "without")), tuple(numbers(reps, "tcp")),
                    tuple(numbers(reps, "with_replica"))), d.get("replica_shm_used") is True)


@dataclass(frozen=True)
class FailoverResult:
    """Seconds from each SIGKILL of a primary to the first round its backup acknowledged."""

    seconds: tuple[float, ...]
    failover_timeout: float
    moves: int  # times the worker moved to a new primary (one per kill)
    shm_used: bool = False  # the worker pushed through shared memory before each kill

    @property
    def median(self) -> float:
        return Stats.of(self.seconds).median

    @property
    def max(self) -> float:
        return max(self.seconds)

    def to_json(self) -> JSONObject:
        return {"seconds": list(self.seconds), "median": self.median, "max": self.max,
                "failover_timeout": self.failover_timeout, "moves": self.moves,
                "shm_used": self.shm_used}

    @classmethod
    def from_json(cls, value: JSON) -> FailoverResult:
        d = _obj(value)
        raw = d.get("seconds")
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"failover seconds must be a non-empty list, got {raw!r}")
        return cls(tuple(number({"s": s}, "s") for s in raw), number(d, "failover_timeout"),
                   integer(d, "moves"), d.get("shm_used") is True)


@dataclass(frozen=True)
class ReplicationResult:
    """The replication part: a cost row per payload and the failover times."""

    costs: tuple[CostRow, ...]
    failover: FailoverResult | None
    repeats: int

    def to_json(self) -> JSONObject:
        return {"costs": [c.to_json() for c in self.costs], "repeats": self.repeats,
                "failover": None if self.failover is None else self.failover.to_json()}

    @classmethod
    def from_json(cls, value: JSON) -> ReplicationResult:
        d = _obj(value)
        costs = d.get("costs") or []
        if not isinstance(costs, list):
            raise ValueError("replication costs: expected a list")
        fo = d.get("failover")
        return cls(tuple(CostRow.from_json(c) for c in costs),
                   None if fo is None else FailoverResult.from_json(fo), integer(d, "repeats"))

    def row(self, nbytes: int) -> CostRow | None:
        return next((c for c in self.costs if c.bytes == nbytes), None)


def _shard_config(workers: int, mode: str, failover_timeout: float | None) -> JSONObject:
    cfg: JSONObject = {"shard": 0, "num_shards": 1, "mode": mode, "expected_workers": workers,
                       "optimizer": "sgd", "optimizer_args": {"lr": 1e-3},
                       "heartbeat_timeout": 60.0}
    if failover_timeout is not None:
        cfg["failover_timeout"] = failover_timeout
    return cfg


def _serve_pair(primary: Agent, backup: Agent, base: JSONObject) -> str:
    """A primary and its backup serving ``base``; the worker's address entry (P|B). They
    share a replication key of their own, as a launched run's replicas do (the agents
    run on this host: the file is theirs to read)."""
    from paramserver.wire.replauth import make_key_file

    folder = Path(tempfile.mkdtemp(prefix="paramserver-bench-replication-"))
    try:  # a replica reads its key once, as it starts: gone with the folder after
        base = {**base, "replication_key": str(make_key_file(folder / "replication.key"))}
        backup.send("ps_serve", config={**base, "replicas": 1, "replica": 1})
        b = text(backup.read(_TIMEOUT), "address")
        primary.send("ps_serve", config={**base, "replicas": 1, "replica_peers": [b]})
        p = text(primary.read(_TIMEOUT), "address")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # a primary that fell silent while starting would have been replaced already, and
    # the row would measure a shard without a backup
    found = primary_of(ask_roles([p, b], timeout=5.0))
    if found != (p, 0):
        raise RuntimeError(f"the primary of {p}|{b} is {found}, not {p} at epoch 0")
    return f"{p}|{b}"


def _iters(round_s: float, repeat_seconds: float) -> int:
    return int(min(2000, max(1, round(repeat_seconds / max(round_s, 1e-6)))))


def _cost(nbytes: int, servers: list[Agent], repeats: int, repeat_seconds: float) -> CostRow:
    """One payload: the three sessions opened, warmed, measured interleaved, closed."""
    from .ps import PSSession

    plain, primary, backup = servers
    base = _shard_config(1, "async", None)
    # one shard without replicas serves both of its rows (rank 0 through shared memory
    # where it can, rank 1 over TCP): a round is one worker's, never both at once
    plain.send("ps_serve", config=base)
    addr = text(plain.read(_TIMEOUT), "address")
    entry = _serve_pair(primary, backup, base)
    numel = nbytes // 4
    sessions = {
        "ps": PSSession({"addresses": [addr], "numel": numel, "rank": 0}),
        "ps-tcp": PSSession({"addresses": [addr], "numel": numel, "rank": 1, "shm": False}),
        # its own rank: a worker's segment is named by its rank, and all three live here
        "ps-r1": PSSession({"addresses": [entry], "numel": numel, "rank": 2}),
    }
    rounds: dict[str, list[float]] = {name: [] for name in sessions}
    closed: dict[str, JSONObject] = {}
    try:
        iters = {}
        for name, s in sessions.items():
            s.measure(numel, 2)  # first rounds: connections, page faults, allocations
            iters[name] = _iters(s.measure(numel, 2), repeat_seconds)
        names = list(sessions)
        for r in range(repeats):  # rotated order: load drift hits every system alike
            k = r % len(names)
            for name in names[k:] + names[:k]:
                rounds[name].append(sessions[name].measure(numel, iters[name]))
    finally:
        for name, s in sessions.items():
            closed[name] = s.close()
        shutdown_servers([addr, *entry.split("|")])
        for a in servers:
            a.read(_TIMEOUT)
    return CostRow.of(nbytes, rounds["ps"], rounds["ps-tcp"], rounds["ps-r1"],
                      integer(closed["ps"], "shm_used", 0) > 0,
                      integer(closed["ps-r1"], "shm_used", 0) > 0)


def measure_failover(kills: int, failover_timeout: float | None, servers: list[Agent],
                     log_dir: Path | None, warmup: int = 20) -> FailoverResult:
    """``kills`` times: a primary with the backup (``servers``: idle agents, the backup's
    last; more are started as primaries die), rounds from this process, SIGKILL the
    primary between two rounds, time until the next round is acknowledged."""
    import torch

    from paramserver.workers.client import PSClient

    from .ps import flat_plan

    base = _shard_config(1, "async", failover_timeout)
    timeout = failover_timeout if failover_timeout is not None else ServerConfig().failover_timeout
    *spare, backup = servers
    seconds: list[float] = []
    moves = 0
    shm_used = True
    numel = 64 << 10  # 256 KiB: a same-host worker's tensors take shared memory
    for k in range(kills):
        if spare:
            primary = spare.pop()
        else:
            primary = Agent(f"repl-primary{k}", log_dir)
            servers.append(primary)  # (the caller closes them all)
        entry = _serve_pair(primary, backup, base)
        params = {"w": torch.zeros(numel)}
        grads = {"w": torch.full((numel,), 1e-3)}
        with PSClient([entry], flat_plan(numel, 1), 0, timeout=60.0) as client:
            clock = client.connect()
            client.initialize(params)
            versions = client.pull(params, clock).versions
            for _ in range(warmup):
                _, pulled = client.push_pull(grads, versions, 1, clock, params)
                versions, clock = pulled.versions, clock + 1
            link = client.channels[0].shm
            shm_used = shm_used and link is not None and link.active
            before = params["w"].clone()
            os.kill(primary.pid, signal.SIGKILL)
            t0 = time.monotonic()
            # a zero gradient: the new primary's weights must come back unchanged, bit
            # for bit, with the version one on (every push before the kill was held)
            pushed, pulled = client.push_pull({"w": torch.zeros(numel)}, versions, 1, clock,
                                              params)
            seconds.append(time.monotonic() - t0)
            if not (pushed.accepted and all(o.applied for o in pushed.outcomes)):
                raise RuntimeError("the first push after the failover was not applied")
            if pulled.versions != (versions[0] + 1,) or not torch.equal(params["w"], before):
                raise RuntimeError(f"the backup's weights differ from its primary's (versions "
                                   f"{versions} then {pulled.versions})")
            assert client.failover is not None
            moves += client.failover.moves
            client.bye()
        primary.popen.wait(10)
        shutdown_servers([entry.split("|")[1]])  # the backup, primary now
        backup.read(_TIMEOUT)
        log.info("failover %d: %.3f s", k, seconds[-1])
    return FailoverResult(tuple(seconds), timeout, moves, shm_used and bool(seconds))


def run_replication(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5,
                    repeat_seconds: float = 0.25, kills: int = 5,
                    failover_timeout: float | None = None, log_dir: Path | None = None,
                    on_row: Callable[[CostRow], None] | None = None) -> ReplicationResult:
    """Measure each payload's cost of one backup, then ``kills`` failovers. This process
    is the worker; three agents serve (without replicas, the primary, its backup)."""
    servers = [Agent(f"repl-{n}", log_dir) for n in ("plain", "primary", "backup")]
    rows: list[CostRow] = []
    try:
        for nbytes in sizes:
            log.info("replication cost at %s", format_size(nbytes))
            row = _cost(nbytes, servers, repeats, repeat_seconds)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        failover = (measure_failover(kills, failover_timeout, servers, log_dir)
                    if kills else None)
    finally:
        close_all(servers)
    return ReplicationResult(tuple(rows), failover, repeats)
