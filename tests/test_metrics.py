"""The metrics registry, its Prometheus endpoint (HTTP on loopback) and the catalogue's docs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from paramserver.errors import ConfigError
from paramserver.observe.metrics import (
    CATALOGUE,
    MetricsExporter,
    MetricSpec,
    MetricsRegistry,
    TensorBoardWriter,
    flatten,
)
from paramserver.observe.watchdog import SIGNALS, WatchdogConfig
from tests.observability_fixture import scrape

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_registry_snapshot_counters_gauges_histograms():
    reg = MetricsRegistry()
    reg.inc("paramserver_pushes_accepted_total", (0, 1))
    reg.inc("paramserver_pushes_accepted_total", (0, 1), 2)
    reg.set("paramserver_shard_version", (0,), 7)
    for tau in (0, 0, 1, 3, 2000):
        reg.observe("paramserver_push_staleness", (0, 1), tau)
    snap = reg.snapshot()
    assert snap["paramserver_pushes_accepted_total"] == [
        {"labels": {"shard": "0", "worker": "1"}, "value": 3.0}]
    assert snap["paramserver_shard_version"][0]["value"] == 7.0
    hist = snap["paramserver_push_staleness"][0]
    assert hist["count"] == 5 and hist["sum"] == 2004
    assert hist["buckets"]["0"] == 2 and hist["buckets"]["1"] == 3
    assert hist["buckets"]["2"] == 3 and hist["buckets"]["3"] == 4
    assert hist["buckets"]["1024"] == 4 and hist["buckets"]["+Inf"] == 5
    assert reg.get("paramserver_pushes_accepted_total", (0, 1)) == 3.0
    assert "paramserver_clock" not in snap  # never set: not exported
    flat = flatten(snap)
    assert flat["paramserver_shard_version/shard=0"] == 7.0
    assert flat["paramserver_push_staleness/shard=0,worker=1/mean"] == pytest.approx(400.8)


def test_registry_refuses_undeclared_metrics_and_wrong_labels():
    reg = MetricsRegistry()
    with pytest.raises(ConfigError, match="not declared"):
        reg.inc("paramserver_nope_total")
    with pytest.raises(ConfigError, match="takes labels"):
        reg.set("paramserver_shard_version", (0, 1), 1)
    with pytest.raises(ConfigError, match="_total"):
        MetricSpec("x_total", "gauge", "h")


def test_prometheus_endpoint_serves_the_snapshot():
    reg = MetricsRegistry()
    reg.inc("paramserver_pushes_rejected_total", (1, 2, "too stale"), 4)
    reg.set("paramserver_shard_update_ratio", (1,), 0.25)
    for tau in (0, 1, 1, 5):
        reg.observe("paramserver_push_staleness", (1, 2), tau)
    with MetricsExporter(reg, 0) as exporter:
        assert exporter.port and exporter.port > 0
        got = scrape(exporter.url)
    key = ("paramserver_pushes_rejected_total",
           (("reason", "too stale"), ("shard", "1"), ("worker", "2")))
    assert got[key] == 4.0
    assert got[("paramserver_shard_update_ratio", (("shard", "1"),))] == 0.25
    bucket = "paramserver_push_staleness_bucket"
    labels = (("shard", "1"), ("worker", "2"))
    assert got[(bucket, (("le", "1"), *labels))] == 3.0
    assert got[(bucket, (("le", "+Inf"), *labels))] == 4.0
    assert got[("paramserver_push_staleness_count", labels)] == 4.0


def test_exporter_without_port_serves_nothing_and_a_busy_port_is_a_config_error():
    reg = MetricsRegistry()
    assert MetricsExporter(reg, None).start() is None
    with MetricsExporter(reg, 0) as first, pytest.raises(ConfigError, match="--metrics-port"):
        MetricsExporter(reg, first.port).start()
    with pytest.raises(ConfigError):
        MetricsExporter(reg, 70000)


def test_tensorboard_writer_names_the_extra_or_writes_scalars(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"paramserver\[tensorboard\]"):
            TensorBoardWriter(tmp_path)
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reg = MetricsRegistry()
    reg.set("paramserver_shard_version", (0,), 3)
    writer = TensorBoardWriter(tmp_path)
    writer.add_snapshot(reg.snapshot(), step=3)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.value for e in acc.Scalars("paramserver_shard_version/shard=0")] == [3.0]


def test_every_metric_and_signal_is_documented():
    text = (DOCS / "observability.md").read_text()
    documented = set(re.findall(r"`(paramserver_[a-z_]+)`", text))
    assert set(CATALOGUE) <= documented, set(CATALOGUE) - documented
    assert documented <= set(CATALOGUE), documented - set(CATALOGUE)
    for signal in SIGNALS:
        assert f"`{signal}`" in text, signal
    for option in dataclasses.fields(WatchdogConfig):
        assert f"`{option.name}`" in text, option.name


def test_watch_status_redraws_and_survives_an_unreachable_server():
    import io

    from rich.console import Console

    from paramserver.cli.watch import watch_status
    from paramserver.wire.stats import AlarmEntry, LastPush, ObservedStats, StepFigures
    from tests.stats_fixture import shard_stats, worker_stats

    row = worker_stats(0, clock=3, pushes=3, applied=3, mean_weight=1.0,
                       staleness={"0": 2, "2": 1}, staleness_sum=2, staleness_max=2)
    alarm = AlarmEntry("zero_gradient", 0, 0, 3, {}, "[zero_gradient] shard 0, worker 0: x")
    stats = [shard_stats(0, {"0": row}, version=7, min_clock=3, observed=ObservedStats(
        StepFigures(None, 2.0, 0.01, 0.1), {"0": LastPush(0, 0.5, 0.3, 1.25)}, [alarm], 1))]

    def down():
        raise RuntimeError("shard 0 at tcp://x did not answer")

    views = []
    for fetch in (lambda: stats, down):
        out = io.StringIO()  # not a terminal: the view's last frame is what remains
        watch_status(fetch, interval=0.0, count=2, console=Console(file=out, width=160))
        views.append(out.getvalue())
    assert "0.67/2" in views[0]  # staleness mean/max
    assert "1.25" in views[0] and "[zero_gradient] shard 0, worker 0" in views[0]
    assert "cannot reach the servers: shard 0 at tcp://x did not answer" in views[1]


def test_a_renumbered_shard_s_series_go_on_under_its_new_index():
    """A live move gives a shard process another index: its series move with it (the
    counters keep counting), and nothing stays under the old one."""
    from paramserver.observe.events import EventLog
    from paramserver.observe.recorder import ShardObserver
    from paramserver.observe.watchdog import Watchdog

    obs = ShardObserver(2, EventLog(None), Watchdog(2, WatchdogConfig(), bounded_lag=False))
    reg = obs.registry
    reg.inc("paramserver_pushes_accepted_total", (2, 0), 5)
    reg.set("paramserver_shard_version", (2,), 9)
    obs._add(("paramserver_pushes_accepted_total", (0,)), 1)  # held, not yet folded
    obs.relabel(1)
    obs._add(("paramserver_pushes_accepted_total", (0,)), 1)
    obs.fold()
    snap = reg.snapshot()
    assert snap["paramserver_pushes_accepted_total"] == [
        {"labels": {"shard": "1", "worker": "0"}, "value": 7.0}]
    assert snap["paramserver_shard_version"] == [{"labels": {"shard": "1"}, "value": 9.0}]
    obs.relabel(1)  # the same index: nothing moves
    assert reg.snapshot() == snap
