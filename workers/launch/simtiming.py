"""A measured model of time for the virtual-time simulator (``paramserver plan``).

Without one, :mod:`.virtual` gives every step a fixed bare compute time and every
message one fixed latency, and shards answer instantly. A :class:`Timing` (fitted
from real runs by :mod:`paramserver.workers.experiments.planfit`) replaces those
guesses:

* a step's bare compute is drawn from the worker's own recorded distribution
  (empirical: the measured values themselves, resampled; a rank the fit has no
  values for draws from every rank's pooled values), then the straggler scenario
  applies on top, as for a real worker; the same draw's overhead (what a worker
  does off the wire besides computing: its evaluations, its bookkeeping; per push)
  is added after, untouched by the scenario, as a real worker's is;
* every NIC, each way, is a token bucket (what ``tc tbf`` makes of an emulated
  host's NIC): it passes bytes at its rate (``1 / per_byte``), and up to
  ``burst`` bytes at once after a pause (``burst_floor`` bytes or ``burst_seconds``
  at the rate, the larger; both 0: a plain NIC, one byte after another at its
  rate). A message passes the sender's bucket and the receiver's, one message at a
  time each, and arrives ``per_message`` seconds after the later of the two;
* a shard decides one push at a time, each taking ``service`` seconds;
* a local-SGD push (H inner steps, then the pseudo-gradient) costs H compute
  draws, one overhead and one draw of ``round_extra``: what a round does besides its steps (the
  copy of the weights it starts from, the pseudo-gradient, the inner optimizer's
  steps), measured per push by the fit or estimated in-process by the planner.

Hosts are numbered as ``launch --hosts N+S`` numbers them: worker ``r`` is host
``r``, shard ``k`` host ``N + k``. Pure: no clock, no I/O; the randomness is a
seeded :class:`random.Random` per worker.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from paramserver.errors import ConfigError

__all__ = ["Links", "Timing"]


@dataclass(frozen=True)
class Timing:
    """What the simulator's time is made of (seconds, bytes)."""

    #: rank -> that worker's measured bare compute times per step
    compute: Mapping[int, Sequence[float]]
    #: rank -> the overhead per push measured with each of those steps (same length;
    #: absent: none)
    overhead: Mapping[int, Sequence[float]] = field(default_factory=dict)
    #: fixed cost of one message, one way (the simulator sends four per step: push,
    #: its reply, pull, its reply)
    per_message: float = 0.0
    #: seconds per byte of every NIC, and of host K's where ``per_byte_of`` has K
    per_byte: float = 0.0
    per_byte_of: Mapping[int, float] = field(default_factory=dict)
    #: the NICs' buckets (see the module doc); 0 and 0: no burst
    burst_floor: float = 0.0
    burst_seconds: float = 0.0
    #: a shard's time to decide one push
    service: float = 0.0
    #: seconds a local-SGD push costs besides its H steps' draws (resampled; empty: none)
    round_extra: Sequence[float] = ()

    def __post_init__(self) -> None:
        if not any(self.compute.values()):
            raise ConfigError("a timing model needs at least one measured compute time")
        values = [v for vs in [*self.compute.values(), *self.overhead.values()] for v in vs]
        for rank, extra in self.overhead.items():
            if len(extra) != len(self.compute.get(rank, ())):
                raise ConfigError(f"timing: worker {rank} has {len(extra)} overheads for "
                                  f"{len(self.compute.get(rank, ()))} compute times")
        for name, value in [("compute time", min(values)), ("per_message", self.per_message),
                            ("per_byte", self.per_byte), ("service", self.service),
                            ("burst_floor", self.burst_floor),
                            ("burst_seconds", self.burst_seconds),
                            *(("round_extra", v) for v in self.round_extra),
                            *(("per_byte_of", v) for v in self.per_byte_of.values())]:
            if not value >= 0:
                raise ConfigError(f"timing: {name} must be >= 0, got {value}")

    def _pairs(self, rank: int) -> list[tuple[float, float]]:
        values = self.compute.get(rank, ())
        extra = self.overhead.get(rank) or [0.0] * len(values)
        return list(zip(values, extra, strict=True))

    def sampler(self, rank: int, seed: int) -> Compute:
        """The draws of worker ``rank``'s (compute, overhead), seeded by (seed, rank)."""
        pairs = self._pairs(rank) or [p for r in sorted(self.compute) for p in self._pairs(r)]
        return Compute(pairs, random.Random(f"{seed}:{rank}"), list(self.round_extra))

    def byte_cost(self, host: int) -> float:
        return self.per_byte_of.get(host, self.per_byte)

    def burst(self, host: int) -> float:
        """Bytes host ``host``'s NIC passes at once, after a pause."""
        cost = self.byte_cost(host)
        return max(self.burst_floor, self.burst_seconds / cost if cost > 0 else 0.0)


@dataclass
class Compute:
    """One worker's draws: a measured step picked at random, with replacement."""

    values: list[tuple[float, float]]  # (compute, overhead)
    rng: random.Random
    rounds: list[float] = field(default_factory=list)  # a local-SGD push's extra cost

    def draw(self) -> tuple[float, float]:
        return self.values[self.rng.randrange(len(self.values))]

    def draw_round(self) -> float:
        """What one local-SGD push costs besides its steps (0 where nothing was given)."""
        return self.rounds[self.rng.randrange(len(self.rounds))] if self.rounds else 0.0


@dataclass
class _Bucket:
    tokens: float  # bytes it may pass at once
    last: float  # when ``tokens`` was counted
    free: float  # when the message before has passed


class Links:
    """Every NIC's two token buckets (send, receive)."""

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self._buckets: dict[tuple[int, str], _Bucket] = {}

    def _pass(self, host: int, way: str, now: float, nbytes: int) -> float:
        """When the last of ``nbytes`` offered at ``now`` has passed this NIC's bucket."""
        cost = self.timing.byte_cost(host)
        if cost <= 0:
            return now
        burst = self.timing.burst(host)
        b = self._buckets.setdefault((host, way), _Bucket(burst, 0.0, 0.0))
        start = max(now, b.free)
        tokens = min(burst, b.tokens + (start - b.last) / cost)
        done = start + max(0.0, nbytes - tokens) * cost
        b.tokens, b.last, b.free = max(0.0, tokens - nbytes), done, done
        return done

    def arrival(self, now: float, src: int, dst: int, nbytes: int) -> float:
        """When a message of ``nbytes`` sent at ``now`` from host ``src`` lands at ``dst``."""
        done = max(self._pass(src, "tx", now, nbytes), self._pass(dst, "rx", now, nbytes))
        return done + self.timing.per_message
