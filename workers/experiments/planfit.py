"""The planner's fit: the simulator's model of time, measured from real runs' event logs.

From each worker's ``step`` records (docs/events.md) of one or more runs:

* **compute**, per worker: the time between two consecutive steps that was not on
  the wire and not injected by a straggler scenario,
  ``dt - max(pull_s, push_s) - sleep_s`` (a push and its pull are one round trip,
  timed from the same start), per gradient (a local-SGD push holds H). It holds
  whatever a worker does off the wire (data, forward, backward, its evaluations),
  kept as the measured values themselves: the simulator resamples them;
* **the link**: a step's time on the wire, ``max(pull_s, push_s) - wait_s`` (the
  time a shard held the pull at a barrier is no wire time), against the bytes it
  moved, fitted as ``a + b * bytes`` by least squares. With a single message size
  (one run, uncompressed) ``b`` cannot be told apart from ``a``: ``b`` is then the
  run's nominal NIC rate (``--link`` of an emulated cluster; 0 on loopback, where
  everything is per message) and ``a`` the rest;
* **the shards' service time**: a shard decides one push at a time, so two
  decisions back to back are one service time apart; the 5th percentile of the
  gaps between a shard's consecutive ``push`` records (capped by ``a``).

The first step of each worker (its start: the seeding, the first connections) is
left out. Everything here is pure (no sockets, no clock) but :func:`read_run`.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from paramserver.errors import ConfigError
from paramserver.observe.events import read_events
from paramserver.workers.launch.netcluster import parse_rate
from paramserver.workers.launch.simtiming import Timing

__all__ = [
    "Fit",
    "LinkFit",
    "RunRecord",
    "StepRow",
    "compute_times",
    "fit_link",
    "fit_runs",
    "fit_service",
    "read_run",
    "wire_samples",
]

#: the simulator sends four messages a step (push, its reply, pull, its reply) where a
#: real worker's push carries its pull: the per-step cost is spread over the four
PER_STEP_MESSAGES = 4
SERVICE_QUANTILE = 0.05


class StepRow(msgspec.Struct, kw_only=True, frozen=True):
    """What the fit reads of a ``step`` record."""

    t: float
    compute_s: float = 0.0
    sleep_s: float = 0.0
    pull_s: float = 0.0
    push_s: float = 0.0
    wait_s: float = 0.0
    bytes: int = 0
    local_steps: int = 1


@dataclass(frozen=True)
class RunRecord:
    """One run as the fit sees it."""

    path: Path
    spec: dict[str, Any]  # result.json's ``spec`` (the ClusterSpec's JSON)
    steps: dict[int, list[StepRow]]  # rank -> its step records, in order
    pushes: dict[int, list[float]]  # shard -> times of its push decisions, in order

    def per_byte(self, host: int) -> float:
        """Seconds per byte of ``host``'s NIC as the run was set up: its emulated
        cluster's rate, 0 on loopback (no rate to speak of)."""
        if not self.spec.get("hosts"):
            return 0.0
        rate = (self.spec.get("link_of") or {}).get(str(host)) or self.spec.get("link") \
            or "1gbit"
        return 8.0 / parse_rate(str(rate))

    def worker_host(self, rank: int) -> int:
        hosts = str(self.spec.get("hosts") or "")
        return rank % int(hosts.split("+")[0]) if hosts else rank


def read_run(path: str | Path) -> RunRecord:
    """Read a run directory's ``result.json`` and ``events/``; one-line errors for a
    directory that is not a finished run or has no steps."""
    run = Path(path)
    if not run.is_dir():
        raise ConfigError(f"--from {run}: no such run directory")
    events = run / "events"
    result = run / "result.json"
    if not events.is_dir() or not result.is_file():
        raise ConfigError(f"--from {run}: not a finished run (no events/ or result.json; "
                          "give the --out of paramserver launch or run)")
    try:
        spec = msgspec.json.decode(result.read_bytes())["spec"]
    except (msgspec.DecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"--from {run}: result.json has no readable spec ({exc})") from exc
    steps: dict[int, list[StepRow]] = {}
    for file in events.glob("worker*.jsonl"):
        rank = file.stem.removeprefix("worker")
        if rank.isdigit():
            rows = [msgspec.convert(r, type=StepRow) for r in read_events(file, "step")]
            steps[int(rank)] = rows
    if sum(len(r) for r in steps.values()) < 2 * max(1, len(steps)):
        raise ConfigError(f"--from {run}: its workers logged too few step events to fit "
                          "(at least 2 each)")
    pushes: dict[int, list[float]] = {}
    for file in events.glob("server*.jsonl"):
        shard = file.stem.removeprefix("server")
        if shard.isdigit():  # (a backup's log, server0r1, replays the primary's)
            pushes[int(shard)] = [float(r["t"]) for r in read_events(file, "push")]
    return RunRecord(run, spec, dict(sorted(steps.items())), pushes)


# --------------------------------------------------------------------------- pure fits


def compute_times(rows: Sequence[StepRow]) -> list[float]:
    """Bare compute per gradient of each step after the first (see the module doc)."""
    out = []
    for prev, row in itertools.pairwise(rows):
        off_wire = row.t - prev.t - max(row.pull_s, row.push_s) - row.sleep_s
        out.append(max(0.0, off_wire) / max(1, row.local_steps))
    return out


def wire_samples(rows: Sequence[StepRow]) -> list[tuple[int, float]]:
    """(bytes, seconds on the wire) of each step after the first."""
    return [(row.bytes, max(0.0, max(row.pull_s, row.push_s) - row.wait_s))
            for row in rows[1:]]


@dataclass(frozen=True)
class LinkFit:
    """Wire time of one step = ``per_step + per_byte * bytes``."""

    per_step: float
    per_byte: float
    identified: bool  # per_byte was fitted (several message sizes), not assumed
    samples: int

    def describe(self) -> str:
        how = "fitted" if self.identified else "the run's nominal rate (one message size)"
        return (f"{self.per_step * 1e3:.3f} ms per step + {self.per_byte * 1e9:.3f} ns per "
                f"byte ({how})")


def fit_link(samples: Sequence[tuple[int, float]], nominal_per_byte: float = 0.0) -> LinkFit:
    """Least squares of seconds on bytes; one size only: ``per_byte`` is the nominal one."""
    if not samples:
        raise ConfigError("no wire times to fit: the runs have no steps after the first")
    xs = [float(b) for b, _ in samples]
    ys = [s for _, s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    spread = (max(xs) - min(xs)) / max(mx, 1.0)
    if spread > 0.1 and sxx > 0:
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if b >= 0:
            return LinkFit(max(0.0, my - b * mx), b, True, len(samples))
    return LinkFit(max(0.0, my - nominal_per_byte * mx), nominal_per_byte, False, len(samples))


def fit_service(push_times: Sequence[float], per_step: float = math.inf) -> float:
    """A shard's time per push: the low quantile of the gaps between its consecutive
    decisions (back to back when it was busy), at most ``per_step``."""
    gaps = sorted(b - a for a, b in itertools.pairwise(push_times) if b > a)
    if not gaps:
        return 0.0
    return min(gaps[int(SERVICE_QUANTILE * (len(gaps) - 1))], per_step)


@dataclass(frozen=True)
class Fit:
    """The model of time fitted from runs, and what is needed to resample it."""

    compute: dict[int, list[float]]  # rank -> bare compute times per gradient
    link: LinkFit
    service: float
    wire: list[tuple[int, float]] = field(default_factory=list)
    nominal_per_byte: float = 0.0

    def timing(self, link_per_byte: float | None = None,
               per_byte_of: Mapping[int, float] | None = None) -> Timing:
        """The simulator's :class:`Timing`; ``link_per_byte`` (seconds per byte, from a
        ``--link`` rate) replaces the fitted per-byte cost, scaled by how far the fitted
        links fell short of their nominal rate where that is known."""
        efficiency = 1.0
        if self.link.identified and self.nominal_per_byte > 0:
            efficiency = self.link.per_byte / self.nominal_per_byte
        scale = efficiency if link_per_byte is not None else 1.0
        per_byte = self.link.per_byte if link_per_byte is None else link_per_byte * scale
        per_message = max(0.0, self.link.per_step - self.service) / PER_STEP_MESSAGES
        return Timing(compute=self.compute, per_message=per_message, per_byte=per_byte,
                      per_byte_of={h: v * scale for h, v in (per_byte_of or {}).items()},
                      service=self.service)

    def resample(self, rng: random.Random) -> Fit:
        """A bootstrap replicate: every sample drawn again with replacement, then refit."""
        def draw(values: list[Any]) -> list[Any]:
            return [values[rng.randrange(len(values))] for _ in values] if values else values
        compute = {r: draw(v) for r, v in self.compute.items()}
        wire = draw(self.wire)
        link = fit_link(wire, self.nominal_per_byte) if wire else self.link
        return replace(self, compute=compute, link=link, wire=wire)

    def summary(self) -> dict[str, Any]:
        pooled = [v for vs in self.compute.values() for v in vs]
        return {
            "compute_ms": {str(r): _quantiles(v) for r, v in self.compute.items()},
            "compute_ms_pooled": _quantiles(pooled),
            "link": {"per_step_ms": self.link.per_step * 1e3,
                     "per_byte_ns": self.link.per_byte * 1e9,
                     "per_byte_fitted": self.link.identified, "samples": self.link.samples},
            "service_ms": self.service * 1e3,
        }


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    s = sorted(values)
    if not s:
        return {}
    at = lambda q: s[min(len(s) - 1, int(q * (len(s) - 1)))] * 1e3  # noqa: E731
    return {"p10": at(0.1), "p50": at(0.5), "p90": at(0.9), "mean": statistics.fmean(s) * 1e3,
            "n": float(len(s))}


def fit_runs(runs: Sequence[RunRecord]) -> Fit:
    """One fit from every run: compute by rank (the runs' values together), one link
    fit over every step, the service time over every shard's decisions."""
    if not runs:
        raise ConfigError("give at least one run to fit (--from RUN)")
    compute: dict[int, list[float]] = {}
    wire: list[tuple[int, float]] = []
    nominal: list[float] = []
    for run in runs:
        for rank, rows in run.steps.items():
            compute.setdefault(rank, []).extend(compute_times(rows))
            samples = wire_samples(rows)
            wire.extend(samples)
            nominal.extend([run.per_byte(run.worker_host(rank))] * len(samples))
    compute = {r: v for r, v in compute.items() if v}
    if not compute or not wire:
        raise ConfigError("the runs have too few steps to fit (at least 2 per worker)")
    nominal_per_byte = statistics.fmean(nominal) if nominal else 0.0
    link = fit_link(wire, nominal_per_byte)
    gaps_fit = [fit_service(times, link.per_step)
                for run in runs for times in run.pushes.values() if len(times) > 1]
    service = statistics.median(gaps_fit) if gaps_fit else 0.0
    return Fit(compute=compute, link=link, service=service, wire=wire,
               nominal_per_byte=nominal_per_byte)
