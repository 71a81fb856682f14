"""Terminal tables never cut a figure or an address (issue 15: the simulate summary
showed ``320...`` and ``nev...`` at 80 columns, ``status --watch`` cut addresses at
120). Rendered to a rich Console of that width; nothing is started."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from msgspec.structs import replace
from rich.console import Console
from rich.table import Table

from paramserver.cli.grid import print_summary
from paramserver.cli.statusview import render
from paramserver.cli.tables import keep_figures
from paramserver.cli.watch import render_status
from paramserver.wire.stats import ObservedStats, ShardStats, StepFigures
from paramserver.workers.experiments.index import ConfigEntry
from paramserver.workers.experiments.report import ConfigSummary, ReportFiles, Stat
from tests.stats_fixture import shard_stats as record
from tests.stats_fixture import worker_stats


def console(width: int) -> Console:
    return Console(width=width, file=io.StringIO(), record=True, color_system=None)


def text_of(out: Console) -> str:
    return out.export_text()


def stat(value: float, n: int = 3, missing: int = 0) -> Stat:
    return Stat(value, value, value, n, missing)


def summary(label: str, *, target: Stat, rate: float, wait: float) -> ConfigSummary:
    stats = {"time_to_target": target, "final_accuracy": stat(0.9213),
             "updates_per_s": stat(rate), "pct_rejected": stat(12.5),
             "staleness_p95": stat(17), "max_clock_gap": stat(3), "wait_s": stat(wait)}
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label)  # a cell's id names its folder
    return ConfigSummary(ConfigEntry(id=slug, scenario="transient", label=label, mode="async",
                                     workers=2), [], [], stats)


@pytest.mark.parametrize("width", [80, 100])
def test_summary_table_keeps_every_figure(width: int) -> None:
    summaries = [
        summary("ssp:3 · reject:max_staleness=4 · 64 workers", target=stat(320.44),
                rate=3201.53, wait=1234.567),
        summary("sync:b=1,lr=linear,warmup=10 · none · 64 workers",
                target=stat(float("inf"), n=0, missing=3), rate=120.3, wait=9.87),
        summary("async · dc-asgd:lam=0.1 · 64 workers", target=stat(51.2, n=2, missing=1),
                rate=98765.4, wait=0.0),
    ]
    files = ReportFiles(Path("r.md"), Path("r.html"), [], summaries, [])
    out = console(width)
    print_summary(out, files)
    text = text_of(out)
    assert "…" not in text and "..." not in text
    assert max(len(line) for line in text.splitlines()) <= width
    shown_or_named(text, {
        "to target (s)": ["320.4", "never", "51.2 (2/3 reached)"], "acc. (%)": ["92.1"],
        "upd/s": ["3201.5", "120.3", "98765.4"], "rej. (%)": ["12.5"], "stale p95": ["17"],
        "wait (s)": ["1234.57", "9.87", "0.00"]}, always=["to target (s)", "upd/s"])


def shown_or_named(text: str, columns: dict[str, list[str]], always: list[str]) -> None:
    """Each column's figures appear whole, or the note under its table names it."""
    notes = " ".join(re.findall(r"left out at .*? shows them\)", " ".join(text.split())))
    for header, figures in columns.items():
        if header in always or header not in notes:
            for figure in figures:
                assert figure in text, (header, figure, text)


def shard_stats(shard: int, workers: int) -> ShardStats:
    rows = {str(w): worker_stats(w, clock=98765 + w, applied=123456, rejected={"stale": 42},
                                 staleness={"0": 10, "3": 5}, staleness_sum=15,
                                 staleness_max=3, pushes=123500, wait_seconds=12.25,
                                 mean_weight=0.75,
                                 host=f"gpu-node-{w:02d}.cluster.example.org", pid=4000000 + w)
            for w in range(workers)}
    return record(shard, rows, mode="ssp", policy="gap-aware", version=1234567 + shard,
                  min_clock=98765, clock_gap=3, pending_pulls=2,
                  observed=ObservedStats(StepFigures(None, 45.6, 0.00123, 0.1)))


ADDRESSES = [f"tcp://[2001:db8:85a3::8a2e:370:{7000 + i}]:56{i:03d}" for i in range(3)]


@pytest.mark.parametrize("width", [120, 80])
def test_status_keeps_addresses_and_figures(width: int) -> None:
    stats = [shard_stats(i, 4) for i in range(3)]
    out = console(width)
    out.print(render(ADDRESSES, list(stats), [], out))
    text = text_of(out)
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width
    for address in ADDRESSES:
        assert address in text, (address, text)
    shown_or_named(text, {"version": ["1234567", "1234569"], "applied": ["493824"],
                          "host:pid": ["gpu-node-03.cluster.example.org:4000003"],
                          "min clock": ["98765"], "rejected": ["168"]},
                   always=["version", "host:pid"])


def test_watch_view_keeps_figures() -> None:
    out = console(120)
    out.print(render_status([shard_stats(i, 2) for i in range(2)], console=out))
    text = text_of(out)
    assert "…" not in text, text
    assert "gpu-node-01.cluster.example.org:4000001" in text and "1234568" in text
    assert "left out at 120 characters wide: grad norm, cosine, loss, waited s" in text
    assert "1 in" not in text  # both shards measure every push


def test_watch_view_shows_a_shard_sampling_its_pushes() -> None:
    out = console(160)
    stats = [shard_stats(0, 2), replace(shard_stats(1, 2), measured_one_in=8)]
    out.print(render_status(stats, console=out))
    assert "1 in 8" in text_of(out)


def test_wide_console_leaves_headers_on_one_line() -> None:
    """Only a table too wide for the console gives up room in its figure columns."""
    table = Table()
    table.add_column("name")
    table.add_column("updates per second", justify="right")
    table.add_row("sync", "12.5")
    out = console(120)
    out.print(keep_figures(table, out))
    assert "updates per second" in text_of(out)
    assert "left out" not in text_of(out)
