"""Every event record a process writes, declared once (docs/events.md is checked against them).

A record is a msgspec Struct tagged with its kind: the tag is the record's ``event``
field, the Struct's fields are the rest, in the order they are written. A field
that some writers leave out (the simulator's ``server_start`` has no
``metrics_port``) defaults to ``UNSET`` and is then not written; ``None`` is
written as ``null``. :meth:`~paramserver.observe.events.EventLog.write` stamps
``t`` and writes one line.

Records are grouped by the log that holds them: a shard's, a worker's and the
launcher's (the launcher repeats a few of the shards' kinds with other fields).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "LAUNCHER_RECORDS", "LOGS", "SERVER_RECORDS", "UNSET", "WORKER_RECORDS", "Event", "kind_of"]

# a map whose keys are the writer's (a config, a metrics snapshot, figures)
Map = dict[str, Any]


class Event(msgspec.Struct, tag_field="event", kw_only=True):
    """One record of an event log."""

    #: the field, a map, whose items are written as fields of the record itself (a
    #: worker's figures, named by the script); None: none is
    flat: ClassVar[str | None] = None


def kind_of(record: Event) -> str:
    """The record's ``event``."""
    return record.__struct_config__.tag  # type: ignore[return-value]


# ------------------------------------------------------------------ shard server


class ServerStart(Event, tag="server_start", kw_only=True):
    shard: int
    address: str
    metrics_port: int | UnsetType | None = UNSET  # (the simulator's: none of these)
    mode: str | UnsetType = UNSET
    policy: str | UnsetType = UNSET
    expected_workers: int | UnsetType = UNSET
    config: Map


class WorkerHello(Event, tag="worker_hello", kw_only=True):
    shard: int
    worker: int
    clock: int
    host: str | None
    pid: int | None
    joined: str
    from_clock: int | None


class TrainingStart(Event, tag="training_start", kw_only=True):
    shard: int
    mode: str
    workers: list[int]
    version: int


class Init(Event, tag="init", kw_only=True):
    shard: int
    worker: int


class Push(Event, tag="push", kw_only=True):
    shard: int
    worker: int
    clock: int
    read_version: int
    version: int
    staleness: int
    accepted: bool
    weight: float
    reason: str
    num_samples: int
    loss: float | None
    grad_norm: float | None
    cosine: float | None


class WorkerDead(Event, tag="worker_dead", kw_only=True):
    shard: int
    worker: int
    reported: bool | UnsetType = UNSET  # a supervisor said so (else: timeout)
    clock: int
    timeout: float | UnsetType = UNSET


class WorkerBack(Event, tag="worker_back", kw_only=True):
    shard: int
    worker: int
    from_clock: int
    clock: int


class WorkerLeftOut(Event, tag="worker_left_out", kw_only=True):
    shard: int
    worker: int
    deadline: float


class WorkerBye(Event, tag="worker_bye", kw_only=True):
    shard: int
    worker: int
    clock: int


class AllDone(Event, tag="all_done", kw_only=True):
    shard: int
    version: int
    seconds: float
    finished: list[int]
    dead: list[int]


class LrChanged(Event, tag="lr_changed", kw_only=True):
    shard: int
    worker: int
    version: int
    lr: float
    previous: float


class Checkpoint(Event, tag="checkpoint", kw_only=True):
    shard: int
    version: int
    path: str


class CheckpointRefused(Event, tag="checkpoint_refused", kw_only=True):
    shard: int
    version: int
    error: str


class CheckpointFailed(Event, tag="checkpoint_failed", kw_only=True):
    shard: int
    version: int
    error: str


class CheckpointRoundsDiffer(Event, tag="checkpoint_rounds_differ", kw_only=True):
    shard: int
    round: int | None
    checkpoint: str | None
    note: str


class CheckpointsMoved(Event, tag="checkpoints_moved", kw_only=True):
    shard: int
    earlier: str
    path: str


class CheckpointResharded(Event, tag="checkpoint_resharded", kw_only=True):
    shard: int
    directory: str
    shards: int
    to: int
    version: int | None


class Resharded(Event, tag="resharded", kw_only=True):
    shard: int
    epoch: int
    role: str
    from_shards: int
    to_shards: int
    version: int
    paused_s: float
    held: int


class Alarm(Event, tag="alarm", kw_only=True):
    signal: str
    shard: int | None
    worker: int | None
    version: int | None
    figures: Map
    message: str


class Hint(Event, tag="hint", kw_only=True):
    signal: str
    shard: int | None
    worker: int | None
    version: int | None
    figures: Map
    message: str


class Diverged(Event, tag="diverged", kw_only=True):
    shard: int
    action: str
    signal: str
    worker: int | None
    message: str
    version: int
    checkpoint: str | None


class ShardMetrics(Event, tag="metrics", kw_only=True):
    shard: int
    version: int
    metrics: Map


class ServerStop(Event, tag="server_stop", kw_only=True):
    shard: int
    version: int


class ReplicationRefused(Event, tag="replication_refused", kw_only=True):
    shard: int
    replica: int
    reason: str
    refused: int


class Failover(Event, tag="failover", kw_only=True):
    shard: int
    replica: int
    epoch: int
    seconds: float
    applied: int
    address: str
    backups: list[str]


class SteppedDown(Event, tag="stepped_down", kw_only=True):
    shard: int
    replica: int
    epoch: int
    by: str


class Rejoined(Event, tag="rejoined", kw_only=True):
    shard: int
    replica: int
    address: str
    primary: str
    epoch: int
    seq: int
    seconds: float


class BackupJoining(Event, tag="backup_joining", kw_only=True):
    shard: int
    backup: str
    seq: int
    epoch: int
    bytes: int


class BackupJoined(Event, tag="backup_joined", kw_only=True):
    shard: int
    backup: str
    seq: int
    epoch: int
    backups: int
    primary: str
    seconds: float


class BackupLost(Event, tag="backup_lost", kw_only=True):
    shard: int
    backup: str
    reason: str
    epoch: int
    backups: int


# ------------------------------------------------------------------ worker


class WorkerStart(Event, tag="worker_start", kw_only=True):
    worker: int
    clock: int
    seeded: bool
    device: str | UnsetType = UNSET  # (a script's DistributedOptimizer: not said)
    steps: int | None
    plan_hash: str


class Step(Event, tag="step", kw_only=True):
    flat: ClassVar[str | None] = "figures"

    worker: int
    clock: int
    read_versions: list[int]
    staleness: int
    accepted: bool
    reasons: list[str]
    weight: float
    loss: float | None
    num_samples: int
    compute_s: float
    sleep_s: float
    pull_s: float
    push_s: float
    wait_s: float
    bytes: int
    push_bytes: int | UnsetType = UNSET  # of ``bytes``, those pushed (the rest: pulled)
    pull_bytes: int | UnsetType = UNSET
    local_steps: int | UnsetType = UNSET  # local SGD only
    figures: dict[str, float] = msgspec.field(default_factory=dict)  # the script's, by name


class Eval(Event, tag="eval", kw_only=True):
    flat: ClassVar[str | None] = "figures"

    worker: int
    clock: int
    versions: list[int]
    figures: dict[str, float]  # loss, accuracy, NAME
    final: bool | UnsetType = UNSET  # (true, after opt.final(); absent otherwise)


class Final(Event, tag="final", kw_only=True):
    worker: int
    clock: int
    versions: list[int]
    waited_s: float


class WorkerEnd(Event, tag="worker_end", kw_only=True):
    """The fields of WorkerResult.to_json (those it leaves out are not written)."""

    worker: int
    steps: int
    clock: int
    pushes: int
    accepted: int
    rejected: int
    final_train_loss: float | UnsetType = UNSET
    seconds: float
    train_seconds: float | UnsetType = UNSET
    budget_seconds: float | UnsetType = UNSET
    budget_spent: bool | UnsetType = UNSET
    wait_seconds: float
    final_versions: list[int]
    eval: dict[str, float] | UnsetType = UNSET


# ------------------------------------------------------------------ launcher


class LauncherStart(Event, tag="launcher_start", kw_only=True):
    metrics_port: int | None
    spec: Map | UnsetType = UNSET


class LauncherAlarm(Event, tag="alarm", kw_only=True):
    """A shard's alarm, as the launcher read it from the shard's log."""

    signal: str
    shard: int | None
    worker: int | None
    version: int | None
    figures: Map
    message: str
    process: str


class LauncherMetrics(Event, tag="metrics", kw_only=True):
    steps: int
    metrics: Map


class Stall(Event, tag="stall", kw_only=True):
    stalled: bool
    quiet: float
    pace: float
    running: list[str]


class LauncherFailover(Event, tag="failover", kw_only=True):
    process: str
    shard: int
    replica: int
    address: str
    epoch: int
    seconds: float


class LauncherRejoined(Event, tag="rejoined", kw_only=True):
    process: str
    shard: int
    replica: int
    address: str
    primary: str
    epoch: int
    seq: int
    seconds: float


class LauncherEnd(Event, tag="launcher_end", kw_only=True):
    alarms: int
    failures: int | UnsetType = UNSET
    restarts: int | UnsetType = UNSET
    stalls: int | UnsetType = UNSET
    exit_codes: dict[str, int | None] | UnsetType = UNSET


SERVER_RECORDS: tuple[type[Event], ...] = (
    ServerStart, WorkerHello, TrainingStart, Init, Push, WorkerDead, WorkerBack,
    WorkerLeftOut, WorkerBye, AllDone, LrChanged, Checkpoint, CheckpointRefused,
    CheckpointFailed, CheckpointRoundsDiffer, CheckpointsMoved, CheckpointResharded, Resharded,
    Hint,
    Alarm, Diverged, ShardMetrics, ServerStop, ReplicationRefused, Failover, SteppedDown, Rejoined,
    BackupJoining, BackupJoined, BackupLost)
WORKER_RECORDS: tuple[type[Event], ...] = (WorkerStart, Step, Eval, Final, WorkerEnd)
LAUNCHER_RECORDS: tuple[type[Event], ...] = (
    LauncherStart, LauncherAlarm, LauncherMetrics, Stall, LauncherFailover,
    LauncherRejoined, LauncherEnd)

#: each log's records (within one, a kind is one record)
LOGS: dict[str, tuple[type[Event], ...]] = {
    "server": SERVER_RECORDS, "worker": WORKER_RECORDS, "launcher": LAUNCHER_RECORDS}
