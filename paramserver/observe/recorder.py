"""Glue between the processes and the metrics, the watchdog and the event logs.

* :class:`ShardObserver`: inside a shard server. Turns what the server and the
  core report (pushes, steps, pulls, clocks, errors) into metric updates and
  watchdog observations, writes ``alarm`` and periodic ``metrics`` events, and
  feeds TensorBoard.
* :class:`LauncherObserver`: inside the launcher. Follows every process's
  JSONL event log as it grows: worker steps become launcher metrics, server
  ``alarm`` events are handed to a callback (``paramserver launch`` prints them).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from paramserver.core.records import PushOutcome
from paramserver.core.shard import GradStats, ShardCore, StepStats
from paramserver.observe import records as ev
from paramserver.observe.events import EventLog
from paramserver.observe.figures import finite
from paramserver.observe.metrics import (
    Child,
    FigureExporter,
    LoggedFigures,
    MetricsExporter,
    MetricsRegistry,
    TensorBoardWriter,
)
from paramserver.observe.watchdog import Alarm, PushObservation, StepObservation, Watchdog
from paramserver.wire.stats import ALARMS_LISTED, LastPush, ObservedStats, StepFigures

__all__ = ["JsonlFollower", "LauncherObserver", "ShardObserver"]

log = logging.getLogger(__name__)


class ShardObserver:
    """Metrics and watchdog of one shard server. Single-threaded: the server's loop.

    Gauges and counters are held and folded into the registry (an exporter's
    scrape reads it) every FOLD_EVERY pushes and, when the loop ticks, at most
    FOLD_SECONDS apart; histograms and alarms go in at once."""

    FOLD_EVERY = 16
    FOLD_SECONDS = 0.02

    def __init__(self, shard: int, events: EventLog, watchdog: Watchdog, *,
                 registry: MetricsRegistry | None = None,
                 tensorboard: TensorBoardWriter | None = None,
                 interval: float = 10.0) -> None:
        self.shard = shard
        self.label = str(shard)
        self.events = events
        self.watchdog = watchdog
        self.registry = registry or MetricsRegistry()
        self.tensorboard = tensorboard
        self.interval = interval
        self.version = 0
        self._grad: GradStats | None = None
        self._weights: dict[int, float] = {}  # worker -> sum of accepted weights
        self._accepted: dict[int, int] = {}
        self._last_snapshot = time.monotonic()
        self.pending_alarms: list[Alarm] = []  # raised, not yet acted on by the server
        self._step = StepFigures()  # the last step's
        self._pushes = 0
        self._min_clock = -1  # as of the last full clocks() pass
        self._live_count = 0
        self._last: dict[int, LastPush] = {}  # worker -> its last push's figures
        self._children: dict[tuple[str, tuple[Any, ...]], Child] = {}
        # gauges and counters of pushes, pulls and steps, held in plain dicts and folded
        # into the registry every FOLD_EVERY pushes and at each tick of the server's
        # loop (a gauge written k times in a burst is then written once)
        self._gauges: dict[tuple[str, tuple[Any, ...]], float] = {}
        self._counts: dict[tuple[str, tuple[Any, ...]], float] = {}
        self._held = 0
        self._folded_at = time.monotonic()

    def relabel(self, shard: int) -> None:
        """A live move gave this shard another index: its metrics go on under it."""
        if shard == self.shard:
            return
        self.fold()
        self.registry.relabel_shard(self.label, shard)
        self.shard, self.label = shard, str(shard)
        self._children.clear()  # (handles hold the old key)

    def _c(self, name: str, *labels: Any) -> Child:
        """The registry's value for this shard and ``labels`` (handles cached: hot path)."""
        key = (name, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.registry.child(name, (self.label, *labels))
        return child

    def fold(self) -> None:
        """Write the held gauges and counters into the registry."""
        gauges, counts = self._gauges, self._counts
        self._gauges, self._counts, self._held = {}, {}, 0
        for (name, labels), value in gauges.items():
            self._c(name, *labels).set(value)
        for (name, labels), amount in counts.items():
            self._c(name, *labels).inc(amount)

    def _add(self, key: tuple[str, tuple[Any, ...]], amount: float = 1.0) -> None:
        self._counts[key] = self._counts.get(key, 0.0) + amount

    # ------------------------------------------------------------------ from the core

    def on_core(self, stats: GradStats | StepStats) -> None:
        """The core's observer hook."""
        if isinstance(stats, GradStats):
            self._grad = stats
            return
        self.version = stats.version
        ratio = stats.update_norm / stats.weight_norm if stats.weight_norm > 0 else 0.0
        self._step = StepFigures(stats.update_norm, stats.weight_norm, ratio, stats.lr)
        gauges = self._gauges
        gauges["paramserver_shard_version", ()] = stats.version
        gauges["paramserver_shard_lr", ()] = stats.lr
        gauges["paramserver_shard_update_norm", ()] = stats.update_norm
        gauges["paramserver_shard_weight_norm", ()] = stats.weight_norm
        gauges["paramserver_shard_update_ratio", ()] = ratio
        self._alarms(self.watchdog.observe_step(StepObservation(
            stats.version, stats.update_norm, stats.weight_norm, stats.lr)))

    # ------------------------------------------------------------------ from the server

    def push(self, core: ShardCore, worker: int, outcome: PushOutcome, *,
             loss: float | None, seconds: float, nbytes: int,
             loss_may_stop: bool = True) -> GradStats | None:
        """A decided push (not a duplicate). Returns its gradient's figures, if measured.
        ``loss_may_stop``: whether its claimed loss may stop the shard (Access.may_stop)."""
        grad, self._grad = self._grad, None
        if grad is not None and grad.worker != worker:
            grad = None
        staleness = outcome.staleness
        labels = (worker,)
        gauges = self._gauges
        self._c("paramserver_push_staleness", worker).observe(staleness)
        self._c("paramserver_push_seconds", worker).observe(seconds)
        self._add(("paramserver_push_bytes_total", labels), nbytes)
        if outcome.accepted:
            weight = outcome.weight
            self._add(("paramserver_pushes_accepted_total", labels))
            if weight < 1.0:
                self._add(("paramserver_pushes_downweighted_total", labels))
            self._accepted[worker] = self._accepted.get(worker, 0) + 1
            self._weights[worker] = self._weights.get(worker, 0.0) + weight
            gauges["paramserver_push_weight_mean", labels] = (
                self._weights[worker] / self._accepted[worker])
        else:
            # labelled as the worker's counts name it: a bounded set of reasons
            state = core.workers.get(worker)
            reason = outcome.reason or "rejected"
            self._add(("paramserver_pushes_rejected_total",
                       (worker, reason if state is None else state.reason_key(reason))))
        # a figure this push did not measure keeps its last value
        last = self._last.get(worker) or LastPush(staleness)
        norm, cosine = last.grad_norm, last.cosine
        if grad is not None:
            gauges["paramserver_push_grad_norm", labels] = norm = grad.norm
            if grad.cosine is not None:
                gauges["paramserver_push_grad_cosine", labels] = cosine = grad.cosine
        if loss is not None:
            gauges["paramserver_push_loss", labels] = loss
        self._last[worker] = LastPush(staleness, norm, cosine,
                                      last.loss if loss is None else loss)
        self._clocks_after_push(core, worker)
        alarms = self.watchdog.observe_push(PushObservation(
            worker=worker, version=outcome.version, accepted=outcome.accepted,
            staleness=staleness, reason=outcome.reason, weight=outcome.weight,
            grad_norm=grad.norm if grad is not None else None,
            cosine=grad.cosine if grad is not None else None, loss=loss,
            loss_may_stop=loss_may_stop,
        ))
        self._pushes += 1
        if self._pushes % max(1, self._live_count) == 0:  # about once a round: lags move slowly
            live = {w.worker: w.clock for w in core.workers.values()
                    if w.live and not w.finished}
            alarms += self.watchdog.observe_clocks(live, time.monotonic())
        self._alarms(alarms)
        self._held += 1
        if self._held >= self.FOLD_EVERY:
            self.fold()
        return grad

    def nonfinite(self, worker: int, loss: float | None, loss_may_stop: bool = True) -> None:
        """A push refused because its gradient held NaN or Inf."""
        self._grad = None
        self._alarms(self.watchdog.observe_push(PushObservation(
            worker=worker, version=self.version, accepted=False, reason="nonfinite",
            grad_norm=float("nan"), loss=loss, loss_may_stop=loss_may_stop)))

    def pull(self, worker: int, seconds: float, waited: float, nbytes: int) -> None:
        self._c("paramserver_pull_seconds", worker).observe(seconds)
        labels = (worker,)
        self._add(("paramserver_pull_bytes_total", labels), nbytes)
        if waited > 0:
            self._add(("paramserver_pulls_deferred_total", labels))
            self._add(("paramserver_pull_wait_seconds_total", labels), waited)

    def _clocks_after_push(self, core: ShardCore, worker: int) -> None:
        """After a push only the pusher's clock moved; the others' lags move with the minimum."""
        live = [w.clock for w in core.workers.values() if w.live and not w.finished]
        low, high = (min(live), max(live)) if live else (0, 0)
        if low != self._min_clock or len(live) != self._live_count:
            self.clocks(core)
            return
        clock = core.workers[worker].clock
        self.version = core.version
        gauges = self._gauges
        gauges["paramserver_shard_version", ()] = core.version
        gauges["paramserver_shard_clock_gap", ()] = high - low
        gauges["paramserver_clock", (worker,)] = clock
        gauges["paramserver_clock_lag", (worker,)] = clock - low

    def clocks(self, core: ShardCore) -> None:
        """Clocks, lags and liveness of every known worker (one pass over the workers)."""
        self.version = core.version
        live = [w for w in core.workers.values() if w.live and not w.finished]
        low = min((w.clock for w in live), default=0)
        high = max((w.clock for w in live), default=0)
        self._min_clock, self._live_count = low, len(live)
        gauges = self._gauges
        gauges["paramserver_shard_version", ()] = core.version
        gauges["paramserver_shard_min_clock", ()] = low
        gauges["paramserver_shard_clock_gap", ()] = high - low
        gauges["paramserver_shard_live_workers", ()] = len(live)
        for w in core.workers.values():
            is_live = w.live and not w.finished
            labels = (w.worker,)
            gauges["paramserver_clock", labels] = w.clock
            gauges["paramserver_clock_lag", labels] = w.clock - low if is_live else 0
            gauges["paramserver_live", labels] = 1 if is_live else 0

    def forget(self, known: set[int]) -> None:
        """Drop the figures of workers that are no longer in the shard's table (evicted),
        so that labels do not pile up with every worker id ever seen."""
        self.fold()  # (what is held for them must not bring their labels back)
        for key in [k for k in self._children
                    if k[1] and isinstance(k[1][0], int) and k[1][0] not in known]:
            name, labels = key
            del self._children[key]
            self.registry.remove(name, (self.label, *labels))
        for table in (self._accepted, self._weights, self._last):
            for worker in [w for w in table if w not in known]:
                del table[worker]

    def left(self, core: ShardCore, worker: int) -> None:
        """A worker said BYE or was declared dead."""
        self.watchdog.forget(worker)
        self.clocks(core)

    def error(self, code: str) -> None:
        self._c("paramserver_shard_errors_total", code).inc()

    # ------------------------------------------------------------------ alarms and snapshots

    def _alarms(self, alarms: list[Alarm]) -> None:
        for hint in self.watchdog.take_hints():  # informational: logged, never acted on
            log.info("HINT %s", hint.message)
            self.events.write(hint.as_event(ev.Hint))
        for alarm in alarms:
            log.warning("ALARM %s", alarm.message)
            self._c("paramserver_alarms_total", alarm.signal).inc()
            self.events.write(alarm.as_event(ev.Alarm))
            self.pending_alarms.append(alarm)
        if alarms:
            self.events.flush()  # the launcher tails this log: show alarms at once

    def summary(self) -> ObservedStats:
        """The last figures, for STATS (``paramserver status``)."""
        return ObservedStats(
            self._step, {str(w): v for w, v in self._last.items()},
            [a.entry() for a in self.watchdog.alarms[-ALARMS_LISTED:]],
            len(self.watchdog.alarms))

    def raise_alarm(self, alarm: Alarm) -> None:
        """An alarm from the server itself (not a watchdog rule), e.g. a failure in
        its periodic work: logged, counted, in the event log, acted on as any other."""
        self.watchdog.alarms.append(alarm)
        self._alarms([alarm])

    def take_alarms(self) -> list[Alarm]:
        alarms, self.pending_alarms = self.pending_alarms, []
        return alarms

    def tick(self, now: float, force: bool = False) -> None:
        """Held metrics into the registry, at most every FOLD_SECONDS between
        FOLD_EVERY pushes; every ``interval`` seconds (or when forced): a
        ``metrics`` event and TensorBoard."""
        if (self._gauges or self._counts) and (force or now - self._folded_at
                                               >= self.FOLD_SECONDS):
            self._folded_at = now
            self.fold()
        if not force and now - self._last_snapshot < self.interval:
            return
        self._last_snapshot = now
        snapshot = self.registry.snapshot()
        self.events.write(ev.ShardMetrics(shard=self.shard, version=self.version,
                                          metrics=snapshot))
        if self.tensorboard is not None:
            self.tensorboard.add_snapshot(snapshot, self.version)
            self.tensorboard.flush()

    def close(self) -> None:
        self.tick(time.monotonic(), force=True)
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


class JsonlFollower:
    """Reads the records appended to a JSONL file since the last call."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a torn last line waits for the next call
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


class LauncherObserver:
    """The launcher's view of a run: its metrics endpoint, its event log, the alarms.

    ``poll()`` reads what every process appended to its event log since the
    last call (``events/server*.jsonl``, ``events/worker*.jsonl``).
    """

    def __init__(self, out_dir: str | Path, *, metrics_port: int | None = None,
                 tensorboard: str | None = None,
                 on_alarm: Callable[[dict[str, Any]], None] | None = None,
                 interval: float = 10.0) -> None:
        self.out = Path(out_dir)
        self.events_dir = self.out / "events"
        self.registry = MetricsRegistry()
        self.exporter = MetricsExporter(self.registry, metrics_port)
        self.tensorboard = TensorBoardWriter(Path(tensorboard) / "launcher") if tensorboard \
            else None
        self.events = EventLog(self.events_dir / "launcher.jsonl")
        self.figures = FigureExporter(self.registry, self.tensorboard)
        self.on_alarm = on_alarm
        self.interval = interval
        self.alarms: list[dict[str, Any]] = []
        self.diverged: list[dict[str, Any]] = []
        self._followers: dict[str, JsonlFollower] = {}
        self._last_snapshot = time.monotonic()
        self._steps = 0
        self._malformed: set[str] = set()  # logs that held records skipped (warned once)
        self._closed = False

    def start(self, **fields: Any) -> int | None:
        """Start the endpoint and write ``launcher_start``; returns the metrics port."""
        port = self.exporter.start()
        self.events.write(ev.LauncherStart(metrics_port=port, **fields))
        self.events.flush()
        return port

    def poll(self) -> list[dict[str, Any]]:
        """Take in new records; returns the new alarms (already passed to ``on_alarm``)."""
        new_alarms: list[dict[str, Any]] = []
        for path in sorted(self.events_dir.glob("*.jsonl")):
            name = path.stem
            if name == "launcher":
                continue
            follower = self._followers.get(name)
            if follower is None:
                follower = self._followers[name] = JsonlFollower(path)
            for rec in follower.read():
                if not isinstance(rec, dict):
                    continue
                kind = rec.get("event")
                if kind in ("step", "eval"):
                    self._worker_record(name, rec)
                elif kind == "alarm":
                    rec = {**rec, "process": name}
                    self.alarms.append(rec)
                    new_alarms.append(rec)
                    self.registry.inc("paramserver_alarms_total",
                                      ("" if rec.get("shard") is None else rec["shard"],
                                       rec.get("signal", "")))
                elif kind == "diverged":
                    self.diverged.append({**rec, "process": name})
        for rec in new_alarms:
            try:
                self.events.write(msgspec.convert(rec, ev.LauncherAlarm))
            except msgspec.ValidationError as exc:  # (a shard's alarm is never that)
                log.warning("an alarm record the launcher cannot repeat: %s", exc)
            if self.on_alarm is not None:
                self.on_alarm(rec)
        self.tick(time.monotonic())
        return new_alarms

    def _worker_record(self, process: str, rec: Mapping[str, Any]) -> None:
        """A worker's ``step`` or ``eval`` record. A worker's log is written by the user's
        script, so nothing in it may raise here: a record whose own fields are not what
        the optimizer writes, or that names another worker than its file's, is skipped
        (one warning), and the figures in it pass the rule of observe/figures.py."""
        logged = LoggedFigures.of(rec)
        if logged is None or process != f"worker{logged.worker}":
            if process not in self._malformed:
                self._malformed.add(process)
                log.warning("%s.jsonl: skipping step and eval records that are not the "
                            "optimizer's (worker id, clock, time), e.g. %.200r", process, rec)
            return
        if rec.get("event") == "step":
            self._step(logged.worker, rec)
        self.figures.export(logged)

    def _step(self, worker: int, rec: Mapping[str, Any]) -> None:
        r, w = self.registry, (worker,)

        def figure(name: str) -> float:
            return max(0.0, finite(rec.get(name, 0)) or 0.0)

        self._steps += 1
        r.inc("paramserver_worker_steps_total", w)
        if rec.get("accepted", True) is False:
            r.inc("paramserver_worker_rejected_total", w)
        r.observe("paramserver_worker_staleness", w, figure("staleness"))
        r.observe("paramserver_worker_push_seconds", w, figure("push_s"))
        r.observe("paramserver_worker_pull_seconds", w, figure("pull_s"))
        r.inc("paramserver_worker_wait_seconds_total", w, figure("wait_s"))
        r.inc("paramserver_worker_compute_seconds_total", w, figure("compute_s"))
        r.inc("paramserver_worker_bytes_total", w, figure("bytes"))

    def tick(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_snapshot < self.interval:
            return
        self._last_snapshot = now
        snapshot = self.registry.snapshot()
        self.events.write(ev.LauncherMetrics(steps=self._steps, metrics=snapshot))
        self.events.flush()
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self, **fields: Any) -> None:
        """Read what is left, write the last snapshot and ``launcher_end``, stop serving."""
        if self._closed:
            return
        self._closed = True
        self.poll()
        self.tick(time.monotonic(), force=True)
        self.events.write(ev.LauncherEnd(alarms=len(self.alarms), **fields))
        self.events.close()
        self.exporter.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
