"""Adaptive SSP bound: move s within [s_min, s_max] from measured waiting and staleness.

A fixed SSP bound trades two costs against each other: a small s makes fast
workers wait at the gate for the slowest one, a large s lets updates grow
stale. :class:`AdaptiveBound` watches both on one shard and moves s by one
step at a time, once per *window* of pushes:

* ``wait_share`` = time pulls were held at the gate during the window /
  (window duration x live workers): the fraction of worker time lost waiting;
* ``stale_ratio`` = mean staleness tau of the window's pushes /
  max(1, live workers - 1): staleness relative to evenly paced async, where
  each update is about (workers - 1) versions old.

Then, in this order of priority::

    stale_ratio > stale_high  ->  s - 1   (updates far staler than plain async: tighten)
    wait_share  > wait_high   ->  s + 1   (workers lose too much time waiting: loosen)
    wait_share  < wait_low    ->  s - 1   (waiting is cheap: buy back freshness)
    otherwise                 ->  s       (inside the band)

always clipped to [s_min, s_max]. The bound starts at the shard's configured
``staleness_bound`` clipped to that range. The rule is pure: it reads only
the :class:`~paramserver.policies.BoundStats` the core hands it (time is the
core's ``now`` argument), so it runs the same under the socket server and in
the virtual-time simulator. ``ssp-adaptive`` in :mod:`paramserver.policies.research`
plugs it into the core.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paramserver.errors import ConfigError

if TYPE_CHECKING:  # staleness imports this package's policies, which import us
    from paramserver.policies.base import BoundStats

__all__ = ["AdaptiveBound", "BoundWindow"]


@dataclass(frozen=True)
class BoundWindow:
    """What one window measured and what the rule did with it."""

    start: float
    end: float
    pushes: int
    wait_share: float
    stale_ratio: float
    before: int
    after: int


class AdaptiveBound:
    """The adaptive SSP bound rule (see the module docstring); one instance per shard."""

    def __init__(
        self,
        s_min: int = 1,
        s_max: int = 8,
        window: int = 0,
        wait_high: float = 0.10,
        wait_low: float = 0.02,
        stale_high: float = 4.0,
    ) -> None:
        if s_min < 0 or s_max < s_min:
            raise ConfigError(f"adaptive bound: need 0 <= s_min <= s_max, got {s_min}, {s_max}")
        if window < 0:
            raise ConfigError(f"adaptive bound: window must be >= 0 pushes (0: 4 per live "
                              f"worker), got {window}")
        if not 0.0 <= wait_low <= wait_high <= 1.0:
            raise ConfigError(
                f"adaptive bound: need 0 <= wait_low <= wait_high <= 1 (shares of worker "
                f"time), got {wait_low}, {wait_high}"
            )
        if not stale_high > 0 or math.isnan(stale_high):
            raise ConfigError(f"adaptive bound: stale_high must be > 0, got {stale_high}")
        self.s_min, self.s_max, self.window = int(s_min), int(s_max), int(window)
        self.wait_high, self.wait_low, self.stale_high = (
            float(wait_high), float(wait_low), float(stale_high)
        )
        self.bound: int | None = None  # None until the first call
        # cumulative counters at the start of the current window
        self._mark: tuple[float, int, int, float] | None = None  # now, pushes, tau sum, wait
        self.history: list[BoundWindow] = []

    def clip(self, s: int) -> int:
        return max(self.s_min, min(self.s_max, s))

    def window_for(self, live_workers: int) -> int:
        """Pushes per decision: ``window``, or 4 per live worker when it is 0."""
        return self.window or 4 * max(1, live_workers)

    def update(self, stats: BoundStats) -> int:
        """The bound to enforce now, given the shard's cumulative measurements."""
        if self.bound is None:
            self.bound = self.clip(stats.configured)
        if self._mark is None:
            self._mark = (stats.now, stats.pushes, stats.staleness_sum, stats.wait_seconds)
            return self.bound
        t0, pushes0, tau0, wait0 = self._mark
        pushes = stats.pushes - pushes0
        if pushes < self.window_for(stats.live_workers):
            return self.bound
        elapsed = stats.now - t0
        live = max(1, stats.live_workers)
        wait_share = (stats.wait_seconds - wait0) / (elapsed * live) if elapsed > 0 else 0.0
        stale_ratio = (stats.staleness_sum - tau0) / pushes / max(1, live - 1)
        before = self.bound
        if stale_ratio > self.stale_high:
            self.bound = self.clip(before - 1)
        elif wait_share > self.wait_high:
            self.bound = self.clip(before + 1)
        elif wait_share < self.wait_low:
            self.bound = self.clip(before - 1)
        self.history.append(BoundWindow(t0, stats.now, pushes, wait_share, stale_ratio,
                                        before, self.bound))
        self._mark = (stats.now, stats.pushes, stats.staleness_sum, stats.wait_seconds)
        return self.bound

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state; the window in progress restarts after a restore."""
        return {"bound": self.bound, "windows": len(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        bound = state.get("bound")
        self.bound = None if bound is None else self.clip(int(bound))
        self._mark = None  # counters restart with the restored shard's clock
