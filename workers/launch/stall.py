"""Noticing that a running cluster stopped making progress, before anyone asks.

A run can hang: a sync barrier waits for a worker that waits for a shard, or
a restarted shard answers nobody. Its progress bar then just stops, nothing
says why, and without ``--run-timeout`` it waits for ever. :class:`StallWatch`
is the launcher's rule for saying so. Once it has seen a first step, a run
that logs no step for ``after`` seconds, or for ten times its usual time per
step if that is longer (a big model's slow steps are no stall), is reported;
then again at twice that quiet, four times, and so on, until a step comes and
it reports that progress resumed. Pure: the launcher passes the step count
and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PACE_FACTOR", "StallNotice", "StallRecord", "StallWatch"]

#: quiet longer than this many of the run's usual seconds per step is a stall
PACE_FACTOR = 10


@dataclass(frozen=True)
class StallNotice:
    """What :meth:`StallWatch.update` has to report."""

    stalled: bool  # True: no step for ``quiet`` seconds; False: steps resumed after it
    quiet: float  # seconds without a step
    pace: float  # the run's seconds per step before the quiet (0: not known yet)


@dataclass(frozen=True)
class StallRecord:
    """A notice the launcher gave (a stall, or steps resuming) and when."""

    stalled: bool
    quiet: float
    pace: float
    t: float  # time.time()


class StallWatch:
    """Reports a run with no step for ``after`` seconds or ``PACE_FACTOR`` times
    its pace, whichever is longer (``after`` 0: never)."""

    def __init__(self, after: float) -> None:
        self.after = after
        self._last: tuple[float, int] | None = None  # (when, steps) of the latest step seen
        self._level = 0  # notices given for this quiet spell
        # the time between steps and the steps it brought, quiet spells that were
        # reported left out (a shard's restart is not the run's pace)
        self._active = 0.0
        self._counted = 0

    def pace(self) -> float:
        """The run's seconds per step so far (0: not known yet)."""
        return self._active / self._counted if self._counted else 0.0

    def limit(self) -> float:
        """How much quiet the next notice needs."""
        return max(self.after, PACE_FACTOR * self.pace()) * (1 << self._level)

    def update(self, steps: int, now: float) -> StallNotice | None:
        """The run's steps so far, at ``now`` (monotonic seconds); what to report now."""
        if self.after <= 0:
            return None
        last = self._last
        if last is None or steps != last[1]:
            notice = None
            if last is not None and self._level:
                notice = StallNotice(False, now - last[0], self.pace())
            elif last is not None and last[1] and steps > last[1]:
                self._active += now - last[0]
                self._counted += steps - last[1]
            self._last = (now, steps)
            self._level = 0
            return notice
        if not steps:
            return None  # armed from the first step on: starting up is not a stall
        quiet = now - last[0]
        if quiet < self.limit():
            return None
        self._level += 1
        return StallNotice(True, quiet, self.pace())
