"""The planner's fit: the simulator's model of time, measured from real runs' event logs.

From each worker's ``step`` records (docs/events.md) of one or more runs:

* **compute**, per worker and step: ``compute_s`` (data, forward, backward: what
  a straggler scenario pads and slows), and the **overhead**, the rest of the time
  between two consecutive steps that was neither on the wire nor injected,
  ``dt - max(pull_s, push_s) - sleep_s - compute_s`` (a push and its pull are one
  round trip, timed from the same start: the evaluator's evaluations, bookkeeping),
  the compute per gradient (a local-SGD push holds H), the overhead per push (most
  of it is the push's own bookkeeping: a local-SGD push of H steps spends about
  what one plain push does, measured on emulated hosts, docs/research.md); kept as
  the measured pairs themselves: the simulator resamples them;
* **the link**: a step's time on the wire, ``max(pull_s, push_s) - wait_s`` (the
  time a shard held the pull at a barrier is no wire time). On emulated hosts the
  bytes' part is the NICs' own, as ``tc`` shapes them (their rate and token bucket,
  :mod:`paramserver.workers.launch.simtiming`), and the rest is per step; on
  loopback (no rate) it is fitted as ``a + b * bytes`` by least squares, with
  ``b = 0`` where the steps all moved one size (one run, uncompressed: ``b``
  cannot be told apart from ``a`` then). The per-step cost is then *calibrated*
  (:func:`paramserver.workers.experiments.planner.calibrate`), per family of modes
  (sync, local SGD and DiLoCo, async, SSP): moved until the simulator, run on the
  fitted configurations of that family, spends as long on the wire per step as the
  runs did, so that what the model adds itself (its four messages, queueing at
  the shard, the buckets) is not counted twice, and what it lacks (a sync round's
  burst of work on one machine) is counted. A family no run was fitted on takes
  the nearest one's that was (:data:`NEAREST`), and says so;
* **a local-SGD round's own cost**: a push of H inner steps costs, besides its H
  steps, what the round does once (the copy of the weights it starts from, the
  pseudo-gradient, the inner optimizer's steps): per push of a fitted local-SGD
  run, its overhead less a plain push's mean overhead (:func:`round_extras`; their
  mean is what is fitted, kept >= 0). Where no
  local-SGD run was fitted, the planner estimates it in-process
  (:func:`paramserver.workers.experiments.planner.estimate_round`);
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
from paramserver.workers.launch.netcluster import BURST_FLOOR, BURST_SECONDS, parse_rate
from paramserver.workers.launch.simtiming import Timing

__all__ = [
    "Fit",
    "LinkFit",
    "RunRecord",
    "StepRow",
    "compute_times",
    "family",
    "fit_link",
    "fit_runs",
    "fit_service",
    "mean_wire",
    "nonnegative",
    "read_run",
    "round_extras",
    "run_family",
    "wire_samples",
]

#: the families of modes whose per-step costs are calibrated apart (see the module doc)
FAMILIES = ("sync", "local", "async", "ssp")
#: a family no fitted run was of takes the first of these that one was of: the
#: nearest in how its pushes meet at the shard (a round, or a gate's release)
NEAREST = {"sync": ("local", "ssp", "async"), "local": ("sync", "ssp", "async"),
           "async": ("ssp", "sync", "local"), "ssp": ("async", "sync", "local")}


def family(mode: str, local: bool = False) -> str:
    """The family of a shard mode: ``sync``, ``local`` (sync rounds of H local steps:
    local SGD, DiLoCo), ``async`` or ``ssp``."""
    if mode == "sync":
        return "local" if local else "sync"
    return "ssp" if mode == "ssp" else "async"


def run_family(run: RunRecord) -> str:
    """The family of the mode ``run`` ran."""
    server, worker = run.spec.get("server") or {}, run.spec.get("worker") or {}
    return family(str(server.get("mode", "async")), bool(worker.get("local_optimizer")))


def mean_wire(run: RunRecord) -> float:
    """A run's mean time on the wire per step (after each worker's first)."""
    return statistics.fmean(s for rows in run.steps.values() for _, s in wire_samples(rows))


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
            try:
                rows = [msgspec.convert(r, type=StepRow) for r in read_events(file, "step")]
            except (msgspec.ValidationError, ValueError) as exc:
                raise ConfigError(f"--from {run}: {file.name} has a step event that cannot "
                                  f"be read ({exc})") from exc
            steps[int(rank)] = rows
    if sum(len(r) for r in steps.values()) < 2 * max(1, len(steps)):
        raise ConfigError(f"--from {run}: its workers logged too few step events to fit "
                          "(at least 2 each)")
    pushes: dict[int, list[float]] = {}
    for file in events.glob("server*.jsonl"):
        shard = file.stem.removeprefix("server")
        if shard.isdigit():  # (a backup's log, server0r1, replays the primary's)
            try:
                pushes[int(shard)] = [msgspec.convert(r["t"], type=float)
                                      for r in read_events(file, "push")]
            except (msgspec.ValidationError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"--from {run}: {file.name} has a push event that cannot "
                                  f"be read ({exc!r})") from exc
    return RunRecord(run, spec, dict(sorted(steps.items())), pushes)


# --------------------------------------------------------------------------- pure fits


def compute_times(rows: Sequence[StepRow]) -> list[tuple[float, float]]:
    """(compute per gradient, overhead per push) of each step after the first (the
    module doc)."""
    out = []
    for prev, row in itertools.pairwise(rows):
        off_wire = row.t - prev.t - max(row.pull_s, row.push_s) - row.sleep_s
        n = max(1, row.local_steps)
        out.append((row.compute_s / n, max(0.0, off_wire - row.compute_s)))
    return out


def round_extras(rows: Sequence[StepRow], plain_overhead: float) -> list[float]:
    """Per local-SGD push after the first: its overhead (off the wire, not computing,
    not injected) beyond ``plain_overhead``, a plain push's mean: what the round itself
    cost. Below 0 where the push spent less (noise around a small cost)."""
    return [over - plain_overhead for _, over in compute_times(rows)]


def nonnegative(values: Sequence[float]) -> list[float]:
    """``values`` clamped at 0 and scaled back to their mean (0s where it is <= 0): a
    cost to resample whose mean is the measured one."""
    mean = statistics.fmean(values) if values else 0.0
    clamped = [max(0.0, v) for v in values]
    if mean <= 0:
        return [0.0] * len(values)
    scale = mean / statistics.fmean(clamped)
    return [v * scale for v in clamped]


def wire_samples(rows: Sequence[StepRow], nominal_per_byte: float = 0.0
                 ) -> list[tuple[float, float]]:
    """(seconds its bytes take at the nominal rate, or its bytes where there is none;
    seconds on the wire) of each step after the first."""
    scale = nominal_per_byte or 1.0
    return [(row.bytes * scale, max(0.0, max(row.pull_s, row.push_s) - row.wait_s))
            for row in rows[1:]]


@dataclass(frozen=True)
class LinkFit:
    """Wire time of one step = ``per_step`` + its bytes' time: on emulated hosts
    (``rated``) the NICs' (``slope`` 1: at their rate, through their buckets), on
    loopback ``slope`` seconds per byte."""

    per_step: float
    slope: float
    identified: bool  # the slope was fitted (several message sizes), not assumed
    samples: int
    rated: bool = False

    def per_byte(self, nominal_per_byte: float) -> float:
        """Seconds per byte on a NIC rated at ``nominal_per_byte``."""
        return self.slope * nominal_per_byte if self.rated else self.slope

    def describe(self) -> str:
        return ("the bytes at the NICs' rates, through their token buckets" if self.rated
                else f"{self.slope * 1e9:.3f} ns per byte "
                     f"({'fitted' if self.identified else 'one message size: none apart'})")


def fit_link(samples: Sequence[tuple[float, float]], rated: bool = False) -> LinkFit:
    """Rated (emulated hosts): the mean wire time per step, to be calibrated. Loopback:
    least squares of seconds on bytes; where bytes hardly vary, all per step."""
    if not samples:
        raise ConfigError("no wire times to fit: the runs have no steps after the first")
    xs = [float(b) for b, _ in samples]
    ys = [s for _, s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    if rated:
        return LinkFit(my, 1.0, False, len(samples), rated=True)
    sxx = sum((x - mx) ** 2 for x in xs)
    if mx > 0 and (max(xs) - min(xs)) / mx > 0.1 and sxx > 0:
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if b >= 0:
            return LinkFit(max(0.0, my - b * mx), b, True, len(samples))
    return LinkFit(my, 0.0, False, len(samples))


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

    #: rank -> (compute per gradient, overhead per push) per step
    compute: dict[int, list[tuple[float, float]]]
    link: LinkFit
    service: float
    wire: list[tuple[float, float]] = field(default_factory=list)
    nominal_per_byte: float = 0.0  # the fitted runs' NICs' rate (mean), 0: loopback
    #: family of modes (:func:`family`) -> seconds added to the fitted per-step cost by
    #: calibration (planner.calibrate)
    calibration: dict[str, float] = field(default_factory=dict)
    #: the families of the fitted runs' modes
    families: tuple[str, ...] = ()
    #: a local-SGD push's own cost (:func:`round_extras`), per push of the fitted
    #: local-SGD runs; empty: none was fitted (the planner estimates it)
    round_extra: list[float] = field(default_factory=list)

    def source(self, family: str) -> str:
        """The family whose calibration ``family``'s modes take: its own where it was
        calibrated, else the nearest that was (:data:`NEAREST`); itself where none was."""
        for fam in (family, *NEAREST[family]):
            if fam in self.calibration:
                return fam
        return family

    def per_step(self, family: str) -> float:
        """The per-step cost for ``family``'s modes (:meth:`source`'s calibration)."""
        return self.link.per_step + self.calibration.get(self.source(family), 0.0)

    def timing(self, link_per_byte: float | None = None,
               per_byte_of: Mapping[int, float] | None = None, family: str = "async",
               round_extra: Sequence[float] | None = None) -> Timing:
        """The simulator's :class:`Timing`. ``link_per_byte`` and ``per_byte_of``
        (seconds per byte of every NIC and of host K's, from ``--link`` rates) stand
        for the fitted runs' NICs, each as far short of its rate as theirs were.
        ``round_extra`` (a local-SGD push's own cost) replaces the fitted one."""
        fitted = self.link.per_byte(self.nominal_per_byte)
        every = fitted if link_per_byte is None else self.link.per_byte(link_per_byte)
        if not self.link.rated and link_per_byte is not None:
            every = link_per_byte  # loopback's slope says nothing of a NIC's
        of = {h: self.link.per_byte(v) if self.link.rated else v
              for h, v in (per_byte_of or {}).items()}
        per_message = max(0.0, self.per_step(family) - self.service) / PER_STEP_MESSAGES
        burst = (BURST_FLOOR, BURST_SECONDS) if self.link.rated else (0.0, 0.0)
        return Timing(compute={r: [c for c, _ in v] for r, v in self.compute.items()},
                      overhead={r: [o for _, o in v] for r, v in self.compute.items()},
                      per_message=per_message, per_byte=every, per_byte_of=of,
                      service=self.service, burst_floor=burst[0], burst_seconds=burst[1],
                      round_extra=list(self.round_extra if round_extra is None
                                       else round_extra))

    def resample(self, rng: random.Random) -> Fit:
        """A bootstrap replicate: every sample drawn again with replacement, then refit."""
        def draw(values: list[Any]) -> list[Any]:
            return [values[rng.randrange(len(values))] for _ in values] if values else values
        compute = {r: draw(v) for r, v in self.compute.items()}
        wire = draw(self.wire)
        link = fit_link(wire, self.link.rated) if wire else self.link
        return replace(self, compute=compute, link=link, wire=wire,
                       round_extra=draw(self.round_extra))

    def summary(self) -> dict[str, Any]:
        pooled = [c for vs in self.compute.values() for c, _ in vs]
        return {
            "compute_ms": {str(r): _quantiles([c for c, _ in v]) for r, v in self.compute.items()},
            "compute_ms_pooled": _quantiles(pooled),
            "overhead_ms": {str(r): _quantiles([o for _, o in v])
                            for r, v in self.compute.items()},
            "link": {"per_step_ms": {f: self.per_step(f) * 1e3 for f in FAMILIES},
                     "per_step_from": {f: self.source(f) for f in FAMILIES},
                     "calibrated_ms": {f: c * 1e3 for f, c in self.calibration.items()},
                     "fitted_per_step_ms": self.link.per_step * 1e3,
                     "per_byte_ns": self.link.per_byte(self.nominal_per_byte) * 1e9,
                     "slope": self.link.slope, "rated": self.link.rated,
                     "slope_fitted": self.link.identified, "samples": self.link.samples},
            "service_ms": self.service * 1e3,
            "fitted_families": list(self.families),
            "local_round_ms": _quantiles(self.round_extra),
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
    rated = [bool(run.spec.get("hosts")) for run in runs]
    if len(set(rated)) > 1:
        raise ConfigError("fit runs on emulated hosts (--hosts) or on loopback, not both: "
                          "their links have nothing in common")
    families = [run_family(run) for run in runs]
    plain = [run for run, fam in zip(runs, families, strict=True) if fam != "local"]
    # compute from the runs of plain steps; a local-SGD run's only where there is none
    # (its round's own cost then sits in its pushes' overhead)
    compute: dict[int, list[tuple[float, float]]] = {}
    for run in plain or runs:
        for rank, rows in run.steps.items():
            compute.setdefault(rank, []).extend(compute_times(rows))
    compute = {r: v for r, v in compute.items() if v}
    round_extra: list[float] = [0.0] if not plain else []  # (all of it in the steps')
    if plain and len(plain) < len(runs):
        overhead = statistics.fmean(o for v in compute.values() for _, o in v) \
            if compute else 0.0
        round_extra = nonnegative([
            x for run, fam in zip(runs, families, strict=True) if fam == "local"
            for rows in run.steps.values() for x in round_extras(rows, overhead)])
    wire: list[tuple[float, float]] = []
    nominal: list[float] = []
    for run in runs:
        for rank, rows in run.steps.items():
            per_byte = run.per_byte(run.worker_host(rank))
            samples = wire_samples(rows, per_byte)
            wire.extend(samples)
            nominal.extend([per_byte] * len(samples))
    if not compute or not wire:
        raise ConfigError("the runs have too few steps to fit (at least 2 per worker)")
    nominal_per_byte = statistics.fmean(nominal) if nominal else 0.0
    link = fit_link(wire, rated[0])
    gaps_fit = [fit_service(times, link.per_step)
                for run in runs for times in run.pushes.values() if len(times) > 1]
    service = statistics.median(gaps_fit) if gaps_fit else 0.0
    return Fit(compute=compute, link=link, service=service, wire=wire,
               nominal_per_byte=nominal_per_byte, families=tuple(dict.fromkeys(families)),
               round_extra=round_extra)
