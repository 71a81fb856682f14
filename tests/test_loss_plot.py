"""The experiment report's loss plot (issue 15): its y-range comes from the runs, not
from a target line none of them reaches; its title mentions the min-max band only when
there is one; each mode has its own line style and marker, so that sync and async,
which coincide against updates applied, stay apart. Decisions are tested as a pure
function, then on the figure itself (matplotlib, no display)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from matplotlib.collections import PolyCollection

from paramserver.workers.experiments.index import ConfigEntry
from paramserver.workers.experiments.render import (
    MODE_STYLES,
    loss_figure,
    loss_frame,
    mode_style,
    plot_loss,
)
from paramserver.workers.experiments.report import ConfigSummary, RunMetrics


def test_target_far_below_the_runs_is_left_out() -> None:
    frame = loss_frame("transient", [2.3, 1.9, 1.2, 0.95], target=0.05, seeds=3)
    assert not frame.show_target
    lo, hi = frame.ylim
    assert 0.8 < lo < 0.95 and 2.3 < hi < 2.6  # the runs fill the range
    assert "target loss 0.05 not drawn: below every run's loss (lowest 0.95)" in frame.title


def test_target_near_the_runs_is_drawn_and_in_range() -> None:
    frame = loss_frame("none", [2.3, 0.7, 0.6], target=0.5, seeds=2)
    assert frame.show_target and frame.ylim[0] < 0.5 < frame.ylim[1]
    assert "not drawn" not in frame.title
    inside = loss_frame("none", [2.3, 0.4], target=0.5, seeds=2)
    assert inside.show_target and inside.ylim[0] < 0.4


def test_target_above_every_run() -> None:
    frame = loss_frame("s", [0.2, 0.1], target=5.0, seeds=2)
    assert not frame.show_target and frame.ylim[1] < 1
    assert "above every run's loss (highest 0.2)" in frame.title


def test_title_mentions_the_band_only_with_two_seeds_or_more() -> None:
    assert "shaded band" in loss_frame("s", [1.0, 0.6], 0.5, seeds=2).title
    one = loss_frame("s", [1.0, 0.6], 0.5, seeds=1).title
    assert "shaded band" not in one and "one seed" in one


def test_flat_or_missing_curves_still_get_a_range() -> None:
    lo, hi = loss_frame("s", [0.7, 0.7], 0.05, seeds=1).ylim
    assert lo < 0.7 < hi and hi / lo > 1.5
    lo, hi = loss_frame("s", [math.nan, math.inf, 0.0], 0.5, seeds=1).ylim
    assert lo < 0.5 < hi


def test_every_mode_has_its_own_style() -> None:
    styles = [mode_style(m) for m in MODE_STYLES]
    assert len({s[0] for s in styles}) == len(styles) == len({s[1] for s in styles})
    assert mode_style("something-new") not in styles


def _summary(label: str, mode: str, curves: list[list[tuple[float, float, float]]]
             ) -> ConfigSummary:
    runs = [RunMetrics(seed=i, train_seconds=1.0, updates=10, updates_per_s=10.0,
                       pct_rejected=0.0, staleness_p50=0.0, staleness_p95=0.0,
                       staleness_max=0, max_clock_gap=0, server_max_gap=None, wait_s=0.0,
                       time_to_target=None, updates_to_target=None, final_loss=None,
                       final_accuracy=None, curve=c) for i, c in enumerate(curves)]
    return ConfigSummary(ConfigEntry(id=label, scenario="s", label=label, mode=mode, workers=2),
                         runs, [], {})


def _curve(scale: float) -> list[tuple[float, float, float]]:
    # (seconds, updates applied, loss): sync and async fall alike per update
    return [(t * scale, float(t), 2.3 * 0.97 ** t + 0.9) for t in range(40)]


@pytest.mark.parametrize("seeds", [1, 2])
def test_loss_figure(seeds: int, tmp_path: Path) -> None:
    group = [_summary("sync", "sync", [_curve(1.0 + 0.1 * i) for i in range(seeds)]),
             _summary("async", "async", [_curve(0.5 + 0.1 * i) for i in range(seeds)])]
    colors = {"sync": "tab:blue", "async": "tab:orange"}
    fig = loss_figure("s", group, colors, target=0.05)
    time_ax, updates_ax = fig.axes[:2]
    lines = {line.get_label(): line for line in updates_ax.get_lines()}
    sync = lines["sync (median)" if seeds > 1 else "sync"]
    asyn = lines["async (median)" if seeds > 1 else "async"]
    # the same losses per update, told apart by style and marker
    assert sync.get_ydata().tolist() == pytest.approx(asyn.get_ydata().tolist())
    assert (sync.get_linestyle(), sync.get_marker()) != (asyn.get_linestyle(),
                                                         asyn.get_marker())
    # no line at a target far below the runs, and the y-range hugs the curves
    assert not any("target" in str(label) for label in lines)
    lo, hi = updates_ax.get_ylim()
    assert 1.4 < lo < 1.6 and 3.2 < hi < 3.6  # losses run from 3.2 down to 1.6
    bands = [c for c in time_ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == (2 if seeds > 1 else 0)
    title = fig.get_suptitle()
    assert ("shaded band" in title) == (seeds > 1)
    assert "target loss 0.05 not drawn" in title
    # and it renders to a file
    path = plot_loss("s", group, colors, 0.05, tmp_path / "loss.png")
    assert path.stat().st_size > 10_000
