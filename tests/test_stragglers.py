"""Straggler injection: validation, reproducibility and the sampled distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paramserver.errors import ConfigError
from paramserver.workers.stragglers import DELAY_KINDS, Straggler, StragglerSpec

N = 10_000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"slowdown": 0.5}, "slowdown must be >= 1"),
        ({"slowdown": float("inf")}, "finite"),
        ({"slowdown": "2"}, "must be a number"),
        ({"slow_prob": -0.1}, r"slow_prob must be in \[0, 1\]"),
        ({"slow_prob": 1.5}, r"slow_prob must be in \[0, 1\]"),
        ({"slow_factor": 0.9}, "slow_factor must be >= 1"),
        ({"min_step_time": -1.0}, "min_step_time must be >= 0"),
        ({"min_step_time": float("nan")}, "finite"),
        ({"delay": "gamma:1,2"}, "delay must be"),
        ({"delay": "exp"}, "delay must be"),
        ({"delay": "exp:abc"}, "delay must be"),
        ({"delay": "uniform:0.1"}, "takes 2"),
        ({"delay": "uniform:0.2,0.1"}, "LOW <= HIGH"),
        ({"delay": "uniform:-0.1,0.1"}, "LOW <= HIGH"),
        ({"delay": "const:-1"}, ">= 0"),
        ({"delay": "exp:-0.01"}, ">= 0"),
        ({"delay": "lognormal:0,-1"}, "SIGMA"),
        ({"delay": "pareto:0,1"}, "ALPHA > 0"),
        ({"delay": "pareto:2,0"}, "SCALE > 0"),
        ({"delay": "const:inf"}, "finite"),
    ],
)
def test_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StragglerSpec(**kwargs)  # type: ignore[arg-type]


def test_parse_delay() -> None:
    assert StragglerSpec.parse_delay("") == ("none", ())
    assert StragglerSpec.parse_delay("none") == ("none", ())
    assert StragglerSpec.parse_delay("const:0.01") == ("const", (0.01,))
    assert StragglerSpec.parse_delay(" Uniform:0.0, 0.02 ") == ("uniform", (0.0, 0.02))
    assert StragglerSpec.parse_delay("exp:0.01") == ("exp", (0.01,))
    assert StragglerSpec.parse_delay("lognormal:-5,0.5") == ("lognormal", (-5.0, 0.5))
    assert StragglerSpec.parse_delay("pareto:3,0.01") == ("pareto", (3.0, 0.01))
    assert set(DELAY_KINDS) == {"none", "const", "uniform", "exp", "lognormal", "pareto"}


def test_active() -> None:
    assert not StragglerSpec().active
    assert not StragglerSpec(slow_prob=0.5).active  # factor 1: nothing changes
    assert not StragglerSpec(delay="const:0").active
    assert StragglerSpec(slowdown=1.5).active
    assert StragglerSpec(slow_prob=0.1, slow_factor=3).active
    assert StragglerSpec(delay="exp:0.01").active
    assert StragglerSpec(min_step_time=0.01).active


def test_inactive_is_identity() -> None:
    s = Straggler(StragglerSpec(), seed=0)
    assert s.step_time(0.123) == 0.123
    assert s.extra_delay(0.123) == 0.0
    assert s.sample_delay() == 0.0


def test_seeded_reproducibility() -> None:
    spec = StragglerSpec(slowdown=1.2, slow_prob=0.3, slow_factor=4, delay="exp:0.01")
    a, b = Straggler(spec, seed=7), Straggler(spec, seed=7)
    seq_a = [a.step_time(0.01) for _ in range(200)]
    assert seq_a == [b.step_time(0.01) for _ in range(200)]
    c = Straggler(spec, seed=8)
    assert seq_a != [c.step_time(0.01) for _ in range(200)]
    # a (seed, rank) pair works too and differs per rank
    r0, r1 = Straggler(spec, seed=(7, 0)), Straggler(spec, seed=(7, 1))
    assert [r0.step_time(0.01) for _ in range(50)] != [r1.step_time(0.01) for _ in range(50)]
    with pytest.raises(ConfigError, match="seed"):
        Straggler(spec, seed=-1)


def test_slow_and_delay_streams_independent() -> None:
    # changing slow_prob must not change the delays drawn
    a = Straggler(StragglerSpec(delay="exp:0.01"), seed=3)
    b = Straggler(StragglerSpec(delay="exp:0.01", slow_prob=0.5, slow_factor=1.0), seed=3)
    assert [a.step_time(0.0) for _ in range(100)] == [b.step_time(0.0) for _ in range(100)]


def test_slow_step_frequency() -> None:
    p = 0.1
    s = Straggler(StragglerSpec(slow_prob=p, slow_factor=3.0), seed=1)
    times = np.array([s.step_time(1.0) for _ in range(N)])
    assert set(np.unique(times)) == {1.0, 3.0}
    freq = float(np.mean(times == 3.0))
    assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / N)
    assert s.steps == N and s.slow_steps == int(np.sum(times == 3.0))


def test_persistent_slowdown_exact() -> None:
    s = Straggler(StragglerSpec(slowdown=2.5), seed=0)
    for compute in (0.0, 0.01, 0.2, 1.0):
        assert s.step_time(compute) == pytest.approx(2.5 * compute)
        assert s.extra_delay(compute) == pytest.approx(1.5 * compute)


def test_min_step_time_pads_before_factors() -> None:
    s = Straggler(StragglerSpec(min_step_time=0.05, slowdown=2.0), seed=0)
    assert s.step_time(0.01) == pytest.approx(0.1)
    assert s.step_time(0.2) == pytest.approx(0.4)
    always = Straggler(StragglerSpec(min_step_time=0.05, slow_prob=1.0, slow_factor=3.0), seed=0)
    assert always.step_time(0.0) == pytest.approx(0.15)
    assert always.extra_delay(0.01) == pytest.approx(0.14)


def test_const_delay_adds_exactly() -> None:
    s = Straggler(StragglerSpec(delay="const:0.01", slowdown=2.0), seed=0)
    assert s.step_time(0.1) == pytest.approx(0.21)
    assert s.extra_delay(0.1) == pytest.approx(0.11)


@pytest.mark.parametrize(
    ("delay", "mean", "var"),
    [
        ("uniform:0.0,0.02", 0.01, 0.02**2 / 12),
        ("exp:0.01", 0.01, 0.01**2),
        ("lognormal:-5,0.5", math.exp(-5 + 0.125), (math.exp(0.25) - 1) * math.exp(-10 + 0.25)),
        # type I Pareto: mean a*s/(a-1), variance s^2 a / ((a-1)^2 (a-2))
        ("pareto:5,0.01", 5 * 0.01 / 4, 0.01**2 * 5 / (16 * 3)),
    ],
)
def test_delay_sample_means(delay: str, mean: float, var: float) -> None:
    s = Straggler(StragglerSpec(delay=delay), seed=11)
    draws = np.array([s.sample_delay() for _ in range(N)])
    assert np.all(draws >= 0)
    assert abs(draws.mean() - mean) < 5 * math.sqrt(var / N)
    if delay.startswith("pareto"):
        assert draws.min() >= 0.01
    if delay.startswith("uniform"):
        assert draws.max() <= 0.02


def test_extra_delay_never_negative() -> None:
    s = Straggler(StragglerSpec(delay="uniform:0,0.001"), seed=0)
    assert all(s.extra_delay(c) >= 0 for c in np.linspace(0, 1, 100))
    with pytest.raises(ConfigError, match="compute_seconds"):
        s.step_time(-1.0)


def test_inject_sleeps_the_extra() -> None:
    slept: list[float] = []
    s = Straggler(StragglerSpec(slowdown=3.0), seed=0)
    assert s.inject(0.01, sleep=slept.append) == pytest.approx(0.02)
    assert slept == [pytest.approx(0.02)]
    idle = Straggler(StragglerSpec(), seed=0)
    assert idle.inject(0.01, sleep=slept.append) == 0.0
    assert len(slept) == 1  # nothing to inject: no sleep call
