"""Straggler injection for experiments: make a worker slower on purpose.

A :class:`StragglerSpec` says how one worker is slowed: a persistent factor,
transient slow steps with a probability, an extra random delay per step, and a
floor on the step time. A :class:`Straggler` samples, from its own seeded
generator, how long each step *should* take given how long the real compute
took. The sampling is pure (no clock, no sleeping), so a virtual-time
simulator can reuse it; :meth:`Straggler.inject` is the one place that sleeps.

That sleep *is* the injected slowness: it stands for compute this worker
would be doing on slower hardware. It is not synchronisation and never waits
for another process; waiting for peers belongs to the server's consistency
rules.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from paramserver.errors import ConfigError
from paramserver.server.config import option

__all__ = ["DELAY_KINDS", "STRAGGLER_KEYS", "Straggler", "StragglerSpec", "parse_straggler_items"]

#: delay kind -> parameter names, in the order they are written after "kind:"
DELAY_KINDS: dict[str, tuple[str, ...]] = {
    "none": (),
    "const": ("seconds",),
    "uniform": ("low", "high"),
    "exp": ("mean",),
    "lognormal": ("mu", "sigma"),
    "pareto": ("alpha", "scale"),
}

_DELAY_HELP = (
    'delay must be "" (none), "const:S", "uniform:LOW,HIGH", "exp:MEAN", '
    '"lognormal:MU,SIGMA" (of the underlying normal) or "pareto:ALPHA,SCALE", in seconds'
)


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"straggler {name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"straggler {name} must be finite, got {value!r}")
    return number


def _delay_problem(kind: str, p: tuple[float, ...]) -> str:
    """What is wrong with a delay's parameters ("" if nothing)."""
    if kind in ("const", "exp") and p[0] < 0:
        return "the value must be >= 0"
    if kind == "uniform" and not 0 <= p[0] <= p[1]:
        return "need 0 <= LOW <= HIGH"
    if kind == "lognormal" and p[1] < 0:
        return "SIGMA must be >= 0"
    if kind == "pareto" and not (p[0] > 0 and p[1] > 0):
        return "need ALPHA > 0 and SCALE > 0"
    return ""


@dataclass(frozen=True)
class StragglerSpec:
    """How one worker is slowed down; validated on construction.

    A step's time is ``max(compute, min_step_time) * slowdown``, times
    ``slow_factor`` with probability ``slow_prob``, plus a ``delay`` sample.
    """

    #: persistent factor >= 1 on this worker's compute time
    slowdown: float = option(1.0, min=1, metavar="F",
                             help="Stragglers: every step takes F times its compute time.")
    #: probability that a step is transiently slow...
    slow_prob: float = option(0.0, min=0, max=1, metavar="P",
                              help="Stragglers: a step is transiently slow with probability "
                                   "P...")
    #: ...by this factor (>= 1)
    slow_factor: float = option(1.0, min=1, metavar="F", help="...by the factor F.")
    #: extra random delay per step; see parse_delay
    delay: str = option("", metavar="KIND:ARGS",
                        help="Stragglers: random extra seconds per step: const:S, "
                             "uniform:LOW,HIGH, exp:MEAN, lognormal:MU,SIGMA or "
                             "pareto:ALPHA,SCALE.")
    #: seconds; emulates a heavier model on a fast task
    min_step_time: float = option(0.0, min=0, metavar="SECONDS",
                                  help="Stragglers: floor on a step's compute time (emulates a "
                                       "heavier model).")

    def __post_init__(self) -> None:
        if _number(self.slowdown, "slowdown") < 1.0:
            raise ConfigError(f"straggler slowdown must be >= 1, got {self.slowdown}")
        if not 0.0 <= _number(self.slow_prob, "slow_prob") <= 1.0:
            raise ConfigError(f"straggler slow_prob must be in [0, 1], got {self.slow_prob}")
        if _number(self.slow_factor, "slow_factor") < 1.0:
            raise ConfigError(f"straggler slow_factor must be >= 1, got {self.slow_factor}")
        if _number(self.min_step_time, "min_step_time") < 0.0:
            raise ConfigError(
                f"straggler min_step_time must be >= 0 seconds, got {self.min_step_time}"
            )
        if not isinstance(self.delay, str):
            raise ConfigError(f"{_DELAY_HELP}; got {self.delay!r}")
        self.parse_delay(self.delay)

    @classmethod
    def parse_delay(cls, spec: str) -> tuple[str, tuple[float, ...]]:
        """Parse a delay spec into ``(kind, params)``; ``""`` or ``"none"`` is ``("none", ())``.

        ``pareto:ALPHA,SCALE`` is the classical (type I) Pareto: samples are
        >= SCALE, mean ``ALPHA * SCALE / (ALPHA - 1)`` for ALPHA > 1.
        """
        text = spec.strip()
        if text == "" or text.lower() == "none":
            return "none", ()
        kind, sep, rest = text.partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in DELAY_KINDS or kind == "none":
            raise ConfigError(f"{_DELAY_HELP}; got {spec!r}")
        names = DELAY_KINDS[kind]
        try:
            params = tuple(float(part) for part in rest.split(","))
        except ValueError as exc:
            raise ConfigError(f"{_DELAY_HELP}; got {spec!r}") from exc
        if len(params) != len(names) or not all(math.isfinite(p) for p in params):
            raise ConfigError(
                f"delay {kind!r} takes {len(names)} finite number(s) "
                f"({','.join(n.upper() for n in names)}); got {spec!r}"
            )
        problem = _delay_problem(kind, params)
        if problem:
            raise ConfigError(f"delay {spec!r}: {problem}")
        return kind, params

    @property
    def active(self) -> bool:
        """Whether this spec injects anything at all."""
        kind, params = self.parse_delay(self.delay)
        return (
            self.slowdown != 1.0
            or (self.slow_prob > 0.0 and self.slow_factor != 1.0)
            or self.min_step_time > 0.0
            or (kind != "none" and any(p != 0.0 for p in params))
        )


class Straggler:
    """Seeded sampler of step times for one worker.

    ``seed`` may be an int or a sequence of ints, e.g. ``(run_seed, rank)``.
    Slow-step draws and delay draws use two independent streams, so changing
    ``slow_prob`` does not change the delays drawn, and vice versa.
    """

    def __init__(self, spec: StragglerSpec, seed: int | Sequence[int]) -> None:
        self.spec = spec
        self._kind, self._params = spec.parse_delay(spec.delay)
        try:
            slow_seq, delay_seq = np.random.SeedSequence(seed).spawn(2)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"straggler seed must be int(s) >= 0, got {seed!r}") from exc
        self._slow_rng = np.random.default_rng(slow_seq)
        self._delay_rng = np.random.default_rng(delay_seq)
        self.steps = 0  # step_time calls so far
        self.slow_steps = 0  # of which were transiently slow

    def sample_delay(self) -> float:
        """One draw of the extra per-step delay, in seconds (0.0 without a delay)."""
        kind, p, rng = self._kind, self._params, self._delay_rng
        if kind == "none":
            return 0.0
        if kind == "const":
            return p[0]
        if kind == "uniform":
            return float(rng.uniform(p[0], p[1]))
        if kind == "exp":
            return float(rng.exponential(p[0])) if p[0] > 0 else 0.0
        if kind == "lognormal":
            return float(rng.lognormal(p[0], p[1]))
        # numpy's pareto is the Lomax (starts at 0); shift and scale to type I
        return float(p[1] * (1.0 + rng.pareto(p[0])))

    def step_time(self, compute_seconds: float) -> float:
        """Total time, in seconds, a step whose compute took ``compute_seconds`` should take."""
        compute = _number(compute_seconds, "compute_seconds")
        if compute < 0:
            raise ConfigError(f"compute_seconds must be >= 0, got {compute_seconds}")
        spec = self.spec
        total = max(compute, spec.min_step_time) * spec.slowdown
        self.steps += 1
        if spec.slow_prob > 0.0 and self._slow_rng.random() < spec.slow_prob:
            self.slow_steps += 1
            total *= spec.slow_factor
        return total + self.sample_delay()

    def extra_delay(self, compute_seconds: float) -> float:
        """Seconds to wait on top of the real compute: ``step_time(...) - compute``, >= 0."""
        return max(0.0, self.step_time(compute_seconds) - compute_seconds)

    def inject(
        self, compute_seconds: float, sleep: Callable[[float], object] = time.sleep
    ) -> float:
        """Sleep for :meth:`extra_delay` (the injected slowness) and return the seconds slept."""
        extra = self.extra_delay(compute_seconds)
        if extra > 0.0:
            sleep(extra)
        return extra


#: the straggler options one worker may override (``--straggler RANK:KEY=VALUE``)
STRAGGLER_KEYS = ("slowdown", "slow_prob", "slow_factor", "delay", "min_step_time")


def parse_straggler_items(items: Sequence[str]) -> dict[str, float | str]:
    """``["RANK:KEY=VALUE"]`` -> ``{"RANK:KEY": value}`` (a number, or the delay's text)."""
    out: dict[str, float | str] = {}
    for item in items:
        rank, sep, rest = item.partition(":")
        key, sep2, value = rest.partition("=")
        key = key.strip().replace("-", "_")
        if not (sep and sep2 and rank.strip().isdigit()) or key not in STRAGGLER_KEYS:
            raise ConfigError(
                f"straggler {item!r} must look like RANK:KEY=VALUE with KEY one of "
                f"{', '.join(STRAGGLER_KEYS)}, e.g. 1:slowdown=3 or 2:delay=exp:0.05"
            )
        out[f"{int(rank)}:{key}"] = value.strip() if key == "delay" else _finite(value, item)
    return out


def _finite(text: str, item: str) -> float:
    try:
        number = float(text)
    except ValueError as exc:
        raise ConfigError(f"straggler {item!r}: {text!r} is not a number") from exc
    if not math.isfinite(number):
        raise ConfigError(f"straggler {item!r}: {text!r} is not finite")
    return number
