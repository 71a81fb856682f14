"""Metrics: a small registry, its catalogue, and its exporters (Prometheus, TensorBoard).

Every metric a process exports is declared once in :data:`CATALOGUE` (name,
kind, help, labels, buckets); docs/observability.md documents each one. A
:class:`MetricsRegistry` holds the values a process updates (counters, gauges
and histograms, keyed by label values), and has one reader-facing form,
:meth:`MetricsRegistry.snapshot`, a JSON-able dict that goes into the JSONL
event log (``metrics`` events), into TensorBoard, and through
:class:`RegistryCollector` to Prometheus. Because all three read the same
snapshot, they agree.

The registry is updated by one thread (the server's event loop) and read by
another (the HTTP endpoint's), so every access takes a lock; an update costs
about a microsecond.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Required, TypedDict

from paramserver.errors import ConfigError
from paramserver.observe.figures import EVAL_FIELDS, STEP_FIELDS, FigureGate, finite

__all__ = [
    "CATALOGUE",
    "LATENCY_BUCKETS",
    "STALENESS_BUCKETS",
    "STEP_FIELDS",
    "Child",
    "FigureExporter",
    "LoggedFigures",
    "MetricSpec",
    "MetricsExporter",
    "MetricsRegistry",
    "RegistryCollector",
    "Sample",
    "Snapshot",
    "TensorBoardWriter",
    "flatten",
]

log = logging.getLogger(__name__)

STALENESS_BUCKETS: tuple[float, ...] = (
    0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024,
)
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


@dataclass(frozen=True)
class MetricSpec:
    """A metric's declaration. Counter names end in ``_total``."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("counter", "gauge", "histogram"):
            raise ConfigError(f"metric {self.name}: kind must be counter, gauge or histogram")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ConfigError(f"metric {self.name}: counters, and only they, end in _total")
        if self.kind == "histogram" and list(self.buckets) != sorted(set(self.buckets)):
            raise ConfigError(f"metric {self.name}: buckets must be increasing")


_SW = ("shard", "worker")


def _specs(*specs: MetricSpec) -> dict[str, MetricSpec]:
    return {s.name: s for s in specs}


#: every metric of every process; docs/observability.md explains each
CATALOGUE: dict[str, MetricSpec] = _specs(
    # --- shard servers: the shard
    MetricSpec("paramserver_shard_version", "gauge",
               "optimizer steps this shard has applied", ("shard",)),
    MetricSpec("paramserver_shard_min_clock", "gauge",
               "smallest clock among live workers", ("shard",)),
    MetricSpec("paramserver_shard_clock_gap", "gauge",
               "largest minus smallest clock among live workers", ("shard",)),
    MetricSpec("paramserver_shard_live_workers", "gauge", "workers in the live set", ("shard",)),
    MetricSpec("paramserver_shard_lr", "gauge", "learning rate of the last step", ("shard",)),
    MetricSpec("paramserver_shard_update_norm", "gauge",
               "L2 norm of the last step's change to this shard's weights", ("shard",)),
    MetricSpec("paramserver_shard_weight_norm", "gauge",
               "L2 norm of this shard's weights after the last step", ("shard",)),
    MetricSpec("paramserver_shard_update_ratio", "gauge",
               "update norm / weight norm of the last step", ("shard",)),
    MetricSpec("paramserver_shard_errors_total", "counter",
               "requests refused with an ERROR reply, by code", ("shard", "code")),
    MetricSpec("paramserver_alarms_total", "counter",
               "watchdog alarms raised, by signal", ("shard", "signal")),
    # --- shard servers: replication (--replicas)
    MetricSpec("paramserver_replica_primary", "gauge",
               "1 while this replica is its shard's primary, else 0", ("shard", "replica")),
    MetricSpec("paramserver_replica_epoch", "gauge",
               "the fencing epoch this replica holds", ("shard", "replica")),
    MetricSpec("paramserver_replica_inputs", "gauge",
               "inputs this replica has sent (primary) or applied (backup)",
               ("shard", "replica")),
    MetricSpec("paramserver_replica_backup_lag", "gauge",
               "inputs a backup has not acknowledged yet, as its primary counts them",
               ("shard", "backup")),
    MetricSpec("paramserver_replica_failovers_total", "counter",
               "times this replica took over as its shard's primary", ("shard", "replica")),
    # --- shard servers: per worker
    MetricSpec("paramserver_clock", "gauge", "the worker's clock (pushes completed)", _SW),
    MetricSpec("paramserver_clock_lag", "gauge",
               "the worker's clock minus the smallest live clock", _SW),
    MetricSpec("paramserver_live", "gauge", "1 if the worker is in the live set, else 0", _SW),
    MetricSpec("paramserver_push_staleness", "histogram",
               "staleness (shard version - read version) of each decided push", _SW,
               STALENESS_BUCKETS),
    MetricSpec("paramserver_pushes_accepted_total", "counter", "pushes accepted", _SW),
    MetricSpec("paramserver_pushes_rejected_total", "counter",
               "pushes rejected, by reason", (*_SW, "reason")),
    MetricSpec("paramserver_pushes_downweighted_total", "counter",
               "pushes accepted with a weight below 1", _SW),
    MetricSpec("paramserver_push_weight_mean", "gauge",
               "mean learning-rate weight of the accepted pushes", _SW),
    MetricSpec("paramserver_push_grad_norm", "gauge",
               "L2 norm of the worker's last pushed gradient slice", _SW),
    MetricSpec("paramserver_push_grad_cosine", "gauge",
               "cosine of the last pushed gradient to the shard's running mean gradient", _SW),
    MetricSpec("paramserver_push_loss", "gauge", "training loss reported with the last push", _SW),
    MetricSpec("paramserver_push_seconds", "histogram",
               "server time to decide and apply a push", _SW, LATENCY_BUCKETS),
    MetricSpec("paramserver_push_bytes_total", "counter", "gradient bytes received", _SW),
    MetricSpec("paramserver_pull_seconds", "histogram",
               "pull request to reply, including time held at a barrier or gate", _SW,
               LATENCY_BUCKETS),
    MetricSpec("paramserver_pull_wait_seconds_total", "counter",
               "time pulls were held at a sync barrier or SSP gate", _SW),
    MetricSpec("paramserver_pulls_deferred_total", "counter",
               "pulls held at a sync barrier or SSP gate", _SW),
    MetricSpec("paramserver_pull_bytes_total", "counter", "weight bytes sent", _SW),
    # --- launcher: per worker, from the workers' event logs
    MetricSpec("paramserver_worker_steps_total", "counter", "pushes the worker completed",
               ("worker",)),
    MetricSpec("paramserver_worker_rejected_total", "counter",
               "pushes not accepted by every shard", ("worker",)),
    MetricSpec("paramserver_worker_loss", "gauge", "training loss of the last step", ("worker",)),
    MetricSpec("paramserver_worker_eval_loss", "gauge", "last held-out loss", ("worker",)),
    MetricSpec("paramserver_worker_eval_accuracy", "gauge", "last held-out accuracy",
               ("worker",)),
    MetricSpec("paramserver_worker_logged", "gauge",
               "last value of any other figure the worker logged (opt.log(NAME=...), "
               "opt.log(eval_NAME=...)), by the name it was logged as", ("worker", "name")),
    MetricSpec("paramserver_worker_staleness", "histogram",
               "staleness of each step as the worker saw it (max over shards)", ("worker",),
               STALENESS_BUCKETS),
    MetricSpec("paramserver_worker_push_seconds", "histogram",
               "wall time of a push to all shards", ("worker",), LATENCY_BUCKETS),
    MetricSpec("paramserver_worker_pull_seconds", "histogram",
               "wall time of a pull from all shards, waiting included", ("worker",),
               LATENCY_BUCKETS),
    MetricSpec("paramserver_worker_wait_seconds_total", "counter",
               "time held at sync barriers or SSP gates", ("worker",)),
    MetricSpec("paramserver_worker_compute_seconds_total", "counter",
               "time computing gradients", ("worker",)),
    MetricSpec("paramserver_worker_bytes_total", "counter", "bytes pulled and pushed",
               ("worker",)),
)


class Sample(TypedDict, total=False):
    """One labelled value of a snapshot: a counter's or gauge's ``value``, or a
    histogram's cumulative ``buckets`` ({"le": count}), ``count`` and ``sum``."""

    labels: Required[dict[str, str]]
    value: float
    buckets: dict[str, int]
    count: int
    sum: float


#: a registry's values by metric name (metrics without values left out)
Snapshot = dict[str, list[Sample]]


class _Hist:
    __slots__ = ("counts", "sum")

    def __init__(self, n: int) -> None:
        self.counts = [0] * (n + 1)  # one per bucket, then +Inf
        self.sum = 0.0


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else (f"{bound:g}" if bound != int(bound)
                                              else str(int(bound)))


class MetricsRegistry:
    """Values of the metrics one process exports; thread-safe."""

    def __init__(self, specs: Mapping[str, MetricSpec] | None = None) -> None:
        self.specs = dict(CATALOGUE if specs is None else specs)
        self._values: dict[str, dict[tuple[str, ...], Any]] = {n: {} for n in self.specs}
        self._lock = threading.Lock()

    def _key(self, name: str, labels: Sequence[Any]) -> tuple[str, ...]:
        spec = self.specs.get(name)
        if spec is None:
            raise ConfigError(f"metric {name!r} is not declared")
        if len(labels) != len(spec.labels):
            raise ConfigError(f"metric {name} takes labels {spec.labels}, got {tuple(labels)}")
        return tuple(str(v) for v in labels)

    def child(self, name: str, labels: Sequence[Any] = ()) -> Child:
        """A handle on one labelled value: checked once, then cheap to update (hot paths)."""
        return Child(self, name, self._key(name, labels))

    def inc(self, name: str, labels: Sequence[Any] = (), amount: float = 1.0) -> None:
        self.child(name, labels).inc(amount)

    def remove(self, name: str, labels: Sequence[Any]) -> None:
        """Drop one labelled value (e.g. of a worker no longer known)."""
        key = self._key(name, labels)
        with self._lock:
            self._values[name].pop(key, None)

    def relabel_shard(self, old: Any, new: Any) -> None:
        """Move every value labelled ``shard=old`` to ``shard=new`` (a live move
        renumbered this process's shard: its series go on under the new index)."""
        old, new = str(old), str(new)
        with self._lock:
            for name, values in self._values.items():
                if self.specs[name].labels[:1] != ("shard",):
                    continue
                for key in [k for k in values if k[0] == old]:
                    values[(new, *key[1:])] = values.pop(key)

    def set(self, name: str, labels: Sequence[Any], value: float) -> None:
        self.child(name, labels).set(value)

    def observe(self, name: str, labels: Sequence[Any], value: float) -> None:
        self.child(name, labels).observe(value)

    def get(self, name: str, labels: Sequence[Any] = ()) -> float | None:
        """A counter's or gauge's current value (None if never set)."""
        key = self._key(name, labels)
        with self._lock:
            value = self._values[name].get(key)
        return None if value is None or isinstance(value, _Hist) else float(value)

    def snapshot(self) -> Snapshot:
        """Every value, JSON-able: ``{name: [{"labels": {...}, "value": v}, ...]}``.

        Histograms give cumulative ``buckets`` ({"le": count}, as Prometheus
        does), ``count`` and ``sum`` instead of ``value``. Metrics without
        values are left out.
        """
        out: Snapshot = {}
        with self._lock:
            for name, values in self._values.items():
                if not values:
                    continue
                spec = self.specs[name]
                rows = []
                for key, value in sorted(values.items()):
                    row: Sample = {"labels": dict(zip(spec.labels, key, strict=True))}
                    if isinstance(value, _Hist):
                        cumulative: dict[str, int] = {}
                        total = 0
                        for bound, n in zip((*spec.buckets, math.inf), value.counts,
                                            strict=True):
                            total += n
                            cumulative[_le(bound)] = total
                        row["buckets"], row["count"], row["sum"] = cumulative, total, value.sum
                    else:
                        row["value"] = value
                    rows.append(row)
                out[name] = rows
        return out


class Child:
    """One labelled value of a registry's metric (see :meth:`MetricsRegistry.child`)."""

    __slots__ = ("_buckets", "_key", "_lock", "_values")

    def __init__(self, registry: MetricsRegistry, name: str, key: tuple[str, ...]) -> None:
        self._values = registry._values[name]
        self._key = key
        self._lock = registry._lock
        self._buckets = registry.specs[name].buckets

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._values[self._key] = self._values.get(self._key, 0.0) + amount

    def set(self, value: float) -> None:
        with self._lock:
            self._values[self._key] = float(value)

    def observe(self, value: float) -> None:
        buckets = self._buckets
        i = bisect.bisect_left(buckets, value)  # first bucket with value <= bound
        with self._lock:
            hist = self._values.get(self._key)
            if hist is None:
                hist = self._values[self._key] = _Hist(len(buckets))
            hist.counts[i] += 1
            hist.sum += value


def flatten(snapshot: Mapping[str, Sequence[Sample]]) -> dict[str, float]:
    """Scalars of a snapshot: ``"name/label=value,..."`` -> value; histograms give their mean."""
    out: dict[str, float] = {}
    for name, rows in snapshot.items():
        for row in rows:
            tag = ",".join(f"{k}={v}" for k, v in row["labels"].items())
            full = f"{name}/{tag}" if tag else name
            if "value" in row:
                out[full] = float(row["value"])
            elif row.get("count"):
                out[f"{full}/mean"] = float(row["sum"]) / float(row["count"])
    return out


class RegistryCollector:
    """Presents a registry to prometheus-client (a custom collector)."""

    def __init__(self, registry: MetricsRegistry) -> None:
        self.registry = registry

    def describe(self) -> list[Any]:
        return []  # values appear over time: no fixed description

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        snap = self.registry.snapshot()
        for name, rows in snap.items():
            spec = self.registry.specs[name]
            labels = list(spec.labels)
            family: Any
            if spec.kind == "counter":
                family = CounterMetricFamily(name[: -len("_total")], spec.help, labels=labels)
                for row in rows:
                    family.add_metric([row["labels"][k] for k in labels], row["value"])
            elif spec.kind == "gauge":
                family = GaugeMetricFamily(name, spec.help, labels=labels)
                for row in rows:
                    family.add_metric([row["labels"][k] for k in labels], row["value"])
            else:
                family = HistogramMetricFamily(name, spec.help, labels=labels)
                for row in rows:
                    family.add_metric([row["labels"][k] for k in labels],
                                      list(row["buckets"].items()), row["sum"])
            yield family


def _host(bind: str) -> str:
    """The interface a metrics endpoint should listen on, from a ZeroMQ bind address."""
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return "0.0.0.0" if host in ("*", "", "0.0.0.0") else host


class MetricsExporter:
    """A process's Prometheus endpoint (``/metrics``) over one registry.

    ``port=None``: no endpoint; ``0``: any free port (see :attr:`port` once
    started). The host defaults to loopback: metrics are not exposed unless the
    process binds a public interface itself.
    """

    def __init__(self, registry: MetricsRegistry, port: int | None, *,
                 host: str = "127.0.0.1", process_metrics: bool = True) -> None:
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"metrics port must be in 0..65535 (0: any free port), got {port}")
        self.registry = registry
        self.requested = port
        self.host = host
        self.process_metrics = process_metrics
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_bind(cls, registry: MetricsRegistry, port: int | None, bind: str) -> MetricsExporter:
        """An exporter on the same interface as a ZeroMQ bind address."""
        return cls(registry, port, host=_host(bind))

    def start(self) -> int | None:
        """Start serving; returns the bound port (None when no port was asked for)."""
        if self.requested is None or self._server is not None:
            return self.port
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        prom = CollectorRegistry(auto_describe=False)
        prom.register(RegistryCollector(self.registry))
        if self.process_metrics:
            ProcessCollector(registry=prom)
        try:
            self._server, self._thread = start_http_server(self.requested, self.host,
                                                           registry=prom)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {self.host}:{self.requested}: {exc}; choose another "
                "--metrics-port (0: any free port)"
            ) from exc
        self.port = int(self._server.server_port)
        log.info("metrics at http://%s:%d/metrics", self.host, self.port)
        return self.port

    @property
    def url(self) -> str | None:
        return f"http://{self.host}:{self.port}/metrics" if self.port is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> MetricsExporter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorBoardWriter:
    """Scalars of registry snapshots into a TensorBoard log directory.

    Needs the optional ``tensorboard`` package (``pip install 'paramserver[tensorboard]'``).
    """

    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "--tensorboard needs the tensorboard package, which is not installed; "
                "install the extra: pip install 'paramserver[tensorboard]'"
            ) from exc
        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir))

    def add_snapshot(self, snapshot: Mapping[str, Sequence[Sample]], step: int,
                     walltime: float | None = None) -> None:
        for tag, value in flatten(snapshot).items():
            if math.isfinite(value):
                self._writer.add_scalar(tag, value, step, walltime=walltime)

    def add_scalar(self, tag: str, value: float, step: int,
                   walltime: float | None = None) -> None:
        if math.isfinite(value):
            self._writer.add_scalar(tag, value, step, walltime=walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()




@dataclass(frozen=True)
class LoggedFigures:
    """What a worker logged in one ``step`` or ``eval`` record of its event log, by the name
    given to ``opt.log`` (``loss``, ``NAME``; ``eval_loss``, ``eval_accuracy``,
    ``eval_NAME``): the built-in loop logs through the same call."""

    worker: int
    clock: int
    t: float | None
    figures: dict[str, float]

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> LoggedFigures | None:
        """The figures of a ``step`` or ``eval`` record (None: another record, or one whose
        own fields are not what the optimizer writes: a worker id and clock that are ints,
        a finite time). Figures that are not finite numbers are left out."""
        kind = record.get("event")
        if kind not in ("step", "eval"):
            return None
        worker, clock, t = record.get("worker"), record.get("clock", 0), record.get("t")
        if not (_count(worker) and _count(clock)) or (t is not None and finite(t) is None):
            return None
        known, prefix = (STEP_FIELDS, "") if kind == "step" else (EVAL_FIELDS, "eval_")
        figures = {}
        for k, v in record.items():
            number = finite(v) if k not in known and isinstance(k, str) else None
            if number is not None:
                figures[prefix + k] = number
        assert isinstance(worker, int) and isinstance(clock, int)  # (_count said so)
        return cls(worker, clock, t, figures)


def _count(value: Any) -> bool:
    """An int >= 0 (not a bool): a worker id, a clock."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class FigureExporter:
    """The one path from what workers log to Prometheus (a registry) and TensorBoard:
    ``loss``, ``eval_loss`` and ``eval_accuracy`` have gauges of their own, every other
    figure is ``paramserver_worker_logged{name=...}``; TensorBoard's tags are
    ``NAME/worker<r>`` for training figures and ``eval/NAME`` for held-out ones, at the
    worker's clock."""

    GAUGES: ClassVar[dict[str, str]] = {
        "loss": "paramserver_worker_loss", "eval_loss": "paramserver_worker_eval_loss",
        "eval_accuracy": "paramserver_worker_eval_accuracy"}

    def __init__(self, registry: MetricsRegistry,
                 tensorboard: TensorBoardWriter | None = None) -> None:
        self.registry = registry
        self.tensorboard = tensorboard
        self._gates: dict[int, FigureGate] = {}  # per worker: names are bounded

    def export(self, logged: LoggedFigures) -> None:
        gate = self._gates.get(logged.worker)
        if gate is None:
            gate = self._gates[logged.worker] = FigureGate(f"worker {logged.worker}")
        for name, value in gate.admit(logged.figures).items():
            gauge = self.GAUGES.get(name)
            if gauge is not None:
                self.registry.set(gauge, (logged.worker,), value)
            else:
                self.registry.set("paramserver_worker_logged", (logged.worker, name), value)
            if self.tensorboard is not None:
                tag = f"eval/{name[len('eval_'):]}" if name.startswith("eval_") \
                    else f"{name}/worker{logged.worker}"
                self.tensorboard.add_scalar(tag, value, logged.clock, walltime=logged.t)
