"""A measured model of time for the virtual-time simulator (``paramserver plan``).

Without one, :mod:`.virtual` gives every step a fixed bare compute time and every
message one fixed latency, and shards answer instantly. A :class:`Timing` (fitted
from real runs by :mod:`paramserver.workers.experiments.planfit`) replaces those
guesses:

* a step's bare compute is drawn from the worker's own recorded distribution
  (empirical: the measured values themselves, resampled; a rank the fit has no
  values for draws from every rank's pooled values), then the straggler scenario
  applies on top, as for a real worker;
* every message occupies the sender's NIC and the receiver's NIC for
  ``bytes * per_byte`` (the slower of the two ends), one message at a time per NIC
  and direction, and arrives ``per_message`` seconds after its last byte left;
* a shard decides one push at a time, each taking ``service`` seconds.

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
    #: fixed cost of one message, one way (the simulator sends four per step: push,
    #: its reply, pull, its reply)
    per_message: float = 0.0
    #: seconds per byte of every NIC, and of host K's where ``per_byte_of`` has K
    per_byte: float = 0.0
    per_byte_of: Mapping[int, float] = field(default_factory=dict)
    #: a shard's time to decide one push
    service: float = 0.0

    def __post_init__(self) -> None:
        if not any(self.compute.values()):
            raise ConfigError("a timing model needs at least one measured compute time")
        values = [v for vs in self.compute.values() for v in vs]
        for name, value in [("compute time", min(values)), ("per_message", self.per_message),
                            ("per_byte", self.per_byte), ("service", self.service),
                            *(("per_byte_of", v) for v in self.per_byte_of.values())]:
            if not value >= 0:
                raise ConfigError(f"timing: {name} must be >= 0, got {value}")

    def pooled(self) -> list[float]:
        return [v for _, vs in sorted(self.compute.items()) for v in vs]

    def sampler(self, rank: int, seed: int) -> Compute:
        """The draws of worker ``rank``'s bare compute times, seeded by (seed, rank)."""
        values = list(self.compute.get(rank) or self.pooled())
        return Compute(values, random.Random(f"{seed}:{rank}"))

    def byte_cost(self, host: int) -> float:
        return self.per_byte_of.get(host, self.per_byte)


@dataclass
class Compute:
    """One worker's draws: a measured value picked at random, with replacement."""

    values: list[float]
    rng: random.Random

    def draw(self) -> float:
        return self.values[self.rng.randrange(len(self.values))]


class Links:
    """Every NIC's queue: when each host's send and receive sides are next free."""

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self._tx: dict[int, float] = {}
        self._rx: dict[int, float] = {}

    def arrival(self, now: float, src: int, dst: int, nbytes: int) -> float:
        """When a message of ``nbytes`` sent at ``now`` from host ``src`` lands at ``dst``;
        both NICs are busy with it until its last byte has left."""
        t = self.timing
        start = max(now, self._tx.get(src, 0.0), self._rx.get(dst, 0.0))
        done = start + nbytes * max(t.byte_cost(src), t.byte_cost(dst))
        self._tx[src] = self._rx[dst] = done
        return done + t.per_message
