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

import time
from collections.abc import Callable, Sequence

import numpy as np

from paramserver.errors import ConfigError
from paramserver.workers.stragglerspec import (
    DELAY_KINDS,
    STRAGGLER_KEYS,
    StragglerSpec,
    finite_number,
    parse_straggler_items,
)

__all__ = ["DELAY_KINDS", "STRAGGLER_KEYS", "Straggler", "StragglerSpec", "parse_straggler_items"]


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
        compute = finite_number(compute_seconds, "compute_seconds")
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
