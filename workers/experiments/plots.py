"""The report's figures of work and pace: held-out loss against gradients computed and
samples, updates/s and gradients/s over time, each worker's step times, and held-out
accuracy over time; and the helpers every figure of the report shares.

Each figure shows one scenario's configurations, from what
:func:`paramserver.workers.experiments.report.run_metrics` read from the step, push and
eval events. matplotlib's object API with the Agg canvas: no pyplot state, no display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

if TYPE_CHECKING:
    from paramserver.workers.experiments.report import ConfigSummary, RunMetrics

__all__ = ["MODE_STYLES", "Color", "accuracy_figure", "colors_of", "mode_style",
           "step_time_figure", "throughput_figure", "work_figure"]

#: a configuration's colour on the plots: a matplotlib name ("tab:blue") or RGBA
Color = str | tuple[float, float, float, float]

#: line style and marker of each mode on the loss plot: curves that coincide (sync and
#: async against updates applied) stay told apart
MODE_STYLES: dict[str, tuple[str, str]] = {"sync": ("-", "o"), "async": ("--", "s"),
                                           "ssp": ("-.", "^")}


def mode_style(mode: str) -> tuple[str, str]:
    """(line style, marker) of a mode; one not listed gets a dotted line and diamonds."""
    return MODE_STYLES.get(mode, (":", "D"))


def colors_of(summaries: Sequence[ConfigSummary]) -> dict[str, Color]:
    from matplotlib import colormaps

    labels = list(dict.fromkeys(s.label for s in summaries))
    cmap = colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def band(curves: Sequence[Sequence[tuple[float, float]]], points: int = 160
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Median and min/max over seeds on a common x grid (up to the shortest curve)."""
    curves = [c for c in curves if c]
    if not curves:
        return None
    end = min(c[-1][0] for c in curves)
    grid = np.linspace(0.0, end, points) if end > 0 else np.zeros(1)
    ys = np.array([np.interp(grid, [p[0] for p in c], [p[1] for p in c]) for c in curves])
    return grid, np.median(ys, axis=0), ys.min(axis=0), ys.max(axis=0)


def _plain_log(ax: Axes) -> None:
    """A log y-axis labelled 0.5, 2, 600 rather than 5x10^-1, 2x10^0, 6x10^2."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))


def _median_lines(ax: Axes, group: Sequence[ConfigSummary], colors: dict[str, Color],
                  curves: dict[str, list[list[tuple[float, float]]]]) -> int:
    """A median line per configuration (its mode's style) and a min-max band over seeds;
    returns how many lines were drawn."""
    drawn = 0
    for s in group:
        got = band(curves.get(s.label, []))
        if got is None:
            continue
        x, med, lo, hi = got
        line, marker = mode_style(s.config.mode)
        seeds = sum(1 for c in curves[s.label] if c)
        ax.plot(x, med, color=colors[s.label], lw=1.6, ls=line, marker=marker, markersize=3,
                markevery=(drawn * 3 % 16, 16),
                label=f"{s.label} (median)" if seeds >= 2 else s.label)
        if seeds >= 2:
            ax.fill_between(x, lo, hi, color=colors[s.label], alpha=0.15, lw=0)
        drawn += 1
    return drawn


def work_figure(scenario: str, group: Sequence[ConfigSummary],
                colors: dict[str, Color]) -> Figure | None:
    """Held-out loss against gradients computed and against samples, all workers: the
    work each mode spent, where the loss plot's x-axis (updates applied) hides that a
    sync update averages N gradients."""
    if not any(r.work_curve for s in group for r in s.runs):
        return None
    fig = Figure(figsize=(12.5, 4.4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, index, xlabel in ((axes[0], 0, "gradients computed (all workers)"),
                              (axes[1], 1, "training samples processed (all workers)")):
        curves = {s.label: [[(p[index], p[2]) for p in r.work_curve] for r in s.runs]
                  for s in group}
        _median_lines(ax, group, colors, curves)
        ax.set_xlabel(xlabel)
        _plain_log(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("held-out loss (log scale)")
    axes[0].set_title("Held-out loss against gradients computed")
    axes[1].set_title("Held-out loss against samples")
    fig.suptitle(f"Scenario '{scenario}': the work spent, median over seeds")
    return fig


def bytes_figure(scenario: str, group: Sequence[ConfigSummary],
                 colors: dict[str, Color]) -> Figure | None:
    """Held-out loss against bytes communicated per worker: what local SGD (a push every H
    steps) or compressed pushes save at the loss they reach. Only with one of them in the
    group: otherwise every configuration sends the same bytes per update, and the loss
    plot says it all."""
    sent = [r.bytes_per_worker for s in group for r in s.runs if r.bytes_per_worker > 0]
    differ = bool(sent) and max(sent) > 1.05 * min(sent)  # (pulls compressed, say)
    if not (differ or any(s.config.sync_every is not None or s.config.compression != "none"
                          for s in group)) \
            or not any(r.bytes_curve for s in group for r in s.runs):
        return None
    fig = Figure(figsize=(7.5, 4.4), layout="constrained")
    ax = fig.subplots()
    for s in group:
        # on a log grid from where every seed has sent something: band()'s linear grid
        # from 0 would draw flat lines across the decades before the first push
        curves = [[(b / 1e6, loss) for b, loss in r.bytes_curve if b > 0] for r in s.runs]
        curves = [c for c in curves if c]
        if not curves:
            continue
        start, end = max(c[0][0] for c in curves), min(c[-1][0] for c in curves)
        grid = np.geomspace(start, end, 80) if end > start else np.array([end])
        ys = np.array([np.interp(np.log(grid), np.log([p[0] for p in c]), [p[1] for p in c])
                       for c in curves])
        line, marker = mode_style(s.config.mode)
        ax.plot(grid, np.median(ys, axis=0), color=colors[s.label], lw=1.6, ls=line,
                label=s.label)
        for c in curves:  # the evaluations themselves
            ax.plot([p[0] for p in c], [p[1] for p in c], ls="none", marker=marker,
                    markersize=3, color=colors[s.label])
        if len(curves) > 1:
            ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=colors[s.label],
                            alpha=0.15, lw=0)
    ax.set_xscale("log")
    ax.set_xlabel("MB communicated per worker (pushed and pulled; log scale)")
    _plain_log(ax)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_ylabel("held-out loss (log scale)")
    ax.set_title(f"Scenario '{scenario}': held-out loss against bytes, median over seeds")
    return fig


def _rate(times: Sequence[float], counts: Sequence[float], end: float, bins: int
          ) -> list[tuple[float, float]]:
    """Events per second in ``bins`` equal windows of [0, end]: (window middle, rate)."""
    if end <= 0 or not times:
        return []
    edges = np.linspace(0.0, end, bins + 1)
    hist, _ = np.histogram(np.asarray(times), bins=edges, weights=np.asarray(counts))
    width = end / bins
    return [(float(m), float(h) / width)
            for m, h in zip((edges[:-1] + edges[1:]) / 2, hist, strict=True)]


def _update_times(run: RunMetrics) -> tuple[list[float], list[float]]:
    """When shard 0's version grew, and by how much (a rejected push adds nothing)."""
    times, steps, last = [], [], 0
    for t, version in run.versions:
        if version > last:
            times.append(t)
            steps.append(float(version - last))
            last = version
    return times, steps


def throughput_figure(scenario: str, group: Sequence[ConfigSummary],
                      colors: dict[str, Color], bins: int = 20) -> Figure | None:
    """Updates/s (shard 0) and gradients/s (all workers) in windows of a run's training,
    median over seeds: a straggler's tail, a barrier's stalls show as drops."""
    if not any(r.step_log for s in group for r in s.runs):
        return None
    fig = Figure(figsize=(12.5, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharex=True)
    ups: dict[str, list[list[tuple[float, float]]]] = {}
    grads: dict[str, list[list[tuple[float, float]]]] = {}
    for s in group:
        for r in s.runs:
            ups.setdefault(s.label, []).append(_rate(*_update_times(r), r.train_seconds, bins))
            grads.setdefault(s.label, []).append(_rate(
                [t for t, _, _ in r.step_log], [float(g) for _, _, g in r.step_log],
                r.train_seconds, bins))
    for ax, curves, what in ((axes[0], ups, "updates/s (shard 0's version)"),
                             (axes[1], grads, "gradients/s (all workers)")):
        _median_lines(ax, group, colors, curves)
        ax.set_xlabel("wall-clock time since training started (s)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_title("Updates applied per second")
    axes[1].set_title("Gradients computed per second")
    fig.suptitle(f"Scenario '{scenario}': throughput over time, {bins} windows per run, "
                 f"median over seeds")
    return fig


def step_time_figure(scenario: str, group: Sequence[ConfigSummary]) -> Figure | None:
    """Each worker's time between steps (compute, injected delay, pull and push, waits),
    a box per worker and a panel per configuration, all seeds pooled."""
    shown = [s for s in group if any(r.step_times for r in s.runs)]
    if not shown:
        return None
    fig = Figure(figsize=(max(4.5, 3.8 * len(shown)), 3.9), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(shown), squeeze=False, sharey=True)[0])
    for ax, s in zip(axes, shown, strict=True):
        ranks = sorted({rank for r in s.runs for rank in r.step_times})
        data = [[1000 * d for r in s.runs for d in r.step_times.get(rank, [])] or [0.0]
                for rank in ranks]
        ax.boxplot(data, tick_labels=[str(rank) for rank in ranks], showfliers=True,
                   flierprops={"markersize": 2, "alpha": 0.4})
        _plain_log(ax)
        ax.set_title(s.label)
        ax.set_xlabel("worker")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("time between its steps (ms, log scale)")
    fig.suptitle(f"Scenario '{scenario}': step time per worker, all seeds (box: quartiles, "
                 f"whiskers: 1.5 IQR)")
    return fig


def accuracy_figure(scenario: str, group: Sequence[ConfigSummary],
                    colors: dict[str, Color]) -> Figure | None:
    """Held-out accuracy against wall-clock time (None: no run logged an accuracy)."""
    if not any(r.accuracy_curve for s in group for r in s.runs):
        return None
    fig = Figure(figsize=(8.0, 4.2), layout="constrained")
    ax = fig.subplots()
    curves = {s.label: [[(t, 100 * a) for t, a in r.accuracy_curve] for r in s.runs]
              for s in group}
    _median_lines(ax, group, colors, curves)
    ax.set_xlabel("wall-clock time since training started (s)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.suptitle(f"Scenario '{scenario}': held-out accuracy over time, median over seeds")
    return fig
