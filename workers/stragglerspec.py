"""How a worker is slowed down, as configured: :class:`StragglerSpec` and the
``--straggler RANK:KEY=VALUE`` parser. Apart from stragglers.py (the seeded sampler,
which needs numpy) so that the CLI declares the straggler options without loading it;
importable from ``paramserver.workers.stragglers`` too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from paramserver.errors import ConfigError
from paramserver.server.config import option

__all__ = ["DELAY_KINDS", "STRAGGLER_KEYS", "StragglerSpec", "finite_number",
           "parse_straggler_items"]

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


def finite_number(value: object, name: str) -> float:
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
        if finite_number(self.slowdown, "slowdown") < 1.0:
            raise ConfigError(f"straggler slowdown must be >= 1, got {self.slowdown}")
        if not 0.0 <= finite_number(self.slow_prob, "slow_prob") <= 1.0:
            raise ConfigError(f"straggler slow_prob must be in [0, 1], got {self.slow_prob}")
        if finite_number(self.slow_factor, "slow_factor") < 1.0:
            raise ConfigError(f"straggler slow_factor must be >= 1, got {self.slow_factor}")
        if finite_number(self.min_step_time, "min_step_time") < 0.0:
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
