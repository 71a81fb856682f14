"""Rendering for the live views: ``paramserver status --watch`` and alarms in ``launch``.

Pure presentation over STATS replies (``paramserver.workers.client.server_stats``) and
alarm records (``alarm`` events); the commands own the options and the loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .tables import keep_figures

__all__ = ["format_alarm", "health_table", "render_status", "watch_status", "worker_table"]


def _num(value: Any, fmt: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, fmt)


def _staleness(r: Mapping[str, Any]) -> tuple[float | None, int | None]:
    """(mean, max) staleness of a worker row: exact from the shards' sums and maxima,
    else (older servers) from the ``{tau: count}`` histogram."""
    hist: Mapping[str, int] = r["stale"]
    total = sum(hist.values())
    if not total:
        return None, None
    if r["stale_exact"]:
        return r["stale_sum"] / total, r["stale_max"]
    # keys are exact values, or (bucketed, records.staleness_bucket) a bucket's lower bound
    return sum(int(t) * n for t, n in hist.items()) / total, max(int(t) for t in hist)


def _measured(one_in: Any) -> Text:
    if not isinstance(one_in, int) or one_in <= 1:
        return Text("all")
    return Text(f"1 in {one_in}", style="yellow")


def health_table(stats: Sequence[Mapping[str, Any]]) -> Table:
    """Per shard: version, clocks and what the last optimizer step did to the weights."""
    table = Table(title="per shard: the last step", title_justify="left", expand=False)
    for col in ("shard", "mode", "version", "live", "min clock", "gap", "lr",
                "update/weight", "weight norm", "measured", "alarms"):
        table.add_column(col, justify="left" if col in ("mode",) else "right")
    for s in stats:
        if "error" in s:
            table.add_row(str(s.get("shard", "?")), Text(s["error"], style="red"),
                          *["-"] * 9)
            continue
        step = s.get("observed", {}).get("step", {})
        alarms = s.get("observed", {}).get("alarm_count", 0)
        table.add_row(
            str(s.get("shard")), str(s.get("mode", "")), str(s.get("version", 0)),
            str(len(s.get("live_workers", []))), str(s.get("min_clock", "-")),
            str(s.get("clock_gap", "-")), _num(step.get("lr", s.get("lr"))),
            _num(step.get("update_ratio")), _num(step.get("weight_norm", s.get("weight_norm"))),
            # pushes measured in full: all, or one in N per worker (observe_budget)
            _measured(s.get("measured_one_in")),
            Text(str(alarms), style="bold red" if alarms else ""),
        )
    return table


def _worker_rows(stats: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per worker, figures combined over shards (a gradient's norm over all its slices)."""
    rows: dict[int, dict[str, Any]] = {}
    for s in stats:
        if "error" in s:
            continue
        observed = s.get("observed", {}).get("workers", {})
        for key, w in s.get("workers", {}).items():
            r = rows.setdefault(int(key), {"clock": 0, "lag": 0, "pushes": 0, "applied": 0,
                                           "rejected": 0, "stale": {}, "stale_sum": 0,
                                           "stale_max": 0, "stale_exact": True, "grad_sq": 0.0,
                                           "cosines": [], "loss": None, "wait": 0.0,
                                           "live": True, "weight": [], "where": set()})
            r["clock"] = max(r["clock"], w.get("clock", 0))
            if w.get("pid") is not None:  # older servers do not know it
                r["where"].add(f"{w.get('host') or '?'}:{w['pid']}")
            if w.get("live", True) and not w.get("finished", False):
                r["lag"] = max(r["lag"], w.get("clock", 0) - s.get("min_clock", 0))
            else:
                r["live"] = False
            r["pushes"] = max(r["pushes"], w.get("pushes", 0))
            r["applied"] += w.get("applied", 0)
            r["rejected"] += sum(w.get("rejected", {}).values())
            r["wait"] += w.get("wait_seconds", 0.0)
            if w.get("applied"):
                r["weight"].append(w.get("mean_weight", 1.0))
            for tau, n in w.get("staleness", {}).items():
                r["stale"][tau] = r["stale"].get(tau, 0) + n
            if "staleness_sum" in w:
                r["stale_sum"] += w["staleness_sum"]
                r["stale_max"] = max(r["stale_max"], w.get("staleness_max", 0))
            else:
                r["stale_exact"] = False
            o = observed.get(key, {})
            if o.get("grad_norm") is not None:
                r["grad_sq"] += o["grad_norm"] ** 2
            if o.get("cosine") is not None:
                r["cosines"].append(o["cosine"])
            if o.get("loss") is not None:
                r["loss"] = o["loss"]
    return rows


def worker_table(stats: Sequence[Mapping[str, Any]]) -> Table:
    """Per worker, over all shards: clock, lag, staleness, counts, gradient, loss."""
    table = Table(title="workers (over all shards)", title_justify="left")
    for col in ("worker", "host:pid", "live", "clock", "lag", "staleness mean/max", "applied",
                "rejected", "mean weight", "grad norm", "cosine", "loss", "waited s"):
        table.add_column(col, justify="left" if col == "host:pid" else "right")
    for worker, r in sorted(_worker_rows(stats).items()):
        mean, high = _staleness(r)
        cosine = sum(r["cosines"]) / len(r["cosines"]) if r["cosines"] else None
        weight = sum(r["weight"]) / len(r["weight"]) if r["weight"] else None
        # shards that disagree (one saw the worker before a restart) show both
        table.add_row(
            str(worker), " ".join(sorted(r["where"])) or "-",
            "yes" if r["live"] else Text("no", style="dim"), str(r["clock"]),
            str(r["lag"]), f"{_num(mean, '.2f')}/{_num(high, 'd')}", str(r["applied"]),
            Text(str(r["rejected"]), style="yellow" if r["rejected"] else ""),
            _num(weight, ".2f"), _num(math.sqrt(r["grad_sq"]) if r["grad_sq"] else None),
            Text(_num(cosine, ".2f"), style="red" if cosine is not None and cosine < 0 else ""),
            _num(r["loss"], ".4g"), _num(r["wait"], ".1f"),
        )
    return table


def format_alarm(alarm: Mapping[str, Any]) -> Text:
    """One alarm (an ``alarm`` event or STATS entry) as a red line for the console."""
    return Text.assemble(("ALARM ", "bold red"), (str(alarm.get("message", alarm)), "red"))


def render_status(stats: Sequence[Mapping[str, Any]], *, alarms: int = 5,
                  title: str = "", console: Console | None = None) -> Group:
    """Shards, workers and the latest alarms of a run, from each shard's STATS reply;
    with ``console``, tables fitted to its width without cutting a figure."""
    parts: list[Any] = []
    if title:
        parts.append(Text(title, style="bold"))
    tables = [health_table(stats), worker_table(stats)]
    parts += [keep_figures(t, console, whole=("host:pid",)) for t in tables] if console \
        else tables
    recent = [a for s in stats for a in s.get("observed", {}).get("alarms", [])]
    if recent:
        parts.append(Text("latest alarms", style="bold"))
        parts += [format_alarm(a) for a in recent[-alarms:]]
    return Group(*parts)


def watch_status(fetch: Callable[[], list[dict[str, Any]]], *, interval: float = 1.0,
                 count: int | None = None, console: Console | None = None) -> None:
    """Redraw :func:`render_status` every ``interval`` seconds until Ctrl-C (or ``count``
    refreshes). ``fetch`` returns the STATS replies; a failure shows as the title."""
    console = console or Console()
    done = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while count is None or done < count:
                stamp = time.strftime("%H:%M:%S")
                try:
                    stats = fetch()
                    live.update(render_status(stats, title=f"paramserver status  {stamp}",
                                              console=console), refresh=True)
                except Exception as exc:  # a shard down must not end the view
                    live.update(Text(f"{stamp}  cannot reach the servers: {exc}", style="red"),
                                refresh=True)
                done += 1
                if count is None or done < count:
                    time.sleep(interval)  # the refresh period of the view
        except KeyboardInterrupt:
            pass
