"""What the divergence watchdog may be told: its signals, what ``--on-divergence`` may
do, and the thresholds of its rules (:class:`WatchdogConfig`). Apart from watchdog.py,
whose alarms are written as STATS entries (paramserver.wire.stats, which loads torch),
because ``ServerConfig`` declares its options from these; importable from
``paramserver.observe.watchdog`` too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from paramserver.errors import ConfigError

__all__ = ["ACTIONS", "DEFAULT_BUDGET", "DEFAULT_OBSERVE", "DIVERGENCE", "HINTS", "SIGNALS",
           "WatchdogConfig", "parse_observe"]

#: ``--observe``'s default: measuring may take about 5 % of a shard's wall time
DEFAULT_OBSERVE = "budget:0.05"
DEFAULT_BUDGET = 0.05


def parse_observe(text: str) -> float:
    """``--observe every|budget:F`` -> the measuring budget (0.0: every push measured)."""
    value = text.strip()
    if value == "every":
        return 0.0
    kind, sep, share = value.partition(":")
    try:
        budget = float(share) if kind == "budget" and sep else math.nan
    except ValueError:
        budget = math.nan
    if not 0.0 < budget <= 1.0:  # (NaN fails too)
        raise ConfigError(f"--observe must be 'every' or 'budget:F' with F in (0, 1] (a share "
                          f"of the shard's wall time), got {text!r}")
    return budget


#: what ``--on-divergence`` may say
ACTIONS: tuple[str, ...] = ("warn", "checkpoint-and-stop", "stop")

SIGNALS: tuple[str, ...] = (
    "nonfinite_gradient",
    "nonfinite_weights",
    "nonfinite_loss",
    "update_ratio_low",
    "update_ratio_high",
    "loss_stalled",
    "loss_rising",
    "rejection_rate",
    "worker_lag",
    "zero_gradient",
    "gradient_disagrees",
)

#: informational events: written to the event log, never alarms (no --on-divergence)
HINTS: tuple[str, ...] = ("loss_converged",)

#: the signals about the model's own state (its weights, its steps, the training loss
#: over blocks of pushes): the only alarms ``--on-divergence`` acts on. The others are
#: about one peer (a push the shard refused, a worker's own report or pace) or the
#: policy: reported, never a stop, or one worker key could stop the cluster
DIVERGENCE: frozenset[str] = frozenset({
    "nonfinite_weights", "update_ratio_low", "update_ratio_high", "loss_stalled",
    "loss_rising"})


@dataclass(frozen=True)
class WatchdogConfig:
    """Thresholds of every rule; ``--watchdog-arg key=value`` overrides one."""

    enabled: bool = True
    disable: tuple[str, ...] = ()  # signals to leave out
    cooldown: int = 1000  # pushes before the same (signal, worker) may fire again
    observe_every: int = 0  # measure gradient and update norms on one push in N; 0: by size
    # share of a shard's wall time measuring may take before pushes are sampled (0: no
    # limit, every push measured); set by ``--observe`` (ServerConfig.observe). Sampled,
    # each rule still fires within its delay (:func:`delay`)
    observe_budget: float = DEFAULT_BUDGET
    # update-to-weight ratio per optimizer step
    ratio_low: float = 1e-7  # below float32 resolution: updates round away
    ratio_high: float = 0.2  # a fifth of the weights' norm in one step: blow-up
    ratio_window: int = 10  # steps whose median is tested against ratio_low
    ratio_high_window: int = 3  # steps whose median is tested against ratio_high
    ratio_min_elements: int = 100  # smaller shards (a lone bias) swing too much for ratio_high
    warmup_steps: int = 5  # steps before ratio_low is tested (schedulers warm up from 0)
    # training loss reported by workers with their pushes
    loss_window: int = 50  # losses per block (stall: block medians; rise: block means)
    loss_patience: int = 3  # blocks in a row without improving on the best block
    loss_min_improvement: float = 0.005  # relative improvement that counts as progress ...
    loss_z: float = 3.0  # ... and it must exceed this many standard errors of a block median
    # stalled only while the loss is within this share of where it started: a loss that
    # has fallen further and then flattens has converged (a hint, not an alarm)
    loss_progress: float = 0.2
    loss_converged_pushes: int = 2000  # flat this long after progress: loss_converged hint
    loss_rise: float = 0.25  # blocks this much (relative) above the best, ...
    # ... loss_rise_patience in a row: async momentum wobbles 40 % up for 3 blocks and back
    loss_rise_patience: int = 6
    loss_blowup: float = 1.0  # ... or one block this much above it: rising
    # staleness policy
    reject_max: float = 0.9  # rejected fraction of pushes that starves training
    reject_window: int = 50  # pushes (shard-wide; per worker: the worker's own)
    # lagging workers (async; sync and ssp bound the lag by construction)
    lag_limit: int = 50  # clocks behind the median live worker
    lag_fraction: float = 0.5  # ... while having done less than this share of its clocks
    lag_window: int = 20  # observations over which the lag must have grown
    lag_seconds: float = 30.0  # ... all of it for this long (seconds)
    staleness_limit: int = 50  # median staleness of a worker's recent pushes ...
    staleness_window: int = 10  # ... over this many pushes, at least twice the previous
    # per-worker gradients
    zero_window: int = 5  # pushes in a row with a zero gradient
    zero_rel: float = 1e-6  # "zero": norm below this share of the others' median norm
    cosine_window: int = 20  # a worker's pushes whose mean cosine is tested
    cosine_min: float = 0.0  # mean cosine to the running mean below this ...
    cosine_gap: float = 0.3  # ... and this far below the other workers' median
    cosine_t: float = 5.0  # ... by this many standard errors of the windows' means

    def __post_init__(self) -> None:
        unknown = set(self.disable) - set(SIGNALS)
        if unknown:
            raise ConfigError(
                f"watchdog: unknown signal(s) to disable: {', '.join(sorted(unknown))}; "
                f"signals: {', '.join(SIGNALS)}"
            )
        if self.observe_every < 0:
            raise ConfigError("watchdog: observe_every must be >= 0 (0: by the shard's size)")
        for name in ("cooldown", "ratio_window", "ratio_high_window", "loss_converged_pushes",
                     "loss_rise_patience",
                     "loss_window", "loss_patience", "reject_window", "lag_window",
                     "staleness_window", "zero_window", "cosine_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"watchdog: {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.observe_budget <= 1.0:
            raise ConfigError("watchdog: observe_budget must be in [0, 1] (0: no limit)")
        if not 0 <= self.ratio_low < self.ratio_high:
            raise ConfigError("watchdog: need 0 <= ratio_low < ratio_high")
        if not 0 < self.reject_max <= 1 or not 0 < self.lag_fraction <= 1:
            raise ConfigError("watchdog: reject_max and lag_fraction must be in (0, 1]")
        if self.ratio_min_elements < 0:
            raise ConfigError("watchdog: ratio_min_elements must be >= 0")
        if self.warmup_steps < 0 or self.lag_limit < 0 or self.staleness_limit < 0 or (
                self.lag_seconds < 0):
            raise ConfigError("watchdog: warmup_steps, lag_limit, staleness_limit must be >= 0")
        if self.loss_z < 0 or not 0 <= self.loss_progress < 1:
            raise ConfigError("watchdog: need loss_z >= 0 and 0 <= loss_progress < 1")
        if self.loss_min_improvement < 0 or self.zero_rel < 0 or not (
                0 < self.loss_rise <= self.loss_blowup):
            raise ConfigError("watchdog: need loss_min_improvement, zero_rel >= 0 and "
                              "0 < loss_rise <= loss_blowup")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> WatchdogConfig:
        """Build from ``{"ratio_high": 0.5, "disable": "loss_stalled,worker_lag"}``."""
        data = dict(data or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(fields)
        if unknown:
            raise ConfigError(
                f"unknown watchdog option(s): {', '.join(sorted(unknown))}; "
                f"known: {', '.join(fields)}"
            )
        out: dict[str, Any] = {}
        for key, value in data.items():
            default = fields[key].default
            if key == "disable":
                items = value.split(",") if isinstance(value, str) else list(value)
                out[key] = tuple(s.strip() for s in items if s.strip())
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"watchdog: {key} must be true or false, got {value!r}")
                out[key] = value
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"watchdog: {key} must be an integer, got {value!r}")
                out[key] = value
            else:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ConfigError(f"watchdog: {key} must be a number, got {value!r}")
                out[key] = float(value)
        return cls(**out)
