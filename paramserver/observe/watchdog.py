"""The silent-divergence watchdog: pure rules over what one shard observes.

A :class:`Watchdog` is fed observations by the shard server (each push, each
optimizer step, the live workers' clocks) and returns :class:`Alarm` objects
when a rule fires. It does no I/O, reads no clock and holds no lock, so the
same rules run under the server, in unit tests and over recorded event logs.

Signals (thresholds are fields of :class:`WatchdogConfig`; docs/observability.md
says what each means and what to do):

* ``nonfinite_gradient`` / ``nonfinite_weights`` / ``nonfinite_loss``: NaN or Inf.
* ``update_ratio_low`` / ``update_ratio_high``: ``|update| / |weights|`` per
  step out of band (nothing is learned / blow-up).
* ``loss_stalled`` / ``loss_rising``: the reported training loss stops
  improving before it ever fell much, or rises, while updates are applied. A
  loss that fell and then flattens is a *hint* (``loss_converged``), not an alarm.
* ``rejection_rate``: the staleness policy rejects so much that training starves.
* ``worker_lag``: one worker's clock lag (async) or staleness grows without bound.
* ``zero_gradient``: one worker pushes all-zero gradients while the others do not.
* ``gradient_disagrees``: one worker's gradient points away from the others'
  (cosine to the shard's running mean gradient).

Only alarms about the model's own state (:data:`DIVERGENCE`, and a non-finite
gradient that was applied) are divergence, which ``--on-divergence`` may stop a
shard for; a push the shard refused is a peer's fault, alarmed and counted only.

Each rule states the longest delay, in pushes, within which it fires on a failure
that persists, at any measuring budget (:func:`delay`; docs/observability.md, Cost).

Each alarm fires once per (signal, worker) and then stays quiet for
``cooldown`` pushes, so a persistent condition is reported, not spammed. The
loss rules work by episodes instead (hysteresis): ``loss_stalled`` fires once
when the stall begins and may fire again only after the loss has improved
significantly in between.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from paramserver.observe import records as ev
from paramserver.observe.thresholds import ACTIONS, DIVERGENCE, HINTS, SIGNALS, WatchdogConfig
from paramserver.util.jsontypes import JSONObject
from paramserver.wire.stats import AlarmEntry, Figure

__all__ = [
    "ACTIONS",
    "DIVERGENCE",
    "HINTS",
    "SIGNALS",
    "Alarm",
    "Delay",
    "PushObservation",
    "Reads",
    "Scope",
    "StepObservation",
    "Watchdog",
    "WatchdogConfig",
    "delay",
    "delays",
]

@dataclass(frozen=True)
class Alarm:
    """One rule that fired: which signal, where, the figures behind it, and a message."""

    signal: str
    shard: int | None
    worker: int | None
    figures: Mapping[str, Figure]
    message: str
    version: int | None = None  # the shard version when it fired
    #: about the model's own state, so --on-divergence acts on it (DIVERGENCE); False:
    #: a peer's fault or the server's own, reported and counted only
    divergence: bool = False

    def entry(self) -> AlarmEntry:
        """As STATS lists it and an ``alarm`` event writes it."""
        return AlarmEntry(self.signal, self.shard, self.worker, self.version,
                          dict(self.figures), self.message)

    def as_event(self, kind: type[ev.Alarm] | type[ev.Hint]) -> ev.Alarm | ev.Hint:
        """Its ``alarm`` (or ``hint``) record."""
        return kind(signal=self.signal, shard=self.shard, worker=self.worker,
                    version=self.version, figures=dict(self.figures.items()),
                    message=self.message)

    def as_dict(self) -> JSONObject:
        """As an ``alarm`` event writes it (the keys of :meth:`entry`)."""
        return {"signal": self.signal, "shard": self.shard, "worker": self.worker,
                "version": self.version, "figures": dict(self.figures.items()),
                "message": self.message}


@dataclass(frozen=True)
class PushObservation:
    """One push as the shard decided it (duplicates are not observed)."""

    worker: int
    version: int  # the shard's version after handling the push
    accepted: bool
    staleness: int = 0
    reason: str = ""
    weight: float = 1.0
    grad_norm: float | None = None  # NaN/Inf: the gradient held non-finite values
    cosine: float | None = None  # to the shard's running mean gradient (before this push)
    loss: float | None = None  # training loss the worker reported with the push
    #: whether that loss may stop the shard: a claim, not a measurement, so under CURVE
    #: only an admin key's (server.access.Access.may_stop); any loss raises alarms
    loss_may_stop: bool = True


@dataclass(frozen=True)
class StepObservation:
    """One optimizer step: the norms of the update and of the weights after it."""

    version: int
    update_norm: float
    weight_norm: float
    lr: float = 0.0


@dataclass
class _WorkerWindow:
    pushes: deque[bool] = field(default_factory=deque)  # rejected?
    rejected: float = 0.0  # sum of pushes (kept with it: O(1) per push)
    norms: deque[float] = field(default_factory=deque)
    cosines: deque[float] = field(default_factory=deque)
    cosine_sum: float = 0.0
    cosine_sq: float = 0.0  # sum of squares, for the window's variance
    staleness: deque[int] = field(default_factory=deque)
    lags: deque[float] = field(default_factory=deque)
    lag_since: float | None = None  # when its lag condition last became true


def _push(window: deque[Any], value: Any, size: int) -> Any:
    """Append; drop and return the oldest value beyond ``size`` (else 0)."""
    window.append(value)
    return window.popleft() if len(window) > size else 0


def _variance(win: _WorkerWindow) -> float:
    n = len(win.cosines)
    if n < 2:
        return 0.0
    mean = win.cosine_sum / n
    return max(0.0, (win.cosine_sq - n * mean * mean) / (n - 1))


def _fmt(x: float) -> str:
    return f"{x:.3g}"


class Watchdog:
    """The rules for one shard. ``shard=None`` for a process-level instance."""

    def __init__(self, shard: int | None = None, config: WatchdogConfig | None = None, *,
                 bounded_lag: bool = False) -> None:
        self.config = config or WatchdogConfig()
        self.shard = shard
        # sync and ssp bound every clock gap by construction: no lag can grow forever
        self.bounded_lag = bounded_lag
        self.elements: int | None = None  # weights the shard holds (the server sets it)
        self.pushes = 0  # observed, shard-wide
        self.steps = 0
        self.version = 0
        self.alarms: list[Alarm] = []
        self._fired: dict[tuple[str, int | None], int] = {}  # key -> push count when fired
        self._workers: dict[int, _WorkerWindow] = {}
        self._rejected: deque[bool] = deque()
        self._rejected_sum = 0.0
        self._norm_ema: float | None = None  # running mean of every push's gradient norm
        self._rejected_by: deque[int] = deque()
        self._ratios: deque[float] = deque()
        self._loss_block: list[float] = []
        self._loss_blocks: list[float] = []  # block means
        self._applied_in_block = 0
        self._stale_blocks = 0  # blocks in a row that did not improve on the best
        self._rising_blocks = 0  # blocks in a row well above the best
        #: a loss the rules read (their reference too) was claimed by a key that may not
        #: stop the shard: the loss alarms are reported, never acted on, from then on
        self._loss_claimed = False
        self._first_median: float | None = None  # of the first block: where the loss began
        self._best_median: float | None = None  # best block median (significant gains only)
        self._stalled = False  # a loss_stalled episode is open (until the loss improves)
        self._converged = False  # a loss_converged hint was given (until it improves)
        self._episodes: dict[str, int] = {}  # signal -> episodes opened
        self.hints: list[Alarm] = []  # informational; the server logs them, nothing else
        self._new_hints: list[Alarm] = []

    # ------------------------------------------------------------------ plumbing

    def _enabled(self, signal: str) -> bool:
        return self.config.enabled and signal not in self.config.disable

    def _fire(self, out: list[Alarm], signal: str, worker: int | None,
              figures: Mapping[str, Figure], message: str, *, episodic: bool = False,
              divergence: bool | None = None) -> None:
        """``episodic``: the rule itself fires once per episode; no cooldown on top.
        ``divergence``: whether --on-divergence acts on it (None: ``signal in DIVERGENCE``)."""
        if not self._enabled(signal):
            return
        key = (signal, worker)
        last = self._fired.get(key)
        if not episodic and last is not None and self.pushes - last < self.config.cooldown:
            return
        self._fired[key] = self.pushes
        where = f"shard {self.shard}" if self.shard is not None else "run"
        who = f", worker {worker}" if worker is not None else ""
        alarm = Alarm(signal, self.shard, worker, dict(figures),
                      f"[{signal}] {where}{who}: {message}", self.version,
                      signal in DIVERGENCE if divergence is None else divergence)
        self.alarms.append(alarm)
        out.append(alarm)

    def _episode(self, signal: str) -> int:
        """Open the next episode of ``signal``; its number is in the alarm's figures, so
        that a launcher shows one line for the same episode on every shard."""
        self._episodes[signal] = self._episodes.get(signal, 0) + 1
        return self._episodes[signal]

    def take_hints(self) -> list[Alarm]:
        """Hints given since the last call (the server writes them as ``hint`` events)."""
        hints, self._new_hints = self._new_hints, []
        return hints

    def _window(self, worker: int) -> _WorkerWindow:
        win = self._workers.get(worker)
        if win is None:
            win = self._workers[worker] = _WorkerWindow()
        return win

    def forget(self, worker: int) -> None:
        """A worker left or died: it no longer counts among "the others"."""
        self._workers.pop(worker, None)

    # ------------------------------------------------------------------ observations

    def observe_push(self, obs: PushObservation) -> list[Alarm]:
        cfg = self.config
        out: list[Alarm] = []
        self.pushes += 1
        self.version = max(self.version, obs.version)
        win = self._window(obs.worker)
        rejected = not obs.accepted
        # counted from the pushes, not the steps: a step is observed only when measured,
        # and a sampled shard's blocks of losses must not look like nothing was applied
        self._applied_in_block += obs.accepted
        if obs.grad_norm is not None and not math.isfinite(obs.grad_norm):
            fate = ("it was applied (--no-check-finite): the weights are broken now"
                    if obs.accepted else "it was refused, the weights are unchanged (a fault of "
                    "this worker, not divergence: --on-divergence does not stop for it)")
            # refused, it is one peer's fault and the weights are as they were; applied,
            # the weights are broken: that is the model diverging
            self._fire(out, "nonfinite_gradient", obs.worker, {"grad_norm": obs.grad_norm},
                       f"the pushed gradient holds NaN or Inf; {fate}. Look for overflow in "
                       "this worker's loss, or a learning rate that blew the weights up",
                       divergence=obs.accepted)
            rejected = True
        if obs.loss is not None and not math.isfinite(obs.loss):
            self._fire(out, "nonfinite_loss", obs.worker, {"loss": obs.loss},
                       "the worker reports a NaN or Inf training loss")
        win.rejected += rejected - _push(win.pushes, rejected, cfg.reject_window)
        self._rejected_sum += rejected - _push(self._rejected, rejected, cfg.reject_window)
        self._check_rejections(out, obs.worker, win)
        _push(win.staleness, obs.staleness, 2 * cfg.staleness_window)
        self._check_staleness(out, obs.worker, win)
        if obs.grad_norm is not None and math.isfinite(obs.grad_norm):
            self._norm_ema = obs.grad_norm if self._norm_ema is None \
                else 0.9 * self._norm_ema + 0.1 * obs.grad_norm
            _push(win.norms, obs.grad_norm, cfg.zero_window)
            self._check_zero(out, obs.worker, win)
        if obs.cosine is not None and math.isfinite(obs.cosine):
            old = _push(win.cosines, obs.cosine, cfg.cosine_window)
            win.cosine_sum += obs.cosine - old
            win.cosine_sq += obs.cosine * obs.cosine - old * old
            self._check_cosine(out, obs.worker, win)
        if obs.loss is not None and math.isfinite(obs.loss):
            self._loss_claimed |= not obs.loss_may_stop
            self._observe_loss(out, obs.loss)
        return out

    def observe_step(self, obs: StepObservation) -> list[Alarm]:
        cfg = self.config
        out: list[Alarm] = []
        self.steps += 1
        self.version = max(self.version, obs.version)
        if not (math.isfinite(obs.weight_norm) and math.isfinite(obs.update_norm)):
            self._fire(out, "nonfinite_weights", None,
                       {"weight_norm": obs.weight_norm, "update_norm": obs.update_norm,
                        "lr": obs.lr},
                       f"the weights hold NaN or Inf after step {obs.version}: training "
                       "diverged; restart from a checkpoint with a lower learning rate")
            return out
        ratio = obs.update_norm / obs.weight_norm if obs.weight_norm > 0 else 0.0
        _push(self._ratios, ratio, max(cfg.ratio_window, cfg.ratio_high_window))
        recent = list(self._ratios)
        high = statistics.median(recent[-cfg.ratio_high_window:])
        big_enough = self.elements is None or self.elements >= cfg.ratio_min_elements
        if len(recent) >= cfg.ratio_high_window and high > cfg.ratio_high and big_enough:
            self._fire(out, "update_ratio_high", None,
                       {"ratio": high, "threshold": cfg.ratio_high,
                        "update_norm": obs.update_norm, "weight_norm": obs.weight_norm,
                        "lr": obs.lr},
                       f"update-to-weight ratio {_fmt(high)} (median of the last "
                       f"{cfg.ratio_high_window} steps) is above {_fmt(cfg.ratio_high)}: each "
                       "step rewrites a large part of the weights, a blow-up; lower the "
                       "learning rate")
        low = statistics.median(recent[-cfg.ratio_window:])
        if (self.steps > cfg.warmup_steps and len(recent) >= cfg.ratio_window
                and low < cfg.ratio_low):
            self._fire(out, "update_ratio_low", None,
                       {"ratio": low, "threshold": cfg.ratio_low,
                        "update_norm": obs.update_norm, "weight_norm": obs.weight_norm,
                        "lr": obs.lr},
                       f"update-to-weight ratio {_fmt(low)} (median of the last "
                       f"{cfg.ratio_window} steps) is below {_fmt(cfg.ratio_low)}: the updates "
                       f"barely change the weights (learning rate {_fmt(obs.lr)}); nothing is "
                       "learned")
        return out

    def observe_clocks(self, clocks: Mapping[int, int], now: float | None = None) -> list[Alarm]:
        """The live workers' clocks (after a push), at time ``now`` (seconds, any origin;
        None: time is not considered). Only async lags can grow without bound."""
        out: list[Alarm] = []
        if self.bounded_lag or len(clocks) < 2:
            return out
        cfg = self.config
        # behind the median, not the fastest: one worker racing ahead is not the others' fault
        median = statistics.median(clocks.values())
        for worker, clock in clocks.items():
            win = self._window(worker)
            lag = median - clock
            _push(win.lags, lag, cfg.lag_window)
            if not (len(win.lags) >= cfg.lag_window and lag > cfg.lag_limit
                    and clock < cfg.lag_fraction * median and lag > win.lags[0]):
                win.lag_since = None
                continue
            # a worker starved for a moment (a busy host) is not "without bound": it must
            # stay behind like this for lag_seconds
            if now is not None:
                if win.lag_since is None:
                    win.lag_since = now
                if now - win.lag_since < cfg.lag_seconds:
                    continue
            self._fire(out, "worker_lag", worker,
                       {"clock": clock, "median_clock": median, "clock_lag": lag,
                        "lag_before": win.lags[0], "lag_limit": cfg.lag_limit,
                        "seconds": 0.0 if now is None or win.lag_since is None
                        else now - win.lag_since},
                       f"clock {clock} is {_fmt(lag)} behind the median live worker "
                       f"({_fmt(median)}) and the gap keeps growing (it was "
                       f"{_fmt(win.lags[0])}): this worker runs at under "
                       f"{cfg.lag_fraction:.0%} of the others' pace and its gradients grow "
                       "ever staler. Fix the straggler, or bound the gap with --mode ssp")
        return out

    # ------------------------------------------------------------------ rules

    def _check_rejections(self, out: list[Alarm], worker: int, win: _WorkerWindow) -> None:
        cfg = self.config
        if len(self._rejected) >= cfg.reject_window:
            rate = self._rejected_sum / len(self._rejected)
            if rate > cfg.reject_max:
                self._fire(out, "rejection_rate", None,
                           {"rejected_fraction": rate, "window": len(self._rejected),
                            "threshold": cfg.reject_max},
                           f"{rate:.0%} of the last {len(self._rejected)} pushes were "
                           f"rejected (threshold {cfg.reject_max:.0%}): the staleness policy "
                           "starves training; relax the policy or bound staleness with ssp")
                return
        if len(win.pushes) >= cfg.reject_window:
            rate = win.rejected / len(win.pushes)
            if rate > cfg.reject_max:
                self._fire(out, "rejection_rate", worker,
                           {"rejected_fraction": rate, "window": len(win.pushes),
                            "threshold": cfg.reject_max},
                           f"{rate:.0%} of this worker's last {len(win.pushes)} pushes were "
                           "rejected: its compute is wasted (a straggler the policy always "
                           "refuses?)")

    def _check_staleness(self, out: list[Alarm], worker: int, win: _WorkerWindow) -> None:
        cfg = self.config
        n = cfg.staleness_window
        if self.bounded_lag or len(win.staleness) < 2 * n:
            return
        values = list(win.staleness)
        before, recent = statistics.median(values[:n]), statistics.median(values[n:])
        if recent > cfg.staleness_limit and recent >= 2 * max(before, 1):
            self._fire(out, "worker_lag", worker,
                       {"staleness": recent, "staleness_before": before,
                        "staleness_limit": cfg.staleness_limit},
                       f"median staleness of its last {n} pushes is {_fmt(recent)}, up from "
                       f"{_fmt(before)}: its gradients are computed on ever older weights")

    def _check_zero(self, out: list[Alarm], worker: int, win: _WorkerWindow) -> None:
        cfg = self.config
        if len(win.norms) < cfg.zero_window:
            return
        # cheap pre-check: far above the zero threshold of a typical norm (every worker's
        # running mean), so it cannot be zero next to the others; skips the scan below
        if self._norm_ema is not None and max(win.norms) > cfg.zero_rel * 1e3 * self._norm_ema:
            return
        others = [w.norms[-1] for k, w in self._workers.items() if k != worker and w.norms]
        if not others:
            return
        reference = statistics.median(others)
        if reference > 0 and max(win.norms) <= cfg.zero_rel * reference:
            self._fire(out, "zero_gradient", worker,
                       {"grad_norm": max(win.norms), "others_median_norm": reference,
                        "pushes": len(win.norms)},
                       f"its last {len(win.norms)} gradients are zero (norm "
                       f"{_fmt(max(win.norms))}) while the other workers' are "
                       f"{_fmt(reference)}: it learns nothing (a detached graph, dead "
                       "activations, empty batches?)")

    def _check_cosine(self, out: list[Alarm], worker: int, win: _WorkerWindow) -> None:
        cfg = self.config
        if len(win.cosines) < cfg.cosine_window:
            return
        mine = win.cosine_sum / len(win.cosines)
        if mine >= cfg.cosine_min:  # the common case: no need to look at the others
            return
        others = [w for k, w in self._workers.items()
                  if k != worker and len(w.cosines) >= cfg.cosine_window]
        if len(others) < 2:  # with one other worker, who disagrees with whom is undecidable
            return
        theirs = statistics.median(w.cosine_sum / len(w.cosines) for w in others)
        # significance: on a tiny slice (a bias of 2) cosines are +-1 noise, whose window
        # means wander far apart by chance; a real disagreement stands out of that spread
        spread = math.sqrt((_variance(win) + statistics.median(_variance(w) for w in others))
                           / cfg.cosine_window)
        t = (theirs - mine) / spread if spread > 0 else math.inf
        if mine < cfg.cosine_min and theirs - mine > cfg.cosine_gap and t > cfg.cosine_t:
            self._fire(out, "gradient_disagrees", worker,
                       {"cosine": mine, "others_cosine": theirs, "t": t,
                        "window": len(win.cosines)},
                       f"mean cosine of its last {len(win.cosines)} gradients to the shard's "
                       f"running mean gradient is {mine:.2f}, the other workers' "
                       f"{theirs:.2f}: it pushes against the others (a sign error, wrong "
                       "labels, corrupt data?)")

    def _observe_loss(self, out: list[Alarm], loss: float) -> None:
        cfg = self.config
        self._loss_block.append(loss)
        if len(self._loss_block) < cfg.loss_window:
            return
        block = self._loss_block
        mean = statistics.fmean(block)
        # the block mean's standard error: a rise must stand out of the batch-to-batch noise
        se = statistics.stdev(block) / math.sqrt(len(block)) if len(block) > 1 else 0.0
        # a stall is judged on medians (one wild batch moves a mean, not a median), with the
        # median's standard error estimated robustly from the block's own spread (MAD)
        median = statistics.median(block)
        mad = statistics.median(abs(x - median) for x in block)
        se_median = 1.2533 * 1.4826 * mad / math.sqrt(len(block))
        applied = self._applied_in_block
        self._loss_block = []
        self._applied_in_block = 0
        self._loss_blocks.append(mean)
        if self._best_median is None or self._first_median is None:
            self._first_median = self._best_median = median
            return
        if applied == 0:  # nothing applied: that is the rejection rule's business
            return
        # against the best *significant* level, not the lowest block: over a long run the
        # lowest of hundreds of noisy blocks is an outlier, and the loss "rises" back from it
        best = self._best_median
        rise = (median - best) / abs(best) if best else math.inf
        above = median - best > 3 * se_median
        self._rising_blocks = self._rising_blocks + 1 if above and rise > cfg.loss_rise else 0
        if above and (rise > cfg.loss_blowup or self._rising_blocks >= cfg.loss_rise_patience):
            self._fire(out, "loss_rising", None,
                       {"loss": median, "best_loss": best, "rise": rise, "blocks":
                        self._rising_blocks, "window": cfg.loss_window, "mean": mean,
                        "mean_se": se},
                       f"median training loss of the last {cfg.loss_window} pushes is "
                       f"{_fmt(median)}, {rise:.0%} above the best level ({_fmt(best)}), while "
                       "updates are applied: training is diverging; lower the learning rate "
                       "or bound staleness" + self._claimed_note(),
                       divergence=False if self._loss_claimed else None)
        self._check_stall(out, median, se_median, applied, rising=rise > cfg.loss_rise)

    def _claimed_note(self) -> str:
        return (" (losses workers claim, not what this shard measures: --on-divergence "
                "does not stop for it)" if self._loss_claimed else "")

    def _check_stall(self, out: list[Alarm], median: float, se_median: float, applied: int,
                     *, rising: bool) -> None:
        """Stalled: no block median beat the best by more than its noise for loss_patience
        blocks, while the loss is still near where it began. Once it has fallen, the same
        flatness is convergence: a hint after loss_converged_pushes, not an alarm."""
        cfg = self.config
        assert self._best_median is not None and self._first_median is not None
        best, first = self._best_median, self._first_median
        # the reference moves only on a significant gain: a slow descent adds up until it
        # clears the noise, while a flat loss never does
        if best - median > max(cfg.loss_min_improvement * abs(best), cfg.loss_z * se_median):
            self._best_median = median
            self._stale_blocks = 0
            self._stalled = self._converged = False  # the trend resumed: episodes close
            return
        self._stale_blocks += 1
        flat = self._stale_blocks * cfg.loss_window
        progressed = first - median > cfg.loss_progress * abs(first)
        if not progressed:
            if (self._stale_blocks >= cfg.loss_patience and not rising  # rising says more
                    and not self._stalled and self._enabled("loss_stalled")):
                self._stalled = True
                self._fire(out, "loss_stalled", None,
                           {"loss": median, "best_loss": best, "first_loss": first,
                            "blocks": self._stale_blocks, "window": cfg.loss_window,
                            "pushes_applied": applied, "episode": self._episode("loss_stalled")},
                           f"median training loss has not improved on {_fmt(best)} for "
                           f"{flat} pushes (now {_fmt(median)}, {_fmt(first)} at the start) "
                           "while updates are applied: learning stalled (a learning rate of 0 "
                           "or too small?)" + self._claimed_note(), episodic=True,
                           divergence=False if self._loss_claimed else None)
        elif flat >= cfg.loss_converged_pushes and not self._converged:
            self._converged = True
            hint = Alarm("loss_converged", self.shard, None,
                         {"loss": median, "first_loss": first, "pushes": flat,
                          "episode": self._episode("loss_converged")},
                         f"[loss_converged] shard {self.shard}: loss flat at {_fmt(median)} "
                         f"for {flat:,} pushes (from {_fmt(first)}): converged? (stop, or "
                         "decay the learning rate)", self.version)
            self.hints.append(hint)
            self._new_hints.append(hint)


# ---------------------------------------------------------------------- delays


class Reads(Enum):
    """What a rule reads of a push, and so how often the budget lets it see one."""

    PUSH = "every push"  # the decision, its staleness, the loss, the finite check
    NORM = "each observed push's norm"  # one push in observe_every of each worker's
    FULL = "a push measured in full"  # one in observe_every x level of each worker's
    STEP = "a measured step"  # async: a fully measured push's step; sync: every round


class Scope(Enum):
    """Whose pushes a delay counts."""

    WORKER = "pushes of that worker"
    SHARD = "pushes to the shard"
    ONE = "pushes of any one worker (sync: rounds)"


@dataclass(frozen=True)
class Delay:
    """The longest delay of one rule on a failure that persists: it fires within
    :meth:`pushes` pushes (of :attr:`scope`) after the failure began, and also needs
    :attr:`seconds` of wall time when that is not 0."""

    signal: str
    needs: str  # what it reads, in words (the docs' table)
    count: int  # observations of that kind it needs
    reads: Reads
    scope: Scope
    seconds: float = 0.0

    def pushes(self, level: int = 1, every: int = 1, *, sync: bool = False) -> int:
        """The bound at a sampling ``level`` (1: every push measured; at most
        MeasureBudget.MAX_LEVEL) with ``observe_every`` = ``every``. A worker's
        pushes are measured in full on the multiples of every x level of its count
        (paramserver.core.probe.Probe.push_begins), and the level is a power of two up
        to MAX_LEVEL: its every x MAX_LEVEL-th push is measured at any level."""
        per = {Reads.PUSH: 1, Reads.NORM: every, Reads.FULL: every * level,
               Reads.STEP: 1 if sync else every * level}[self.reads]
        return self.count * per


def delay(signal: str, config: WatchdogConfig | None = None, *,
          check_finite: bool = True) -> Delay:
    """The longest delay of ``signal``'s rule under ``config``'s thresholds, once the
    failure it exists for persists (docs/observability.md lists them, from this)."""
    c = config or WatchdogConfig()
    table = {
        "nonfinite_gradient": Delay(
            signal, "the finite check of each push (refused: ERROR nonfinite)", 1,
            Reads.PUSH, Scope.WORKER) if check_finite else Delay(
            signal, "each observed push's norm (--no-check-finite)", 1, Reads.NORM,
            Scope.WORKER),
        "nonfinite_loss": Delay(signal, "the loss a push reports", 1, Reads.PUSH, Scope.WORKER),
        "nonfinite_weights": Delay(
            signal, "a step the core undoes (it would make the weights NaN or Inf)", 1,
            Reads.PUSH, Scope.ONE) if check_finite else Delay(
            signal, "a measured step's norms (--no-check-finite)", 1, Reads.STEP, Scope.ONE),
        "update_ratio_high": Delay(
            signal, f"the median ratio of {c.ratio_high_window} measured steps",
            c.ratio_high_window, Reads.STEP, Scope.ONE),
        "update_ratio_low": Delay(
            signal, f"the median ratio of {c.ratio_window} measured steps, after "
            f"{c.warmup_steps} of warm-up", max(c.ratio_window, c.warmup_steps + 1),
            Reads.STEP, Scope.ONE),
        "loss_stalled": Delay(
            signal, f"a first block and {c.loss_patience} flat blocks of {c.loss_window} "
            "reported losses", (c.loss_patience + 1) * c.loss_window, Reads.PUSH,
            Scope.SHARD),
        "loss_rising": Delay(
            signal, f"after a first block: one block of {c.loss_window} losses "
            f"{c.loss_blowup:.0%} above the best (a rise of {c.loss_rise:.0%} needs "
            f"{c.loss_rise_patience} blocks)", 2 * c.loss_window, Reads.PUSH, Scope.SHARD),
        "rejection_rate": Delay(
            signal, f"the decisions on the last {c.reject_window} pushes", c.reject_window,
            Reads.PUSH, Scope.SHARD),
        "worker_lag": Delay(
            signal, f"the staleness of its last {2 * c.staleness_window} pushes (async; or "
            f"its clock lag, held {c.lag_seconds:g} s)", 2 * c.staleness_window,
            Reads.PUSH, Scope.WORKER),
        "zero_gradient": Delay(
            signal, f"the norms of its last {c.zero_window} pushes", c.zero_window,
            Reads.NORM, Scope.WORKER),
        "gradient_disagrees": Delay(
            signal, f"the cosines of its (and 2 others') last {c.cosine_window} fully "
            "measured pushes", c.cosine_window, Reads.FULL, Scope.WORKER),
    }
    if signal not in table:
        raise KeyError(f"no rule {signal!r}; rules: {', '.join(SIGNALS)}")
    return table[signal]


def delays(config: WatchdogConfig | None = None, *, check_finite: bool = True) -> list[Delay]:
    """:func:`delay` of every rule, in :data:`SIGNALS` order."""
    return [delay(s, config, check_finite=check_finite) for s in SIGNALS]
