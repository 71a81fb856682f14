"""The records of ``result.json``: one frozen dataclass per kind of row, written by
``to_json`` and read back by ``from_json`` with the same keys (reports, the docs'
tables and tests read the file). :class:`BenchResult` is the whole file.

A child process's answer arrives as open JSON (benchmarks/agent.py); each record is
made from it here, once, so that the report reads attributes, never keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from paramserver.util.jsontypes import JSON, JSONObject

from .common import Stats, integer, number, numbers, text
from .netns import Link as VethLink
from .replication import ReplicationResult
from .reshard import ReshardRow

__all__ = ["AsyncRow", "BenchResult", "ClusterAsyncRow", "ClusterResult", "ClusterRow",
           "Environment", "Goal", "HostsResult", "MemoryRow", "OverlapResult", "ShmPath",
           "SweepRow"]


def _obj(value: JSON) -> JSONObject:
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")
    return value


def _opt_stats(d: JSONObject, key: str) -> Stats | None:
    value = d.get(key)
    return None if value is None else Stats.from_json(value)


def _opt_int(d: JSONObject, key: str) -> int | None:
    return None if d.get(key) is None else integer(d, key)


def _opt_num(d: JSONObject, key: str) -> float | None:
    return None if d.get(key) is None else number(d, key)


def _nums(d: JSONObject, key: str) -> tuple[float, ...]:
    return tuple(numbers(d, key))


# ---------------------------------------------------------------- the sweep

@dataclass(frozen=True)
class ShmPath:
    """The path a variant's tensors took: shards that granted shared memory, and
    the workers that used or were offered it (a shard grants it to same-host workers)."""

    shm_peers: int
    shm_used: int
    shm_offered: int


@dataclass(frozen=True)
class SweepRow:
    """One (cell, system) of the sweep: round trips, throughput, CPU per round."""

    workers: int
    shards: int | None  # None: torch RPC (one server) and gloo (none) have no shards
    bytes: int
    system: str
    round_s: Stats
    gbps: Stats
    repeats_round_s: tuple[float, ...]
    cpu_s: Stats | None  # CPU seconds per round of all its processes
    shm: ShmPath | None = None  # this project's variants only
    # paired per repeat with the raw loop: limit time / system time (None for raw)
    ratio_to_limit: Stats | None = None

    @property
    def used_shm(self) -> bool:
        return self.shm is not None and bool(self.shm.shm_peers or self.shm.shm_used)

    def to_json(self) -> JSONObject:
        out: JSONObject = {
            "workers": self.workers, "shards": self.shards, "bytes": self.bytes,
            "system": self.system, "round_s": self.round_s.to_json(),
            "gbps": self.gbps.to_json(), "repeats_round_s": list(self.repeats_round_s),
            "cpu_s": None if self.cpu_s is None else self.cpu_s.to_json()}
        if self.shm is not None:
            out.update({"shm_peers": self.shm.shm_peers, "shm_used": self.shm.shm_used,
                        "shm_offered": self.shm.shm_offered})
        if self.ratio_to_limit is not None:
            out["ratio_to_limit"] = self.ratio_to_limit.to_json()
        return out

    @classmethod
    def from_json(cls, value: JSON) -> SweepRow:
        d = _obj(value)
        shm = (ShmPath(integer(d, "shm_peers"), integer(d, "shm_used"), integer(d, "shm_offered"))
               if "shm_peers" in d else None)
        return cls(integer(d, "workers"), _opt_int(d, "shards"), integer(d, "bytes"),
                   text(d, "system"), Stats.from_json(d["round_s"]),
                   Stats.from_json(d["gbps"]), _nums(d, "repeats_round_s"),
                   _opt_stats(d, "cpu_s"), shm, _opt_stats(d, "ratio_to_limit"))


def find(rows: Sequence[SweepRow], system: str, workers: int, nbytes: int,
         shards: int | None = None) -> SweepRow | None:
    """The first row of ``system`` for (workers, payload), and ``shards`` where given."""
    for r in rows:
        if (r.system, r.workers, r.bytes) == (system, workers, nbytes) and (
                shards is None or r.shards == shards):
            return r
    return None


@dataclass(frozen=True)
class Link(VethLink):
    """The two namespaces of the across-hosts part (netns.Link) and the transport used."""

    transport: Literal["tcp", "shared memory"]

    def to_json(self) -> JSONObject:
        return {"ns_a": self.ns_a, "ip_a": self.ip_a, "ns_b": self.ns_b, "ip_b": self.ip_b,
                "kind": "veth", "transport": self.transport}

    @classmethod
    def from_json(cls, value: JSON) -> Link:
        d = _obj(value)
        transport = text(d, "transport")
        if transport not in ("tcp", "shared memory"):
            raise ValueError(f"transport {transport!r}")
        return cls(text(d, "ns_a"), text(d, "ip_a"), text(d, "ns_b"), text(d, "ip_b"),
                   "tcp" if transport == "tcp" else "shared memory")


@dataclass(frozen=True)
class HostsResult:
    """The across-hosts part: skipped (and why), or its link, rows and problems (a row
    of this project that moved tensors through shared memory)."""

    skipped: str | None = None
    link: Link | None = None
    rows: tuple[SweepRow, ...] = ()
    problems: tuple[str, ...] = ()

    def to_json(self) -> JSONObject:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        return {"link": None if self.link is None else self.link.to_json(),
                "rows": [r.to_json() for r in self.rows], "problems": list(self.problems)}

    @classmethod
    def from_json(cls, value: JSON) -> HostsResult:
        d = _obj(value)
        if "skipped" in d:
            return cls(skipped=text(d, "skipped"))
        rows = d.get("rows") or []
        problems = d.get("problems") or []
        assert isinstance(rows, list) and isinstance(problems, list)
        return cls(None, None if d.get("link") is None else Link.from_json(d["link"]),
                   tuple(SweepRow.from_json(r) for r in rows),
                   tuple(str(p) for p in problems))


# ---------------------------------------------------------------- async, memory, overlap

@dataclass(frozen=True)
class AsyncRow:
    """Updates applied per second in async mode, and CPU per model update."""

    workers: int
    shards: int | None  # None: Ray's one actor
    bytes: int
    tensors: int
    system: str
    model_updates_per_s: float
    shard_updates_per_s: float
    cpu_s_per_model_update: float
    worker_pushes_per_s: tuple[float, ...]
    window_s: float
    # the shards' part of the CPU, and the share of a core each used (None for Ray)
    shard_cpu_s_per_model_update: float | None = None
    shard_busy: float | None = None

    def to_json(self) -> JSONObject:
        out: JSONObject = {
            "workers": self.workers, "shards": self.shards, "bytes": self.bytes,
            "tensors": self.tensors, "system": self.system,
            "model_updates_per_s": self.model_updates_per_s,
            "shard_updates_per_s": self.shard_updates_per_s,
            "cpu_s_per_model_update": self.cpu_s_per_model_update}
        if self.shard_cpu_s_per_model_update is not None:
            out["shard_cpu_s_per_model_update"] = self.shard_cpu_s_per_model_update
        if self.shard_busy is not None:
            out["shard_busy"] = self.shard_busy
        out["worker_pushes_per_s"] = list(self.worker_pushes_per_s)
        out["window_s"] = self.window_s
        return out

    @classmethod
    def from_json(cls, value: JSON) -> AsyncRow:
        d = _obj(value)
        return cls(integer(d, "workers"), _opt_int(d, "shards"), integer(d, "bytes"),
                   integer(d, "tensors"), text(d, "system", "ps"),
                   number(d, "model_updates_per_s"), number(d, "shard_updates_per_s"),
                   number(d, "cpu_s_per_model_update"), _nums(d, "worker_pushes_per_s"),
                   number(d, "window_s"), _opt_num(d, "shard_cpu_s_per_model_update"),
                   _opt_num(d, "shard_busy"))


@dataclass(frozen=True)
class MemoryRow:
    """One sync shard's peak RSS over its start with N workers, and the budget
    (weights + optimizer state + one aggregation buffer)."""

    workers: int
    bytes: int
    momentum: float
    weight_bytes: int
    optimizer_state_bytes: int
    aggregation_bytes: int
    expected_bytes: int
    rss_base: int
    peak_rss: int
    peak_over_base: int
    ratio: float
    copy_on_write: int
    shm_peers: int
    shm_release: bool | None  # None: the shard's default

    def to_json(self) -> JSONObject:
        return {"workers": self.workers, "bytes": self.bytes, "momentum": self.momentum,
                "weight_bytes": self.weight_bytes,
                "optimizer_state_bytes": self.optimizer_state_bytes,
                "aggregation_bytes": self.aggregation_bytes,
                "expected_bytes": self.expected_bytes, "rss_base": self.rss_base,
                "peak_rss": self.peak_rss, "peak_over_base": self.peak_over_base,
                "ratio": self.ratio, "copy_on_write": self.copy_on_write,
                "shm_peers": self.shm_peers, "shm_release": self.shm_release}

    @classmethod
    def from_json(cls, value: JSON) -> MemoryRow:
        d = _obj(value)
        release = d.get("shm_release")
        return cls(integer(d, "workers"), integer(d, "bytes"), number(d, "momentum"),
                   integer(d, "weight_bytes"), integer(d, "optimizer_state_bytes"),
                   integer(d, "aggregation_bytes"), integer(d, "expected_bytes"),
                   integer(d, "rss_base"), integer(d, "peak_rss"), integer(d, "peak_over_base"),
                   number(d, "ratio"), integer(d, "copy_on_write"), integer(d, "shm_peers"),
                   release if isinstance(release, bool) else None)


_OVERLAP_INTS = ("model_bytes", "params", "width", "depth", "batch", "rounds_ahead",
                 "ahead_found_busy", "early_parts", "early_answers", "buckets")
_OVERLAP_STATS = ("overlap", "compute", "comm", "sequential")


@dataclass(frozen=True)
class OverlapResult:
    """benchmarks/overlap.py's step times: compute, communication, both in sequence and
    overlapped (and, over TCP, overlapped without early weights)."""

    device: str
    model_bytes: int
    params: int
    width: int
    depth: int
    batch: int
    overlap: Stats
    compute: Stats
    comm: Stats
    sequential: Stats
    tcp: bool
    rounds_ahead: int
    ahead_found_busy: int
    early_parts: int
    early_answers: int
    buckets: int
    overlap_vs_bound: float
    sequential_vs_bound: float
    gain: float
    overlap_late: Stats | None = None  # over TCP only
    early_gain: float | None = None  # over TCP only

    def to_json(self) -> JSONObject:
        out: JSONObject = {"device": self.device}
        out.update({k: getattr(self, k) for k in _OVERLAP_INTS[:5]})
        out["overlap"] = self.overlap.to_json()
        if self.overlap_late is not None:
            out["overlap_late"] = self.overlap_late.to_json()
        out.update({k: getattr(self, k).to_json() for k in _OVERLAP_STATS[1:]})
        out["tcp"] = self.tcp
        out.update({k: getattr(self, k) for k in _OVERLAP_INTS[5:]})
        out.update({"overlap_vs_bound": self.overlap_vs_bound,
                    "sequential_vs_bound": self.sequential_vs_bound, "gain": self.gain})
        if self.early_gain is not None:
            out["early_gain"] = self.early_gain
        return out

    @classmethod
    def from_json(cls, value: JSON) -> OverlapResult:
        d = _obj(value)
        return cls(
            text(d, "device"), integer(d, "model_bytes"), integer(d, "params"), integer(d, "width"),
            integer(d, "depth"), integer(d, "batch"), Stats.from_json(d["overlap"]),
            Stats.from_json(d["compute"]), Stats.from_json(d["comm"]),
            Stats.from_json(d["sequential"]), d["tcp"] is True, integer(d, "rounds_ahead"),
            integer(d, "ahead_found_busy"), integer(d, "early_parts"), integer(d, "early_answers"),
            integer(d, "buckets"), number(d, "overlap_vs_bound"), number(d, "sequential_vs_bound"),
            number(d, "gain"), _opt_stats(d, "overlap_late"), _opt_num(d, "early_gain"))


# ---------------------------------------------------------------- the whole result

class Row(Protocol):
    def to_json(self) -> JSONObject: ...


@dataclass(frozen=True)
class Goal:
    """One of the issue's goals: the measured value, the target, met / missed / n/a."""

    goal: str
    measured: float | None
    target: str
    status: Literal["met", "missed", "n/a"]
    detail: str = ""

    def to_json(self) -> JSONObject:
        return {"goal": self.goal, "measured": self.measured, "target": self.target,
                "status": self.status, "detail": self.detail}

    @classmethod
    def from_json(cls, value: JSON) -> Goal:
        d = _obj(value)
        status = text(d, "status")
        if status not in ("met", "missed", "n/a"):
            raise ValueError(f"goal status {status!r}")
        return cls(text(d, "goal"), _opt_num(d, "measured"), text(d, "target"),
                   "met" if status == "met" else "missed" if status == "missed" else "n/a",
                   text(d, "detail", ""))


@dataclass(frozen=True)
class Environment:
    """Versions and the machine the result was measured on."""

    python: str
    torch: str
    pyzmq: str
    libzmq: str
    numpy: str
    cpus: int | None
    machine: str
    load_before: tuple[float, ...]
    load_after: tuple[float, ...] | None = None

    def to_json(self) -> JSONObject:
        out: JSONObject = {"python": self.python, "torch": self.torch, "pyzmq": self.pyzmq,
                           "libzmq": self.libzmq, "numpy": self.numpy, "cpus": self.cpus,
                           "machine": self.machine, "load_before": list(self.load_before)}
        if self.load_after is not None:
            out["load_after"] = list(self.load_after)
        return out

    @classmethod
    def from_json(cls, value: JSON) -> Environment:
        d = _obj(value)
        return cls(text(d, "python"), text(d, "torch"), text(d, "pyzmq"), text(d, "libzmq"),
                   text(d, "numpy"), _opt_int(d, "cpus"), text(d, "machine"),
                   _nums(d, "load_before"),
                   None if d.get("load_after") is None else _nums(d, "load_after"))


# ---------------------------------------------------------------- across a cluster

@dataclass(frozen=True)
class ClusterRow:
    """One (N, M, system): its rounds, and the limits beside them."""

    workers: int
    shards: int | None  # None: gloo has none
    bytes: int
    system: str
    round_s: Stats
    repeats_round_s: tuple[float, ...]
    limit_s: float  # M/B
    ring_limit_s: float  # 2(N-1)/N · M/B
    vs_gloo: Stats | None  # paired per repeat: this round / gloo's (None for gloo)

    @property
    def vs_limit(self) -> float:
        """The median round over M/B."""
        return self.round_s.median / self.limit_s

    @property
    def vs_ring_limit(self) -> float:
        return self.round_s.median / self.ring_limit_s

    def to_json(self) -> JSONObject:
        return {"workers": self.workers, "shards": self.shards, "bytes": self.bytes,
                "system": self.system, "round_s": self.round_s.to_json(),
                "repeats_round_s": list(self.repeats_round_s), "limit_s": self.limit_s,
                "ring_limit_s": self.ring_limit_s, "vs_limit": self.vs_limit,
                "vs_ring_limit": self.vs_ring_limit,
                "vs_gloo": None if self.vs_gloo is None else self.vs_gloo.to_json()}

    @classmethod
    def from_json(cls, value: JSON) -> ClusterRow:
        if not isinstance(value, dict):
            raise ValueError(f"a cluster row is an object, not {value!r}")
        vs = value.get("vs_gloo")
        return cls(integer(value, "workers"),
                   None if value.get("shards") is None else integer(value, "shards"),
                   integer(value, "bytes"), text(value, "system"),
                   Stats.from_json(value["round_s"]), tuple(numbers(value, "repeats_round_s")),
                   number(value, "limit_s"), number(value, "ring_limit_s"),
                   None if vs is None else Stats.from_json(vs))


@dataclass(frozen=True)
class ClusterAsyncRow:
    """Async on N worker and N server hosts: every worker's pushes/s with every NIC fast
    and with worker host 0 at ``slow_bits``, window by window (benchmarks/clusterasync.py)."""

    workers: int
    bytes: int
    rate: str  # every other NIC's, as tc writes it
    slow_bits: int  # worker host 0's in the slow windows
    fast_per_worker: tuple[tuple[float, ...], ...]  # [repeat][worker] pushes/s
    slow_per_worker: tuple[tuple[float, ...], ...]
    others_vs_fast: Stats  # workers 1..N-1's mean pushes/s, slow window / fast, paired
    slow_vs_fast: Stats  # worker 0's own, slow / fast

    def to_json(self) -> JSONObject:
        return {"workers": self.workers, "bytes": self.bytes, "rate": self.rate,
                "slow_bits": self.slow_bits,
                "fast_per_worker": [list(r) for r in self.fast_per_worker],
                "slow_per_worker": [list(r) for r in self.slow_per_worker],
                "others_vs_fast": self.others_vs_fast.to_json(),
                "slow_vs_fast": self.slow_vs_fast.to_json()}

    @classmethod
    def from_json(cls, value: JSON) -> ClusterAsyncRow:
        d = _obj(value)

        def grid(key: str) -> tuple[tuple[float, ...], ...]:
            rows = d.get(key)
            if not isinstance(rows, list):
                raise ValueError(f"{key}: expected a list of lists")
            return tuple(tuple(numbers({"r": r}, "r")) for r in rows)

        return cls(integer(d, "workers"), integer(d, "bytes"), text(d, "rate"),
                   integer(d, "slow_bits"), grid("fast_per_worker"), grid("slow_per_worker"),
                   Stats.from_json(d["others_vs_fast"]), Stats.from_json(d["slow_vs_fast"]))


@dataclass(frozen=True)
class ClusterResult:
    """The cluster part (benchmarks/cluster.py): skipped (and why), or its NIC rate (as
    ``tc`` writes it, every host's, both ways) and rows."""

    skipped: str | None = None
    rate: str = ""
    rows: tuple[ClusterRow, ...] = ()
    #: async with one slow worker host (None: not measured), or why it was not
    async_row: ClusterAsyncRow | None = None
    async_skipped: str | None = None

    def to_json(self) -> JSONObject:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        out: JSONObject = {"rate": self.rate, "rows": [r.to_json() for r in self.rows]}
        if self.async_row is not None:
            out["async"] = self.async_row.to_json()
        if self.async_skipped is not None:
            out["async_skipped"] = self.async_skipped
        return out

    @classmethod
    def from_json(cls, value: JSON) -> ClusterResult:
        if not isinstance(value, dict):
            raise ValueError(f"the cluster part is an object, not {value!r}")
        if "skipped" in value:
            return cls(skipped=text(value, "skipped"))
        rows = value.get("rows") or []
        if not isinstance(rows, list):
            raise ValueError("cluster rows: expected a list")
        arow = value.get("async")
        skipped = value.get("async_skipped")
        return cls(None, text(value, "rate"), tuple(ClusterRow.from_json(r) for r in rows),
                   None if arow is None else ClusterAsyncRow.from_json(arow),
                   skipped if isinstance(skipped, str) else None)


@dataclass(frozen=True)
class BenchResult:
    """``result.json``: what ran, where, each part's rows and the goals. A part that did
    not run is empty (None) and left out of the file."""

    sweep: tuple[SweepRow, ...] | None = None
    hosts: HostsResult | None = None
    async_rows: tuple[AsyncRow, ...] | None = None  # "async" in the file
    memory: tuple[MemoryRow, ...] | None = None
    overlap: OverlapResult | None = None
    overlap_tcp: OverlapResult | None = None
    goals: tuple[Goal, ...] = ()
    command: str = ""
    preset: str = ""
    malloc: str = ""
    started: float = 0.0
    seconds: float = 0.0
    environment: Environment | None = None
    replication: ReplicationResult | None = None
    cluster: ClusterResult | None = None
    reshard: tuple[ReshardRow, ...] | None = None

    def to_json(self) -> JSONObject:
        out: JSONObject = {"command": self.command, "preset": self.preset,
                           "malloc": self.malloc, "started": self.started,
                           "environment": (None if self.environment is None
                                           else self.environment.to_json())}
        # a part that did not run has no key
        lists: Mapping[str, Sequence[Row] | None] = {
            "sweep": self.sweep, "async": self.async_rows, "memory": self.memory}
        ones: Mapping[str, Row | None] = {
            "hosts": self.hosts, "overlap": self.overlap, "overlap_tcp": self.overlap_tcp}
        for key in ("sweep", "hosts", "async", "memory", "overlap", "overlap_tcp"):
            many, one = lists.get(key), ones.get(key)
            if many is not None:
                out[key] = [r.to_json() for r in many]
            elif one is not None:
                out[key] = one.to_json()
        if self.replication is not None:
            out["replication"] = self.replication.to_json()
        if self.cluster is not None:
            out["cluster"] = self.cluster.to_json()
        if self.reshard is not None:
            out["reshard"] = [r.to_json() for r in self.reshard]
        out["seconds"] = self.seconds
        out["goals"] = [g.to_json() for g in self.goals]
        return out

    @classmethod
    def from_json(cls, value: JSON) -> BenchResult:
        d = _obj(value)

        def rows(key: str) -> list[JSON]:
            v = d.get(key) or []
            if not isinstance(v, list):
                raise ValueError(f"{key}: expected a list")
            return v

        def opt(key: str) -> JSON:
            return d.get(key)

        env, repl, cluster = opt("environment"), opt("replication"), opt("cluster")
        hosts, overlap, overlap_tcp = opt("hosts"), opt("overlap"), opt("overlap_tcp")
        return cls(
            tuple(SweepRow.from_json(r) for r in rows("sweep")) if "sweep" in d else None,
            None if hosts is None else HostsResult.from_json(hosts),
            tuple(AsyncRow.from_json(r) for r in rows("async")) if "async" in d else None,
            tuple(MemoryRow.from_json(r) for r in rows("memory")) if "memory" in d else None,
            None if overlap is None else OverlapResult.from_json(overlap),
            None if overlap_tcp is None else OverlapResult.from_json(overlap_tcp),
            tuple(Goal.from_json(g) for g in rows("goals")),
            text(d, "command", ""), text(d, "preset", ""), text(d, "malloc", ""),
            number(d, "started", 0.0), number(d, "seconds", 0.0),
            None if env is None else Environment.from_json(env),
            None if repl is None else ReplicationResult.from_json(repl),
            None if cluster is None else ClusterResult.from_json(cluster),
            tuple(ReshardRow.from_json(r) for r in rows("reshard")) if "reshard" in d else None)
