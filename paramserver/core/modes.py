"""How a shard is configured: its consistency model (:class:`Mode`, :class:`ModeSpec`) and
:class:`CoreConfig`. Apart from the core's other records (records.py) because these load
no torch: the config classes and the CLI's options are declared from them, and
``paramserver server --help`` should not wait for torch. Importable from
``paramserver.core.records`` and ``paramserver.core.shard`` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from paramserver.errors import ConfigError

__all__ = ["MAX_WORKERS", "MODES", "CoreConfig", "Mode", "ModeSpec"]

MAX_WORKERS = 65536  # the largest worker table a shard may be configured for


class Mode(StrEnum):
    """The consistency model a shard enforces: a StrEnum, so that it compares equal to
    its name and is written as that name (JSON, msgpack, logs)."""

    SYNC = "sync"
    ASYNC = "async"
    SSP = "ssp"


MODES: tuple[str, ...] = tuple(m.value for m in Mode)


@dataclass(frozen=True)
class ModeSpec:
    """Which consistency model a shard enforces."""

    mode: Mode = Mode.ASYNC  # a name ("sync") is taken too, and made a Mode
    staleness_bound: int = 0  # ssp: s
    backup_workers: int = 0  # sync: b, the slowest b gradients of a round are dropped

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.staleness_bound < 0:
            raise ConfigError(f"staleness bound must be >= 0, got {self.staleness_bound}")
        if self.backup_workers < 0:
            raise ConfigError(f"backup workers must be >= 0, got {self.backup_workers}")
        if self.backup_workers and self.mode != Mode.SYNC:
            raise ConfigError("backup workers only apply to sync mode")

    def describe(self) -> str:
        if self.mode == Mode.SSP:
            return f"ssp(s={self.staleness_bound})"
        if self.mode == Mode.SYNC and self.backup_workers:
            return f"sync(b={self.backup_workers})"
        return self.mode.value


@dataclass(frozen=True)
class CoreConfig:
    shard: int = 0
    mode: ModeSpec = field(default_factory=ModeSpec)
    optimizer: str = "sgd"
    optimizer_args: Mapping[str, Any] = field(default_factory=lambda: {"lr": 0.1})
    scheduler: str | None = None
    scheduler_args: Mapping[str, Any] = field(default_factory=dict)
    expected_workers: int = 1  # training starts when this many workers have registered
    heartbeat_timeout: float = 10.0  # seconds without a sign of life before a worker is dead
    check_finite: bool = True
    #: worker table size; a new id past it evicts one that never became active or died
    #: long ago, else is refused (None: max(64, 4 * expected_workers))
    max_workers: int | None = None
    #: how far ahead of a worker's last push id a new one may be: one forged id can
    #: then hide at most this many of the real worker's pushes
    push_id_window: int = 1024
    #: large-batch learning-rate rule (stepsize.LrRule): none, linear or sqrt in the
    #: number of gradients a step averages, reached after warmup_steps steps
    lr_scaling: str = "none"
    warmup_steps: int = 0
    #: asynchrony-aware momentum (stepsize.MomentumCompensation): the total momentum
    #: to keep, explicit plus the implicit momentum of the observed staleness (None: off)
    momentum_target: float | None = None
    #: how long an open sync round or a closed SSP gate waits on a live member that
    #: does not push before leaving it out, as a straggler (0: forever; None: the
    #: larger of ROUND_TIMEOUT_BEATS heartbeat timeouts and ROUND_TIMEOUT_STEPS of
    #: the usual time between a worker's pushes; see Membership.leave_out)
    round_timeout: float | None = None

    @property
    def worker_limit(self) -> int:
        if self.max_workers is not None:
            return self.max_workers
        return min(MAX_WORKERS, max(64, 4 * self.expected_workers))

    def __post_init__(self) -> None:
        if self.max_workers is not None and not 1 <= self.max_workers <= MAX_WORKERS:
            raise ConfigError(f"max workers must be in 1..{MAX_WORKERS}, got {self.max_workers}")
        if self.max_workers is not None and self.max_workers < self.expected_workers:
            raise ConfigError(f"max workers ({self.max_workers}) must be at least the "
                              f"expected workers ({self.expected_workers})")
        if self.push_id_window < 1:
            raise ConfigError(f"push id window must be >= 1, got {self.push_id_window}")
        if self.expected_workers < 1:
            raise ConfigError(f"expected workers must be >= 1, got {self.expected_workers}")
        if not self.heartbeat_timeout > 0:
            raise ConfigError(f"heartbeat timeout must be > 0, got {self.heartbeat_timeout}")
        if self.round_timeout is not None and not self.round_timeout >= 0:
            raise ConfigError(f"round timeout must be >= 0 (0: never), got {self.round_timeout}")
        if self.mode.backup_workers >= self.expected_workers:
            raise ConfigError(
                f"backup workers ({self.mode.backup_workers}) must be fewer than the "
                f"expected workers ({self.expected_workers})"
            )
