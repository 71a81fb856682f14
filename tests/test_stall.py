"""The launcher's stall rule (pure, no processes): when a run that logs no step is
reported, and that a step coming back is reported too."""

from __future__ import annotations

import pytest

from paramserver.workers.launch.stall import PACE_FACTOR, StallNotice, StallWatch


def feed(watch: StallWatch, points: list[tuple[float, int]]) -> list[tuple[float, StallNotice]]:
    """(now, steps) in order; the notices given, with when."""
    out = []
    for now, steps in points:
        notice = watch.update(steps, now)
        if notice is not None:
            out.append((now, notice))
    return out


def test_starting_up_is_not_a_stall():
    # no step logged yet (imports, the first compile, the start barrier): never reported
    assert feed(StallWatch(5.0), [(t, 0) for t in range(0, 1000, 10)]) == []


def test_quiet_after_steps_is_reported_at_the_limit_then_at_twice_four_times():
    watch = StallWatch(5.0)
    steps = [(0.1 * i, i) for i in range(1, 11)]  # a step every 0.1 s: the floor, 5 s, rules
    quiet = [(1.0 + dt, 10) for dt in (4.9, 5.0, 9.9, 10.0, 19.9, 20.0)]
    got = feed(watch, steps + quiet)
    assert [round(now - 1.0, 1) for now, _ in got] == [5.0, 10.0, 20.0]
    assert all(n.stalled for _, n in got)
    assert got[0][1].quiet == pytest.approx(5.0)
    assert got[0][1].pace == pytest.approx(0.1)


def test_a_slow_models_pace_raises_the_limit():
    watch = StallWatch(5.0)
    steps = [(30.0 * i, i) for i in range(1, 5)]  # 30 s a step: 10 x 30 s before a notice
    got = feed(watch, [*steps, (120.0 + 299.0, 4), (120.0 + 300.0, 4)])
    assert len(got) == 1 and got[0][1].quiet == pytest.approx(PACE_FACTOR * 30.0)


def test_a_step_after_a_notice_says_it_resumed_and_rearms():
    watch = StallWatch(2.0)
    got = feed(watch, [(0.0, 0), (1.0, 3), (1.5, 6), (4.0, 6), (7.0, 7), (8.0, 8), (11.7, 8),
                       (11.8, 8)])
    assert [(now, n.stalled) for now, n in got] == [(4.0, True), (7.0, False), (11.8, True)]
    assert got[1][1].quiet == pytest.approx(5.5)  # from the last step before it, 1.5 s
    # the pace leaves the reported spell out: 1.5 s for 4 steps, so the limit is 3.75 s
    assert got[2][1].pace == pytest.approx(1.5 / 4)


def test_zero_never_reports():
    assert feed(StallWatch(0.0), [(0.0, 1), (1e6, 1)]) == []
