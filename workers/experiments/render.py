"""Rendering of an experiment report: tables, matplotlib figures, Markdown and HTML.

Called by :func:`paramserver.workers.experiments.report.write_report`; it only formats what
:mod:`paramserver.workers.experiments.report` computed. Figures use matplotlib's object API with the
Agg canvas, so no global pyplot state or display is involved.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from paramserver.util.jsontypes import JSONObject
from paramserver.workers.experiments import plots
from paramserver.workers.experiments.index import (
    DEFAULT_NAME,
    EnvironmentInfo,
    ExperimentIndex,
    inside,
)
from paramserver.workers.experiments.plots import MODE_STYLES, Color, mode_style
from paramserver.workers.experiments.plots import band as _band
from paramserver.workers.experiments.plots import save as _save

if TYPE_CHECKING:
    from paramserver.workers.experiments.index import ScenarioEntry
    from paramserver.workers.experiments.report import ClaimCheck, ConfigSummary, Stat
    from paramserver.workers.stragglers import StragglerSpec

__all__ = ["DYNAMICS_COLUMNS", "MODE_STYLES", "OUTCOME_COLUMNS", "TABLE_COLUMNS", "Column",
           "LossFrame", "loss_figure", "loss_frame", "mode_style", "render_report",
           "summary_rows", "table_rows"]

#: ("h1"|"h2"|"h3"|"p"|"ul"|"code", text) | ("table", head, rows, html head) |
#: ("legend", text): HTML only | ("img", path, alt)
Block = tuple[Any, ...]


@dataclass(frozen=True)
class Column:
    """A column of the per-scenario tables (docs/experiments.md defines each)."""

    title: str  # report.md's header
    short: str  # report.html's header, "\n" a line break: a narrow column, named in a legend
    stat: str  # the Stat's name in ConfigSummary.stats ("staleness": p50/p95/max)
    pattern: str  # format of its values ("pct": a fraction shown in %)


#: what each configuration achieved: its progress to the target, where it ended, how fast
OUTCOME_COLUMNS: tuple[Column, ...] = (
    Column("time to target (s)", "to target\n(s)", "time_to_target", "{:.1f}"),
    Column("updates to target", "updates\nto target", "updates_to_target", "{:.0f}"),
    Column("final held-out loss", "final\nloss", "final_loss", "{:.3f}"),
    Column("final accuracy (%)", "final\nacc. (%)", "final_accuracy", "pct"),
    Column("gradients to target", "gradients\nto target", "gradients_to_target", "{:.0f}"),
    Column("updates/s", "updates/s", "updates_per_s", "{:.1f}"),
    Column("gradients/s", "gradients/s", "gradients_per_s", "{:.1f}"),
    Column("training (s)", "training\n(s)", "train_seconds", "{:.1f}"),
    Column("bytes communicated per worker (MB)", "MB per\nworker", "bytes_per_worker", "MB"),
    Column("communication rounds", "comm.\nrounds", "rounds", "{:.0f}"),
)
#: how the run went: rates while all trained, idling, rejections, staleness, gates
DYNAMICS_COLUMNS: tuple[Column, ...] = (
    Column("updates/s, all active", "updates/s\nall active", "active_updates_per_s", "{:.1f}"),
    Column("gradients/s, all active", "grad./s\nall active", "active_gradients_per_s",
           "{:.1f}"),
    Column("idle (s/worker) mean", "idle (s)\nmean", "idle_s", "{:.2f}"),
    Column("idle (s) max", "idle (s)\nmax", "idle_max_s", "{:.2f}"),
    Column("rejected (%)", "rejected\n(%)", "pct_rejected", "{:.1f}"),
    Column("staleness p50/p95/max", "staleness\np50/p95/max", "staleness", ""),
    Column("max clock gap", "max clock\ngap", "max_clock_gap", "{:.0f}"),
    Column("waiting (s/worker)", "waiting\n(s/worker)", "wait_s", "{:.2f}"),
    Column("bytes pushed per worker (MB)", "MB pushed\nper worker", "push_bytes_per_worker",
           "MB"),
    Column("bytes pulled per worker (MB)", "MB pulled\nper worker", "pull_bytes_per_worker",
           "MB"),
)
#: (column title, stat name, format) of both tables, outcome first
TABLE_COLUMNS: list[tuple[str, str, str]] = [
    (c.title, c.stat, c.pattern) for c in OUTCOME_COLUMNS + DYNAMICS_COLUMNS]


def _fmt(stat: Stat, pattern: str, spread: bool = True, never: str = "not reached") -> str:
    if stat.n == 0:
        return never if stat.missing else "—"
    scale = {"pct": 100.0, "MB": 1e-6}.get(pattern, 1.0)
    pattern = {"pct": "{:.1f}", "MB": "{:.3g}"}.get(pattern, pattern)
    text = never if math.isinf(stat.median) else pattern.format(stat.median * scale)
    low, high = pattern.format(stat.low * scale), pattern.format(stat.high * scale)
    if spread and stat.n + stat.missing > 1 and low != high:
        text += f" [{low}-{high}]"
    if stat.missing:
        text += f" ({stat.n}/{stat.n + stat.missing} reached)"
    return text


def _staleness(s: ConfigSummary) -> str:
    p50, p95, mx = (s.stats[k] for k in ("staleness_p50", "staleness_p95", "staleness_max"))
    if p50.n == 0:
        return "—"
    return f"{p50.median:g} / {p95.median:g} / {mx.median:g}"


def _step_settings(summaries: Sequence[ConfigSummary]) -> str:
    """What each configuration ran with: learning-rate rule, warmup, momentum."""
    parts = []
    for s in summaries:
        c = s.config
        if c.lr_scaling is None:
            continue  # an experiment from before these settings were recorded
        text = f"lr scaling {c.lr_scaling}"
        if c.warmup_steps:
            text += f", warmup {c.warmup_steps} steps"
        text += f", momentum {c.momentum or 0:g}"
        if c.momentum_target is not None:
            text += f" set per step for a total of {c.momentum_target:g} (asynchrony-aware)"
        parts.append(f"{s.label}: {text}")
    return ("Step-size rules: " + "; ".join(parts) + ".") if parts else ""


#: the columns of the final figures, and how a cell says they are not the final weights'
FINAL_STATS = ("final_loss", "final_accuracy")
IN_LOOP = " (last in-loop evaluation)"


def _final_cell(s: ConfigSummary, stat: str, text: str) -> str:
    """``text``, labelled where a run's final figures are its last in-loop evaluation."""
    return text + IN_LOOP if stat in FINAL_STATS and s.final_in_loop and text != "—" else text


def table_rows(summaries: Sequence[ConfigSummary], spread: bool = True,
               columns: Sequence[Column] = OUTCOME_COLUMNS + DYNAMICS_COLUMNS
               ) -> list[list[str]]:
    rows = []
    for s in summaries:
        row = [s.label + (f" ({len(s.failed)} failed)" if s.failed else "")]
        for c in columns:
            row.append(_staleness(s) if c.stat == "staleness"
                       else _final_cell(s, c.stat, _fmt(s.stats[c.stat], c.pattern, spread)))
        rows.append(row)
    return rows


def summary_rows(summaries: Sequence[ConfigSummary]) -> tuple[list[str], list[list[str]]]:
    """A short table for the terminal, one scenario's configurations: medians only."""
    head = ["configuration", "to target (s)", "acc. (%)", "upd/s", "rej. (%)", "stale p95",
            "max gap", "wait (s)"]
    rows = []
    for s in summaries:
        st = s.stats
        rows.append([s.label + (f" ({len(s.failed)} failed)" if s.failed else ""),
                     _fmt(st["time_to_target"], "{:.1f}", False, never="never"),
                     _final_cell(s, "final_accuracy", _fmt(st["final_accuracy"], "pct", False)),
                     _fmt(st["updates_per_s"], "{:.1f}", False),
                     _fmt(st["pct_rejected"], "{:.1f}", False),
                     _fmt(st["staleness_p95"], "{:g}", False),
                     _fmt(st["max_clock_gap"], "{:.0f}", False),
                     _fmt(st["wait_s"], "{:.2f}", False)])
    return head, rows


# --------------------------------------------------------------------------- figures


#: the target line is drawn (and the y-range stretched to it) only within this factor of
#: the runs' losses; further off it would squeeze every curve into a sliver
TARGET_NEAR = 1.5


@dataclass(frozen=True)
class LossFrame:
    """What the loss plot shows around its curves, decided from their values alone."""

    ylim: tuple[float, float]
    show_target: bool
    title: str


def loss_frame(scenario: str, values: Sequence[float], target: float,
               seeds: int) -> LossFrame:
    """The y-range from the plotted losses ``values`` (medians and min-max bands), the
    target line only where it is near them, and a title that mentions the shaded band
    only when there is one (two seeds or more) and says where an unshown target is."""
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (target, target)
    show = lo / TARGET_NEAR <= target <= hi * TARGET_NEAR
    if show:
        lo, hi = min(lo, target), max(hi, target)
    pad = 1.5 if hi <= lo * 1.01 else 1.08  # a flat curve still gets a visible range
    title = (f"Scenario '{scenario}': median over {seeds} seeds, shaded band = min-max"
             if seeds >= 2 else f"Scenario '{scenario}': one seed")
    if not show:
        where = (f"below every run's loss (lowest {lo:.3g})" if target < lo
                 else f"above every run's loss (highest {hi:.3g})")
        title += f"; target loss {target:g} not drawn: {where}"
    return LossFrame((lo / pad, hi * pad), show, title)


def plot_loss(scenario: str, group: Sequence[ConfigSummary], colors: dict[str, Color],
              target: float, path: Path) -> Path:
    return _save(loss_figure(scenario, group, colors, target), path)


def loss_figure(scenario: str, group: Sequence[ConfigSummary], colors: dict[str, Color],
                target: float) -> Figure:
    """Held-out loss against time and against updates applied: a median line per
    configuration (its mode's style), a min-max band where it has two seeds or more."""
    fig = Figure(figsize=(12.5, 4.8), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    plotted: list[float] = []
    seeds = max((sum(1 for r in s.runs if r.curve) for s in group), default=0)
    for ax, index, xlabel, title in (
        (axes[0], 0, "wall-clock time since training started (s)", "against wall-clock time"),
        (axes[1], 1, "updates applied (optimizer steps on the servers)", "against updates applied"),
    ):
        for n, s in enumerate(group):
            band = _band([[(p[index], p[2]) for p in r.curve] for r in s.runs])
            if band is None:
                continue
            x, med, lo, hi = band
            line, marker = mode_style(s.config.mode)
            ax.plot(x, med, color=colors[s.label], lw=1.8, ls=line, marker=marker,
                    markersize=4, markevery=(2 * n % 16, 16),
                    label=f"{s.label} (median)" if seeds >= 2 else s.label)
            if sum(1 for r in s.runs if r.curve) >= 2:
                ax.fill_between(x, lo, hi, color=colors[s.label], alpha=0.18, lw=0)
            plotted += [*lo.tolist(), *hi.tolist()]
        ax.set_xlabel(xlabel)
        ax.set_title(f"Held-out loss {title}")
    frame = loss_frame(scenario, plotted, target, seeds)
    for ax in axes:
        if frame.show_target:
            ax.axhline(target, color="0.3", ls=":", lw=1, label=f"target loss {target:g}")
        ax.set_yscale("log")
        ax.set_ylim(*frame.ylim)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("held-out loss (log scale)")
    fig.suptitle(frame.title)
    return fig


def plot_staleness(scenario: str, group: Sequence[ConfigSummary], colors: dict[str, Color],
                   path: Path) -> Path:
    fig = Figure(figsize=(max(4.0, 3.6 * len(group)), 3.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(group), squeeze=False)[0])
    hists: list[dict[int, int]] = []
    for s in group:
        hist: dict[int, int] = {}
        for r in s.runs:
            for tau, n in r.staleness_hist.items():
                hist[int(tau)] = hist.get(int(tau), 0) + n
        hists.append(hist)
    widest = max((max(h, default=0) for h in hists), default=0)
    for ax, s, hist in zip(axes, group, hists, strict=True):
        total = sum(hist.values()) or 1
        taus = sorted(hist)
        ax.bar(taus, [100.0 * hist[t] / total for t in taus], color=colors[s.label],
               width=0.8, label=f"{total} pushes")
        ax.set_title(s.label)
        ax.set_xlim(-0.6, max(widest, 3) + 0.6)  # one scale for every panel
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("staleness τ (updates behind)")
        ax.set_ylabel("share of pushes (%)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"Scenario '{scenario}': staleness of pushes at shard 0, all seeds")
    return _save(fig, path)


def plot_clocks(s: ConfigSummary, path: Path) -> Path | None:
    if not s.runs:
        return None
    run = s.runs[0]
    fig = Figure(figsize=(10.5, 6.2), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    for rank, points in run.clocks.items():
        if points:
            xs, ys = zip(*[(0.0, 0), *points], strict=True)
            top.step(xs, ys, where="post", lw=1.2, label=f"worker {rank}")
    top.set_ylabel("clock (steps completed)")
    top.set_title("Worker clocks over time")
    top.grid(True, alpha=0.3)
    top.legend(fontsize="small", ncol=4)
    if run.gaps:
        xs, gaps = zip(*run.gaps, strict=True)
        bottom.scatter(xs, gaps, s=5, color="tab:blue", label="gap of each push")
    bound = s.config.bound
    bottom.axhline(bound, color="tab:red", ls="--", lw=1, label=f"bound s = {bound}")
    bottom.set_xlabel("wall-clock time since training started (s)")
    bottom.set_ylabel("clock gap (clocks)")
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_title("Clocks the pushing worker was ahead of the slowest one")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize="small")
    fig.suptitle(f"Scenario '{s.scenario}', {s.label}: seed {run.seed}")
    return _save(fig, path)


# --------------------------------------------------------------------------- documents


def _md(blocks: Sequence[Block]) -> str:
    out: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + block[1])
        elif kind == "p":
            out.append(block[1])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "code":
            out.append("```\n" + block[1] + "\n```")
        elif kind == "table":
            head, rows = block[1], block[2]
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
            out.append("\n".join(lines))
        elif kind == "img":
            out.append(f"![{block[2]}]({block[1]})")
    return "\n\n".join(out) + "\n"


# A table never overflows the page: it is at most as wide as the body, and a cell may
# break anywhere (overflow-wrap:anywhere makes its min-content width one character), which
# a browser does only when the columns' natural widths do not fit; headers are short and
# on two lines, and a cell's spread over seeds goes on a small second line, so that they
# fit at 1,400 px (tests/test_report_layout.py estimates every table's width).
_CSS = """body{font-family:system-ui,sans-serif;max-width:1300px;margin:2em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;font-size:.9em;margin:1em 0 .3em;max-width:100%}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right;overflow-wrap:anywhere}
th:first-child,td:first-child{text-align:left}th{background:#f3f3f3;font-weight:600}
td small{color:#555}p.legend{font-size:.8em;color:#555;margin:0 0 1em}
img{max-width:100%;border:1px solid #eee}code,pre{background:#f6f6f6}
pre{padding:.6em;overflow-x:auto}"""

#: where a cell's text goes on a second, smaller line in HTML: before its spread over seeds
#: "[lo-hi]" and a note "(2/3 reached)", "(1 failed)"
_NOTE = re.compile(r" (?=[\[(])")


def _html_cell(text: str) -> str:
    first, *notes = _NOTE.split(text, maxsplit=1)
    esc = html.escape(first)
    return esc + "".join(f"<br><small>{html.escape(n)}</small>" for n in notes)


def _html(blocks: Sequence[Block], out_dir: Path, title: str) -> str:
    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
             f"<style>{_CSS}</style></head><body>"]
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3", "p"):
            parts.append(f"<{kind}>{esc(block[1])}</{kind}>")
        elif kind == "legend":
            parts.append(f"<p class='legend'>{esc(block[1])}</p>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in block[1]) + "</ul>")
        elif kind == "code":
            parts.append(f"<pre><code>{esc(block[1])}</code></pre>")
        elif kind == "table":
            titles = block[3] if len(block) > 3 else block[1]
            head = "".join("<th>" + "<br>".join(esc(line) for line in h.split("\n")) + "</th>"
                           for h in titles)
            body = "".join("<tr>" + "".join(f"<td>{_html_cell(c)}</td>" for c in r) + "</tr>"
                           for r in block[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode((out_dir / block[1]).read_bytes()).decode()
            parts.append(f"<figure><img alt='{esc(block[2])}' src='data:image/png;base64,"
                         f"{data}'></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


_DEFINITIONS = [
    "two tables per scenario: outcome (progress to the target, where training ended, how "
    "fast) and dynamics (rates while every worker trained, idling, rejections, staleness, "
    "gates)",
    "time to target: wall-clock seconds from the start of training until the held-out loss "
    "(evaluated by the worker each scenario names) first reaches the target; interpolated "
    "between evaluations",
    "updates to target: optimizer steps applied by the servers until then (a sync round is "
    "one update, however many workers it averages)",
    "final held-out loss / accuracy: of the final weights, after every worker finished (the "
    "launcher evaluates them, or a script's evaluating rank after opt.final()); a cell marked "
    "'last in-loop evaluation' is instead the evaluating worker's last evaluation in its own "
    "loop (a script that does not call opt.final()), which pushes made after it (a "
    "straggler's) do not count in",
    "gradients to target: gradients computed by all workers until then; it compares sync "
    "(one update per N gradients) with async (one per gradient) on the work done",
    "updates/s: optimizer steps applied per second of training (shard 0's version / time); "
    "training ends at the last worker's last step, so a straggler that finishes late lowers "
    "it even when the others were fast",
    "gradients/s: gradients computed by all workers per second of training",
    "updates/s and gradients/s, all active: the same rates over the window in which every "
    "worker was still training (from the start to the first worker's last step); with a "
    "fixed number of steps per worker, fast async workers finish early and then idle, which "
    "the whole-run rate hides",
    "idle (s/worker): seconds a worker sat done while another still trained, mean over "
    "workers and the largest",
    "rejected: share of pushes the staleness policy (or sync, for late gradients) refused",
    "staleness: updates applied between a worker's pull and its push, over all pushes at "
    "shard 0",
    "max clock gap: the most clocks a worker was ahead of the slowest worker when it "
    "computed an update (SSP bounds it by s)",
    "waiting: seconds per worker held at a sync barrier or an SSP gate",
    "bytes communicated per worker: bytes pushed and pulled, as each worker counted them on "
    "the wire (its step events), mean over workers; then each way (compressed pushes and "
    "pulls counted as they went)",
    "communication rounds: pushes per worker (one per step, one per H steps with local SGD "
    "mode h=H)",
    "cells: median over seeds [min-max]",
]


def render_report(out_dir: Path, exp: ExperimentIndex, summaries: Sequence[ConfigSummary],
                  claims: Sequence[ClaimCheck]) -> tuple[Path, Path, list[Path]]:
    """Write the figures, report.md and report.html; return their paths."""
    images_dir = out_dir / "images"
    images_dir.mkdir(exist_ok=True)
    env = EnvironmentInfo.read(out_dir)
    colors = plots.colors_of(summaries)
    target = exp.target_loss
    step_ms = 1000 * exp.min_step_time
    title = report_title(exp)
    blocks: list[Block] = [("h1", f"Experiment '{title}'")]
    finished = exp.finished or exp.started or 0
    opt_args = ", ".join(f"{k}={v}" for k, v in exp.optimizer_args.items())
    evaluation = ("evaluation as the script logs it" if exp.command else
                  f"evaluation every {exp.eval_every} steps of worker 0")
    blocks.append(("p", (
        f"{'Command' if exp.command else 'Task'} {exp.task}, budget: {_budget_text(exp)}, "
        f"{exp.servers} server(s), seeds {', '.join(map(str, exp.seeds))}, optimizer "
        f"{exp.optimizer}({opt_args}), target held-out loss {target:g}, {evaluation}. Finished "
        f"{dt.datetime.fromtimestamp(finished).isoformat(timespec='seconds')}.")))
    if exp.hosts is not None:
        blocks.append(("p", hosts_text(exp.hosts)))
    if step_ms > 0:
        blocks.append(("p", (
            f"Every step takes at least {step_ms:g} ms (StragglerSpec.min_step_time): this "
            f"emulates a model heavier than the task's own (about 1 ms a step on "
            f"digits-mlp), so that straggler effects stand out above process noise. Straggler "
            f"slowdowns multiply this time.")))
    pkgs = env.packages
    blocks.append(("p", (
        f"Environment: Python {env.python or '?'}, torch {pkgs.get('torch', '?')}, pyzmq "
        f"{pkgs.get('pyzmq', '?')}, {env.cpus or '?'} CPUs, git commit "
        f"{env.git_commit or 'unknown'}{' (modified)' if env.git_dirty else ''}. "
        f"Rerun with: paramserver experiment --spec spec.toml")))
    if exp.simulated is not None:
        sim = exp.simulated
        blocks.append(("p", (
            f"Simulated in virtual time (paramserver simulate, docs/research.md): every time "
            f"here, wall-clock included, is virtual seconds. Rerun with: paramserver simulate "
            f"--spec spec.toml --compute-time {sim.compute_time} --latency "
            f"{sim.latency}")))
    loads = [r.load for r in exp.runs if r.load is not None]
    cpus = env.cpus or 0
    if loads and cpus:
        text = (f"Machine load: the 1-minute load average was {min(loads):.1f} to "
                f"{max(loads):.1f} at the end of the runs, on {cpus} CPUs.")
        if max(loads) > 1.5 * cpus:
            text += (" Other work competed for the CPUs: wall-clock figures (time to target, "
                     "updates/s, waiting) carry the scheduler's noise; the figures per update "
                     "do not.")
        blocks.append(("p", text))
    failed = [r for r in exp.runs if not r.ok]
    if failed:
        blocks.append(("h2", "Failed runs"))
        blocks.append(("ul", [f"{r.path}: {r.error}" for r in failed]))
    blocks += [("h2", "Columns"), ("ul", _DEFINITIONS)]
    images: list[Path] = []
    tables = [(cols, ["configuration"] + [c.title for c in cols],
               ["configuration"] + [c.short for c in cols],
               "; ".join(f"{c.short.replace(chr(10), ' ')}: {c.title}" for c in cols
                         if c.short.replace("\n", " ") != c.title))
              for cols in (OUTCOME_COLUMNS, DYNAMICS_COLUMNS)]
    for scenario, info in exp.scenarios.items():
        group = [s for s in summaries if s.scenario == scenario]
        if not group:
            continue
        blocks += [("h2", f"Scenario '{scenario}'"), ("p", info.description)]
        if info.ranks:
            blocks.append(("p", "Per-worker settings: " + "; ".join(
                f"worker {r}: {_straggler_text(o)}" for r, o in info.ranks.items())))
        blocks.append(("p", f"Every worker: {_straggler_text(info.all)}."))
        blocks.append(("p", _evaluator_text(group, info)))
        for (cols, head, short, legend), name in zip(tables, ("Outcome", "Dynamics"),
                                                     strict=True):
            blocks += [("h3", name), ("table", head, table_rows(group, columns=cols), short),
                       ("legend", legend)]
        steps_text = _step_settings(group)
        if steps_text:
            blocks.append(("p", steps_text))
        if any(s.runs for s in group):
            loss = plot_loss(scenario, group, colors, target,
                             inside(images_dir, f"{scenario}-loss.png"))
            stale = plot_staleness(scenario, group, colors,
                                   inside(images_dir, f"{scenario}-staleness.png"))
            for path, alt in ((loss, "held-out loss"), (stale, "staleness histograms")):
                images.append(path)
                blocks.append(("img", f"images/{path.name}", f"{scenario}: {alt}"))
            for name, alt, fig in (
                    ("work", "held-out loss against gradients computed and samples",
                     plots.work_figure(scenario, group, colors)),
                    ("bytes", "held-out loss against bytes communicated per worker",
                     plots.bytes_figure(scenario, group, colors)),
                    ("throughput", "updates/s and gradients/s over time",
                     plots.throughput_figure(scenario, group, colors)),
                    ("step-times", "step time per worker",
                     plots.step_time_figure(scenario, group)),
                    ("accuracy", "held-out accuracy over time",
                     plots.accuracy_figure(scenario, group, colors))):
                if fig is not None:
                    path = _save(fig, inside(images_dir, f"{scenario}-{name}.png"))
                    images.append(path)
                    blocks.append(("img", f"images/{path.name}", f"{scenario}: {alt}"))
        for s in group:
            if s.config.mode == "ssp":
                clocks = plot_clocks(s, inside(images_dir, f"{s.config.id}-clocks.png"))
                if clocks is not None:
                    images.append(clocks)
                    blocks.append(("img", f"images/{clocks.name}", f"{s.label}: clocks"))
    if claims:
        blocks.append(("h2", "Literature checks (Ho et al. 2013; Cui et al. 2014)" if not any(
            s.config.sync_every is not None for s in summaries)
            else "Literature checks (Ho et al. 2013; Cui et al. 2014; Douillard et al. 2023; "
                 "Liu et al. 2024)"))
        blocks.append(("ul", [f"{c.status.upper()}: {c.claim}. {c.detail}" for c in claims]))
    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    md_path.write_text(_md(blocks), encoding="utf-8")
    html_path.write_text(_html(blocks, out_dir, f"Experiment {title}"), encoding="utf-8")
    return md_path, html_path, images


def hosts_text(hosts: JSONObject) -> str:
    """The emulated hosts every run ran on, in words (HostPlan.to_json's record)."""
    workers, servers, link_of = hosts.get("workers"), hosts.get("servers"), hosts.get("link_of")
    slow = ", ".join(f"host {k} at {v}" for k, v in link_of.items()) \
        if isinstance(link_of, dict) else ""
    return (f"Every run was on emulated hosts (--hosts {workers}+{servers}; hosts are "
            f"numbered worker hosts first, worker r on worker host r % {workers}"
            + (", the shards on the worker hosts" if not servers else "")
            + f"): network namespaces on one bridge, every NIC shaped to "
            f"{hosts.get('link')} both ways"
            + (f", but {slow} (a network straggler)" if slow else "")
            + ". The processes talk over TCP between the hosts' addresses.")


def report_title(exp: ExperimentIndex) -> str:
    """What a report is called: the spec's name, or for a script's grid whose spec
    named none, the script (``train.py`` of ``python train.py --lr 0.1``; a module
    run with ``-m``; else the program)."""
    if exp.name != DEFAULT_NAME or not exp.command:
        return exp.name
    command = list(exp.command)
    scripts = [a for a in command if a.endswith(".py")]
    if scripts:
        return Path(scripts[0]).name
    if "-m" in command[:-1]:
        return command[command.index("-m") + 1]
    return Path(command[0]).name


def _budget_text(exp: ExperimentIndex) -> str:
    """What every run trained for: a time or gradients budget, else steps per worker."""
    if exp.budget_seconds:
        return (f"{exp.budget_seconds:g} s of training per worker from its first step "
                f"(every mode stops within one step of it)")
    if exp.budget_gradients:
        return (f"{exp.budget_gradients} gradients in total, an equal share per worker "
                f"(faster workers finish their share early and idle)")
    if exp.command:
        return f"the script's own loop (PARAMSERVER_STEPS={exp.steps}, a hint)"
    return f"{exp.steps} steps per worker"


def _evaluator_text(group: Sequence[ConfigSummary], info: ScenarioEntry) -> str:
    """Which worker's held-out evaluations the curves and the target come from, and whether
    this scenario slows it: then the curves get a point only at the straggler's pace."""
    evaluators = sorted({r.evaluator for s in group for r in s.runs if r.evaluator is not None})
    if not evaluators:
        return ("No worker logged a held-out evaluation: time to target and the loss and "
                "accuracy curves are empty.")
    who = " and ".join(f"worker {e}" for e in evaluators)
    text = f"Held-out evaluation: {who} evaluates (the lowest rank that logs one)."
    slowed = [e for e in evaluators if (spec := info.ranks.get(str(e))) is not None
              and spec != info.all]
    for e in slowed:
        text += (f" Worker {e}, the evaluator, is also this scenario's straggler "
                 f"({_straggler_text(info.ranks[str(e)])}): the held-out curves get a point "
                 f"only at its pace, and the time it spends evaluating lengthens its steps.")
    return text


def _straggler_text(spec: StragglerSpec) -> str:
    parts = []
    if spec.slowdown != 1.0:
        parts.append(f"{spec.slowdown:g}x slower")
    if spec.slow_prob and spec.slow_factor != 1.0:
        parts.append(f"{spec.slow_factor:g}x slow steps with probability "
                     f"{spec.slow_prob:g}")
    if spec.delay:
        parts.append(f"extra delay {spec.delay} s")
    if spec.min_step_time:
        parts.append(f"steps of at least {1000 * spec.min_step_time:g} ms")
    return ", ".join(parts) or "no injected slowness"
