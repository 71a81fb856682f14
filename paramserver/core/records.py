"""The shard core's records: its configuration, what it knows of each worker, its answers.

:class:`ModeSpec` and :class:`CoreConfig` configure a
:class:`~paramserver.core.shard.ShardCore`, :class:`SliceSpec` describes a slice it
owns, :class:`WorkerState` is what it knows of one worker (its clock, liveness
and counters), :class:`PushOutcome` and :class:`PullReply` are its answers to a
push and a pull, :class:`PullQueue` holds its parked pulls, :class:`BoundTotals`
what an adaptive SSP bound is set from, and :func:`check_tensors` is the check every tensor a shard
takes in (INIT, PUSH, a checkpoint) must pass to fit its slices. The rules that
use them live in core.py. All of them are importable from ``paramserver.core.shard``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import torch

from paramserver.core.modes import MAX_WORKERS, MODES, CoreConfig, Mode, ModeSpec
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.policies.base import Decision
from paramserver.util.dtypes import FLOAT_DTYPES, NARROW_DTYPES

__all__ = [
    "DTYPES",
    "MAX_REASONS",
    "MAX_WORKERS",
    "MODES",
    "OTHER_REASONS",
    "STALENESS_EXACT",
    "STATS_WORKERS",
    "BoundTotals",
    "CoreConfig",
    "HoldNote",
    "Mode",
    "ModeSpec",
    "PendingPull",
    "PullQueue",
    "PullReply",
    "PushOutcome",
    "SliceSpec",
    "WorkerRecord",
    "WorkerState",
    "check_header",
    "check_tensors",
    "slice_table",
    "staleness_bucket",
]



DTYPES = FLOAT_DTYPES

STATS_WORKERS = 512  # per-worker summaries in stats(); the rest are counted, not listed
#: staleness values a worker's histogram keeps exactly; above, one bucket per power of
#: two keyed by its lower bound ([16, 32), [32, 64), ...): at most 75 keys whatever was
#: pushed (tau < 2**62), far below the 4,096 a decoder takes in a map (protocol.decode)
STALENESS_EXACT = 16
MAX_REASONS = 32  # rejection reasons a worker's counts name; the rest are OTHER_REASONS
OTHER_REASONS = "other reasons"


def staleness_bucket(tau: int) -> int:
    """The histogram key of staleness ``tau``: itself below :data:`STALENESS_EXACT`,
    else the largest power of two not above it."""
    return tau if tau < STALENESS_EXACT else 1 << (tau.bit_length() - 1)


@dataclass(frozen=True)
class SliceSpec:
    """What the core needs to know of one slice it owns (see sharding.Slice)."""

    key: str
    numel: int
    dtype: str


class WorkerRecord(TypedDict):
    """What a checkpoint's metadata keeps of a worker (:meth:`WorkerState.record`);
    read back by :meth:`WorkerState.from_record`, which also takes older records
    (without the staleness maximum and sum)."""

    incarnation: str
    clock: int
    live: bool
    finished: bool
    pushes: int
    applied: int
    rejected: dict[str, int]
    downweighted: int
    weight_sum: float
    staleness: dict[str, int]  # staleness bucket (as text: a JSON key) -> pushes
    staleness_max: int
    staleness_sum: int
    last_push_id: int
    pulls: int
    deferred_pulls: int
    wait_seconds: float
    deaths: int


@dataclass
class WorkerState:
    """What one shard knows of one worker."""

    worker: int
    incarnation: str
    last_seen: float
    clock: int = 0
    live: bool = True
    finished: bool = False
    pushes: int = 0  # pushes decided (duplicates excluded)
    applied: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    downweighted: int = 0
    weight_sum: float = 0.0
    staleness: Counter[int] = field(default_factory=Counter)  # by staleness_bucket
    staleness_max: int = 0  # exact, beside the bucketed histogram
    staleness_sum: int = 0
    last_push_id: int = -1
    last_outcome: PushOutcome | None = None
    pulls: int = 0
    deferred_pulls: int = 0
    wait_seconds: float = 0.0
    deaths: int = 0
    # a supervisor saw this incarnation's process exit: only a new HELLO brings the
    # worker back (a heartbeat still in flight from the dead process must not)
    reported_dead: bool = False
    #: whether last_push_id came from this process's own pushes; until then any push
    #: id is taken (a restarted shard, a fresh registration), afterwards only a window
    anchored: bool = False
    #: it said something after HELLO (INIT, a heartbeat): a worker, not a bare HELLO
    spoke: bool = False
    #: when it last pushed (or registered): how long a round or gate has waited on it
    pushed_at: float = -1.0
    #: who runs it, as its HELLO said ("pid 12 on host"): named when its id is refused
    origin: str = ""
    #: other incarnations refused its id while it was live: incarnation -> first refusal
    contenders: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pushed_at < 0:
            self.pushed_at = self.last_seen

    @property
    def active(self) -> bool:
        """It did something beyond HELLO (INIT, a heartbeat, a pull or a push)."""
        return self.spoke or self.pulls > 0 or self.pushes > 0

    def restart(self, incarnation: str, now: float) -> None:
        """A new process took over this worker id: live, nothing pushed yet (its
        clock is the core's to set)."""
        self.incarnation = incarnation
        self.reported_dead = False
        self.last_push_id = -1
        self.anchored = False
        self.last_outcome = None
        self.live, self.finished = True, False
        self.last_seen = self.pushed_at = now
        self.spoke = False
        self.contenders.clear()

    def opened(self, clock: int, staleness: int) -> None:
        """A new push (not a duplicate) at ``clock``, read ``staleness`` versions ago."""
        self.clock = max(self.clock, clock + 1)
        self.pushes += 1
        self.staleness[staleness_bucket(staleness)] += 1
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_sum += staleness

    def count(self, decision: Decision) -> None:
        """Count the policy's ``decision`` on one of its pushes."""
        if not decision.accept:
            self.rejected[self.reason_key(decision.reason)] += 1
        else:
            self.applied += 1
            self.weight_sum += decision.weight
            if decision.weight < 1.0:
                self.downweighted += 1

    def uncount(self, decision: Decision, reason: str) -> None:
        """A push counted by :meth:`count` did not make it into a round after all:
        it is a rejection for ``reason`` instead."""
        if decision.accept:
            self.applied -= 1
            self.weight_sum -= decision.weight
            if decision.weight < 1.0:
                self.downweighted -= 1
        else:
            self.rejected[self.reason_key(decision.reason)] -= 1
        self.rejected[self.reason_key(reason)] += 1

    def reason_key(self, reason: str) -> str:
        """Where a rejection for ``reason`` is counted: under its own name for the first
        :data:`MAX_REASONS` reasons, then under :data:`OTHER_REASONS` (a policy may name
        the staleness in its reason: one key per value would not stay bounded)."""
        if reason in self.rejected or len(self.rejected) < MAX_REASONS:
            return reason
        return OTHER_REASONS

    def answered(self, waited: float) -> None:
        """One of its pulls was answered after ``waited`` seconds parked."""
        if waited > 0:
            self.deferred_pulls += 1
            self.wait_seconds += waited

    def summary(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "clock": self.clock,
            "live": self.live,
            "finished": self.finished,
            "pushes": self.pushes,
            "applied": self.applied,
            "rejected": dict(self.rejected),
            "downweighted": self.downweighted,
            "mean_weight": self.weight_sum / self.applied if self.applied else 0.0,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "staleness_max": self.staleness_max,
            "staleness_sum": self.staleness_sum,
            "pulls": self.pulls,
            "deferred_pulls": self.deferred_pulls,
            "wait_seconds": self.wait_seconds,
            "deaths": self.deaths,
        }

    def record(self) -> WorkerRecord:
        """What a checkpoint keeps of this worker (see paramserver/core/snapshot.py)."""
        return WorkerRecord(
            incarnation=self.incarnation, clock=self.clock, live=self.live,
            finished=self.finished, pushes=self.pushes, applied=self.applied,
            rejected=dict(self.rejected), downweighted=self.downweighted,
            weight_sum=self.weight_sum,
            staleness={str(k): v for k, v in self.staleness.items()},
            staleness_max=self.staleness_max, staleness_sum=self.staleness_sum,
            last_push_id=self.last_push_id, pulls=self.pulls,
            deferred_pulls=self.deferred_pulls, wait_seconds=self.wait_seconds,
            deaths=self.deaths,
        )

    @classmethod
    def from_record(cls, worker: int, w: Mapping[str, Any], now: float) -> WorkerState:
        """The worker :meth:`record` describes, last seen ``now`` (a fresh grace period)."""
        state = cls(worker, w["incarnation"], now, clock=w["clock"])
        state.live, state.finished = w["live"], w["finished"]
        state.pushes, state.applied = w["pushes"], w["applied"]
        for reason, n in w["rejected"].items():
            state.rejected[state.reason_key(reason)] += n
        state.downweighted, state.weight_sum = w["downweighted"], w["weight_sum"]
        # (bucketed again: a checkpoint from before the buckets kept every value)
        state.staleness = Counter()
        for k, v in w["staleness"].items():
            state.staleness[staleness_bucket(int(k))] += v
        state.staleness_max = w.get("staleness_max", max(map(int, w["staleness"]), default=0))
        state.staleness_sum = w.get("staleness_sum",
                                    sum(int(k) * v for k, v in w["staleness"].items()))
        state.last_push_id, state.pulls = w["last_push_id"], w["pulls"]
        state.deferred_pulls, state.wait_seconds = w["deferred_pulls"], w["wait_seconds"]
        state.deaths = w["deaths"]
        return state


@dataclass(frozen=True)
class PushOutcome:
    """The core's answer to one push; sent back to the worker."""

    accepted: bool
    weight: float
    reason: str
    staleness: int
    version: int  # the shard version after handling the push
    applied: bool  # an optimizer step happened because of this push
    duplicate: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "weight": self.weight,
            "reason": self.reason,
            "staleness": self.staleness,
            "version": self.version,
            "applied": self.applied,
            "duplicate": self.duplicate,
        }

    def row_fields(self) -> dict[str, Any]:
        """The fields of a SPUSH reply: :meth:`as_dict` but ``applied``, which its wire
        format does not carry (an accepted sparse push is answered once stepped)."""
        fields = self.as_dict()
        del fields["applied"]
        return fields


class HoldNote(TypedDict):
    """What a heartbeat's reply says a shard holds for the worker: its parked pull
    (or sync sparse push), at which clock, for how long, and why, in a few words."""

    clock: int
    waited: NotRequired[float]  # (a parked pull's; a sparse push's round is not timed)
    why: str


@dataclass(frozen=True)
class PullReply:
    worker: int
    token: Hashable
    version: int
    clock: int
    waited: float


@dataclass
class PendingPull:
    """A parked pull: ``token`` is the driver's, to answer it by."""

    worker: int
    clock: int
    token: Hashable
    since: float
    observer: bool = False
    final: bool = False  # an observer's, held until every worker is done (opt.final())

    @property
    def gated(self) -> bool:
        """Whether the pull is held on someone's behalf: a worker's, or a final one
        (its sender's heartbeats are told why)."""
        return not self.observer or self.final


class PullQueue:
    """A shard's parked pulls, oldest first: at most one per worker, any number of
    observers'. Which of them may be answered, the core decides."""

    def __init__(self) -> None:
        self.pulls: list[PendingPull] = []

    def __len__(self) -> int:
        return len(self.pulls)

    def park(self, pull: PendingPull) -> None:
        """Park ``pull``. A worker's retried pull replaces the parked one (one reply per
        worker), keeping its start time so waiting is measured from the first attempt."""
        if pull.gated:
            for i, old in enumerate(self.pulls):
                if old.gated and old.worker == pull.worker and old.final == pull.final:
                    self.pulls[i] = PendingPull(pull.worker, pull.clock, pull.token, old.since,
                                                pull.observer, pull.final)
                    return
        self.pulls.append(pull)

    def take(self, ready: Callable[[PendingPull], bool]) -> list[PendingPull]:
        """Remove and return the pulls ``ready`` says may be answered, oldest first."""
        taken: list[PendingPull] = []
        keep: list[PendingPull] = []
        for pull in self.pulls:
            (taken if ready(pull) else keep).append(pull)
        self.pulls = keep
        return taken

    def drop(self, worker: int) -> None:
        """Drop ``worker``'s parked pull (it left, died or restarted)."""
        self.pulls = [p for p in self.pulls if p.observer or p.worker != worker]

    def held(self, worker: int) -> PendingPull | None:
        """``worker``'s parked pull, if one is held (what its heartbeats are told): its
        own, or a final one it asked for once it said BYE."""
        return next((p for p in self.pulls if p.gated and p.worker == worker), None)

    def blocked(self) -> int:
        """Workers' pulls parked (observers' aside)."""
        return sum(1 for p in self.pulls if not p.observer)

    def clear(self) -> None:
        self.pulls = []


@dataclass
class BoundTotals:
    """Running totals an adaptive SSP bound is set from
    (:class:`~paramserver.policies.BoundStats`)."""

    pushes: int = 0
    staleness_sum: int = 0
    pulls: int = 0  # workers' pulls answered
    wait_seconds: float = 0.0  # their time parked, summed

    def pushed(self, staleness: int) -> None:
        self.pushes += 1
        self.staleness_sum += staleness

    def answered(self, waited: float) -> None:
        self.pulls += 1
        self.wait_seconds += waited


def check_tensors(specs: Mapping[str, SliceSpec], tensors: Mapping[str, torch.Tensor],
                  what: str, narrow_ok: bool = False, whole: bool = True,
                  seen: AbstractSet[str] = frozenset()) -> None:
    """Keys, shapes and dtypes must match the slices ``specs`` (by key), else a
    :class:`ProtocolError`; with ``narrow_ok`` a 16-bit
    tensor may stand for a wider float slice (gradients sent in 16 bits). A part
    (not ``whole``) holds some keys, none of them ``seen`` in earlier parts."""
    missing = specs.keys() - tensors.keys() if whole else set()
    unknown = tensors.keys() - specs.keys()
    again = tensors.keys() & seen
    if again:
        raise ProtocolError(
            ErrorCode.BAD_TENSOR, f"{what}: keys sent in two parts: {sorted(again)[:5]}")
    if unknown:
        raise ProtocolError(
            ErrorCode.UNKNOWN_KEY, f"{what}: keys not on this shard: {sorted(unknown)[:5]}"
        )
    if missing:
        raise ProtocolError(
            ErrorCode.BAD_TENSOR, f"{what}: missing keys: {sorted(missing)[:5]}"
        )
    for key, value in tensors.items():
        spec = specs[key]
        dtype_ok = value.dtype == DTYPES[spec.dtype] or (
            narrow_ok and value.dtype in NARROW_DTYPES and spec.dtype in ("float32", "float64"))
        # the full shape, not only the size: a [16, 8] tensor for a [128] slice
        # would make torch resize the round's buffer (out=) and wedge the round
        if not dtype_ok or tuple(value.shape) != (spec.numel,):
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"{what}: {key!r} is {value.dtype} {list(value.shape)}, "
                f"expected {spec.dtype} [{spec.numel}]",
            )


def slice_table(slices: Iterable[SliceSpec]) -> dict[str, SliceSpec]:
    """``slices`` by key: each of a floating point dtype, each key once (else
    :class:`ConfigError`)."""
    specs: dict[str, SliceSpec] = {}
    for spec in slices:
        if spec.dtype not in DTYPES:
            raise ConfigError(f"slice {spec.key!r}: dtype {spec.dtype!r} not in {list(DTYPES)}")
        if spec.key in specs:
            raise ConfigError(f"duplicate slice key {spec.key!r}")
        specs[spec.key] = spec
    return specs


def check_header(version: int, read_version: int, clock: int, num_samples: int) -> None:
    """A new push's header, at a shard at ``version``: read at a version the shard
    has reached, with a clock and samples in range (else a :class:`ProtocolError`)."""
    if read_version > version:
        raise ProtocolError(
            ErrorCode.FUTURE_VERSION,
            f"read_version {read_version} is ahead of the shard's version {version}",
        )
    if read_version < 0 or clock < 0 or num_samples < 1:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"need read_version >= 0, clock >= 0, num_samples >= 1; got "
            f"{read_version}, {clock}, {num_samples}",
        )
