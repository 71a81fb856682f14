"""The records a run leaves, and their JSON.

:class:`WorkerResult` is what one worker did (``run_worker``'s return value,
``results/worker<r>.json``, its ``worker_end`` event); :class:`LostWorker` stands
in for a worker that died and stayed dead. :class:`ClusterResult` is a whole
run (``run_cluster``'s and ``run_simulation``'s return value, ``result.json``),
holding :class:`FailureRecord` and :class:`RestartRecord` per process event.
Each record has one ``to_json()``, the one place its file's keys are spelled
(docs/events.md and docs/cli.md list them), and ``from_json()`` to read it back.
:class:`WorkerSummary` is the launcher's per-worker verdict drawn from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec

from paramserver.util.jsontypes import JSON, JSONObject
from paramserver.workers.launch.processes import ProcessInfo, exit_reason
from paramserver.workers.workerresult import WorkerResult, drop_none

__all__ = [
    "FINAL_WEIGHTS",
    "LAST_IN_LOOP",
    "NOT_JOINED",
    "ClusterResult",
    "FailureRecord",
    "LostWorker",
    "RestartRecord",
    "SimSummary",
    "WorkerResult",  # re-exported: the worker's own record lives with DistributedOptimizer
    "WorkerSummary",
    "read_result",
    "shard_figures",
    "worker_summaries",
]

_T = TypeVar("_T")

#: what a run's ``eval`` figures are of (result.json's ``eval_of``): the final weights,
#: evaluated once every worker was done (by the launcher, or by a script after
#: ``opt.final()``), or the evaluating worker's last evaluation in its loop, which a
#: straggler's later pushes do not count in (a script that never called ``opt.final()``)
FINAL_WEIGHTS, LAST_IN_LOOP = "final_weights", "last_in_loop"
#: a command's worker that exited 0 with no result: it ran, but never built a
#: DistributedOptimizer (a FailureRecord's reason, and what its summary says)
NOT_JOINED = "exited without joining the run"


@dataclass(frozen=True)
class LostWorker:
    """A worker that died and stayed dead (a tolerated failure): it wrote no result."""

    worker: int
    exit_code: int | None = None  # of its last death (None: none was seen)
    reason: str | None = None

    def to_json(self) -> JSONObject:
        return drop_none({"worker": self.worker, "failed": True,
                           "exit_code": self.exit_code, "reason": self.reason})

    @classmethod
    def from_json(cls, data: JSON) -> LostWorker:
        return msgspec.convert(data, type=cls)


def _object(value: JSON, what: str) -> JSONObject:
    if not isinstance(value, dict):
        raise msgspec.ValidationError(f"{what}: expected a JSON object")
    return value


def _field(doc: JSONObject, key: str, kind: type[_T]) -> _T:
    """``doc[key]`` as ``kind`` (msgspec checks it; the open JSON parts stay out of it)."""
    if key not in doc:
        raise msgspec.ValidationError(f"result.json: no `{key}`")
    try:
        return msgspec.convert(doc[key], type=kind)
    except msgspec.ValidationError as exc:
        raise msgspec.ValidationError(f"result.json: `{key}`: {exc}") from None


def _list(doc: JSONObject, key: str) -> list[JSON]:
    value = doc.get(key)
    if not isinstance(value, list):
        raise msgspec.ValidationError(f"result.json: `{key}` is not a list")
    return value


def _worker_from_json(data: JSON) -> WorkerResult | LostWorker:
    if isinstance(data, dict) and data.get("failed"):
        return LostWorker.from_json(data)
    return WorkerResult.from_json(data)


@dataclass(frozen=True)
class FailureRecord:
    """A process that exited with a non-zero code, or a command's worker that exited 0
    without joining the run (NOT_JOINED)."""

    process: str  # server0, worker1
    exit_code: int
    reason: str  # the code in words (exit_reason)
    t: float  # time.time()

    def to_json(self) -> JSONObject:
        return {"process": self.process, "exit_code": self.exit_code, "reason": self.reason,
                "t": self.t}


@dataclass(frozen=True)
class RestartRecord:
    """A process started again after a failure."""

    process: str
    t: float
    resumed: bool | None = None  # a shard: from a checkpoint (None: a worker)

    def to_json(self) -> JSONObject:
        return drop_none({"process": self.process, "t": self.t, "resumed": self.resumed})


@dataclass(frozen=True)
class SimSummary:
    """A simulated run's virtual-time settings (its SimSpec) and what simulating took."""

    compute_time: float
    latency: float
    threads: int
    progress_every: int
    wall_seconds: float  # real seconds the simulation took
    steps: int  # steps simulated, all workers

    def to_json(self) -> JSONObject:
        return {"compute_time": self.compute_time, "latency": self.latency,
                "threads": self.threads, "progress_every": self.progress_every,
                "wall_seconds": self.wall_seconds, "steps": self.steps}


@dataclass(frozen=True)
class ClusterResult:
    """A whole run: what ``result.json`` holds.

    ``spec`` is the ClusterSpec as it ran (its ``to_dict``), ``servers`` each shard's
    STATS reply and ``alarms`` the watchdog's alarm events: documents whose records
    live with their writers. A real run has ``alarms``, ``metrics_ports`` and
    ``processes``; a simulated one has ``sim`` instead."""

    spec: JSONObject
    addresses: tuple[str, ...]
    seconds: float  # training, start to the last worker's end (virtual when simulated)
    eval: dict[str, float]  # the run's final held-out figures ({}: not evaluated)
    workers: tuple[WorkerResult | LostWorker, ...]
    servers: tuple[JSONObject, ...]
    updates_applied: tuple[int, ...]  # each shard's version at the end
    pushes_applied_shard0: int
    failures: tuple[FailureRecord, ...] = ()
    restarts: tuple[RestartRecord, ...] = ()
    alarms: tuple[JSONObject, ...] | None = None
    metrics_ports: dict[str, int | None] | None = None
    processes: tuple[ProcessInfo, ...] | None = None
    sim: SimSummary | None = None
    #: what ``eval`` is of: FINAL_WEIGHTS or LAST_IN_LOOP (None: not evaluated, or a
    #: result.json from before this was recorded; see :attr:`eval_source`)
    eval_of: str | None = None
    #: ``launch --hosts``: each emulated host (name, role, address, NIC rate, the
    #: processes it ran); None: the run was on this machine's loopback
    hosts: tuple[JSONObject, ...] | None = None

    @property
    def eval_source(self) -> str | None:
        """What ``eval`` is of, an older result.json's read as it was made: a command
        run's figures were its script's last logged ones, a task's the final weights'."""
        if not self.eval or self.eval_of is not None:
            return self.eval_of
        return LAST_IN_LOOP if self.spec.get("command") else FINAL_WEIGHTS

    @property
    def simulated(self) -> bool:
        return self.sim is not None

    @property
    def finished(self) -> list[WorkerResult]:
        """The workers that wrote a result (the tolerated dead left out)."""
        return [w for w in self.workers if isinstance(w, WorkerResult)]

    def worker(self, rank: int) -> WorkerResult:
        """Worker ``rank``'s result; KeyError if it died and stayed dead."""
        for w in self.finished:
            if w.worker == rank:
                return w
        raise KeyError(f"worker {rank} left no result")

    def to_json(self) -> JSONObject:
        data: JSONObject = {
            "spec": self.spec,
            "addresses": [a for a in self.addresses],
            "seconds": self.seconds,
            "eval": {k: v for k, v in self.eval.items()},
            **({"eval_of": self.eval_of} if self.eval_of is not None else {}),
            "workers": [w.to_json() for w in self.workers],
            "servers": [s for s in self.servers],
            "updates_applied": [v for v in self.updates_applied],
            "pushes_applied_shard0": self.pushes_applied_shard0,
            "failures": [f.to_json() for f in self.failures],
            "restarts": [r.to_json() for r in self.restarts],
        }
        if self.alarms is not None:
            data["alarms"] = [a for a in self.alarms]
        if self.metrics_ports is not None:
            data["metrics_ports"] = {k: v for k, v in self.metrics_ports.items()}
        if self.processes is not None:
            data["processes"] = [p.as_dict() for p in self.processes]
        if self.hosts is not None:
            data["hosts"] = [h for h in self.hosts]
        if self.sim is not None:
            data["simulated"] = True
            data["sim"] = self.sim.to_json()
        return data

    @classmethod
    def from_json(cls, data: JSON) -> ClusterResult:
        """``result.json`` read back (a ValueError names what does not fit)."""
        doc = _object(data, "result.json")
        alarms, ports, procs, sim, hosts = (doc.get(k) for k in (
            "alarms", "metrics_ports", "processes", "sim", "hosts"))
        return cls(
            spec=_object(doc.get("spec"), "spec"),
            addresses=_field(doc, "addresses", tuple[str, ...]),
            seconds=_field(doc, "seconds", float),
            eval=_field(doc, "eval", dict[str, float]),
            workers=tuple(_worker_from_json(w) for w in _list(doc, "workers")),
            servers=tuple(_object(s, "a server") for s in _list(doc, "servers")),
            updates_applied=_field(doc, "updates_applied", tuple[int, ...]),
            pushes_applied_shard0=_field(doc, "pushes_applied_shard0", int),
            failures=_field(doc, "failures", tuple[FailureRecord, ...]),
            restarts=_field(doc, "restarts", tuple[RestartRecord, ...]),
            alarms=None if alarms is None else tuple(
                _object(a, "an alarm") for a in _list(doc, "alarms")),
            metrics_ports=None if ports is None else _field(doc, "metrics_ports",
                                                            dict[str, int | None]),
            processes=None if procs is None else _field(doc, "processes",
                                                        tuple[ProcessInfo, ...]),
            sim=None if sim is None else _field(doc, "sim", SimSummary),
            eval_of=None if doc.get("eval_of") is None else _field(doc, "eval_of", str),
            hosts=None if hosts is None else tuple(
                _object(h, "a host") for h in _list(doc, "hosts")),
        )

    @classmethod
    def read(cls, path: str | Path) -> ClusterResult:
        return cls.from_json(json.loads(Path(path).read_text()))


def shard_figures(stats: JSONObject) -> tuple[int, int]:
    """A shard's STATS reply: (its version, the pushes it lists as applied)."""
    version, workers = stats.get("version"), stats.get("workers")
    applied = 0
    if isinstance(workers, dict):
        for w in workers.values():
            count = w.get("applied") if isinstance(w, dict) else None
            applied += count if isinstance(count, int) else 0
    return (version if isinstance(version, int) else 0), applied


def read_result(run_dir: str | Path) -> ClusterResult | None:
    """A run directory's ``result.json`` (None if the run did not finish)."""
    path = Path(run_dir) / "result.json"
    return ClusterResult.read(path) if path.exists() else None


@dataclass(frozen=True)
class WorkerSummary:
    """What became of one worker, from a run's records.

    ``finished``: its last incarnation ran to the end (a restarted worker
    included); otherwise it died and the death was tolerated. ``deaths`` holds
    the exit code of every death, ``restarts`` how many times it was started again.
    """

    rank: int
    finished: bool
    steps: int = 0  # pushes of its last incarnation
    clock: int = 0  # where it ended (a restarted worker resumes, so clock >= steps)
    pushes: int = 0
    accepted: int = 0
    rejected: int = 0
    deaths: tuple[int, ...] = ()
    restarts: int = 0

    @property
    def reason(self) -> str:
        """Why it last died ("" if it never did; NOT_JOINED: exit code 0, recorded only
        for a command's worker that never built a DistributedOptimizer)."""
        if not self.deaths:
            return ""
        return NOT_JOINED if self.deaths[-1] == 0 else exit_reason(self.deaths[-1])

    @classmethod
    def from_result(cls, record: WorkerResult | LostWorker,
                    failures: tuple[FailureRecord, ...],
                    restarts: tuple[RestartRecord, ...]) -> WorkerSummary:
        name = f"worker{record.worker}"
        deaths = tuple(f.exit_code for f in failures if f.process == name)
        restarted = sum(1 for r in restarts if r.process == name)
        if isinstance(record, LostWorker):  # no result file: it died and stayed dead
            return cls(record.worker, False, deaths=deaths, restarts=restarted)
        return cls(record.worker, True, steps=record.steps, clock=record.clock,
                   pushes=record.pushes, accepted=record.accepted, rejected=record.rejected,
                   deaths=deaths, restarts=restarted)

    def describe(self) -> str:
        if not self.finished:
            if self.reason == NOT_JOINED:  # it ran, and ended: not a death
                return f"worker {self.rank} {NOT_JOINED}, tolerated"
            return f"worker {self.rank} dead ({self.reason or 'no result'}), tolerated"
        if self.restarts:
            times = "once" if self.restarts == 1 else f"{self.restarts} times"
            return (f"worker {self.rank} restarted {times} (last death: {self.reason}), "
                    f"then finished at clock {self.clock}")
        return f"worker {self.rank} finished {self.steps} steps"


def worker_summaries(result: ClusterResult) -> list[WorkerSummary]:
    """The per-worker verdicts of a :func:`run_cluster` result."""
    return [WorkerSummary.from_result(w, result.failures, result.restarts)
            for w in result.workers]
