"""What the launcher knows and says about the processes it ran.

:class:`ProcessInfo` (name, role, pid) is recorded as each process starts
(``processes.json``, ``result.json``); :class:`WorkerSummary` reads what became
of each worker from ``result.json``'s records; :func:`shard_cause` finds the
shard error behind a worker's failure, with the last frame of the shard's
traceback, so that a launcher names the real culprit.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ProcessInfo", "WorkerSummary", "exit_reason", "shard_cause", "tail",
           "worker_summaries"]


@dataclass(frozen=True)
class ProcessInfo:
    """One process the launcher started (a restart is a new one, same name)."""

    name: str  # server0, worker1
    role: str  # "server" or "worker"
    pid: int
    started: float  # time.time()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def exit_reason(code: int) -> str:
    """A process's exit code in words: ``killed by SIGKILL``, ``exit code 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True)
class WorkerSummary:
    """What became of one worker, from ``result.json``'s records.

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
        """Why it last died ("" if it never did)."""
        return exit_reason(self.deaths[-1]) if self.deaths else ""

    @classmethod
    def from_result(cls, record: dict[str, Any], failures: list[dict[str, Any]],
                    restarts: list[dict[str, Any]]) -> WorkerSummary:
        rank = int(record["worker"])
        name = f"worker{rank}"
        deaths = tuple(int(f["exit_code"]) for f in failures if f["process"] == name)
        restarted = sum(1 for r in restarts if r["process"] == name)
        if record.get("failed"):  # no result file: it died and stayed dead
            return cls(rank, False, deaths=deaths, restarts=restarted)
        return cls(rank, True, steps=int(record["steps"]),
                   clock=int(record.get("clock", record["steps"])), pushes=int(record["pushes"]),
                   accepted=int(record["accepted"]), rejected=int(record["rejected"]),
                   deaths=deaths, restarts=restarted)

    def describe(self) -> str:
        if not self.finished:
            return f"worker {self.rank} dead ({self.reason or 'no result'}), tolerated"
        if self.restarts:
            times = "once" if self.restarts == 1 else f"{self.restarts} times"
            return (f"worker {self.rank} restarted {times} (last death: {self.reason}), "
                    f"then finished at clock {self.clock}")
        return f"worker {self.rank} finished {self.steps} steps"


def worker_summaries(result: dict[str, Any]) -> list[WorkerSummary]:
    """The typed per-worker view of a :func:`run_cluster` result."""
    failures = result.get("failures", [])
    restarts = result.get("restarts", [])
    return [WorkerSummary.from_result(w, failures, restarts) for w in result["workers"]]


_INTERNAL = re.compile(r"\bshard (\d+)(?: at \S+)? refused the request: internal: (.+)")


def shard_cause(worker_log: Path, server_logs: Sequence[Path]) -> str:
    """When a worker died of a shard's ``internal`` error reply (a policy's decide()
    raised, say), the shard's reason and the last frame of the traceback in its log,
    as lines to put first; "" otherwise. The worker's own traceback only shows where
    the reply arrived."""
    try:
        text = worker_log.read_text(errors="replace")
    except OSError:
        return ""
    found = list(_INTERNAL.finditer(text))
    if not found:
        return ""
    shard, reason = int(found[-1].group(1)), found[-1].group(2).strip()
    lines = [f"shard {shard} failed handling a request: {reason}"]
    if shard < len(server_logs):
        frame = _last_frame(server_logs[shard])
        if frame:
            lines.append(f"  at {frame}")
        lines.append(f"  (its log: {server_logs[shard]})")
    return "\n".join(lines) + "\n"


def _last_frame(path: Path) -> str:
    """``File "...", line N, in f: code`` of the last traceback in a log, or ""."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return ""
    frames = [i for i in range(starts[-1], len(lines)) if lines[i].startswith("  File ")]
    if not frames:
        return ""
    at = frames[-1]
    code = lines[at + 1].strip() if at + 1 < len(lines) else ""
    return lines[at].strip() + (f": {code}" if code else "")


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])
