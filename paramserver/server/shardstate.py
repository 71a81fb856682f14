"""A shard's whole state when it moves: out of a shard (:func:`capture`) and into one
(:class:`ShardState`, put in place by ``ShardServer.adopt_state``), and the interface
that carries it between replicas (:class:`StateTransfer`).

Two ways in, one method: a checkpoint resumed (:func:`from_checkpoint`) and a
primary's snapshot a joining replica takes (:func:`from_snapshot`). Either is a
plan, the script optimizer's record the core is built with, the workers' keys, and a
``load`` that fills the core built from the plan. The shard empties everything it
held first (its core, its tables, the per-worker state a push or pull in flight
left) and keeps nothing half-restored when ``load`` fails.

Out: :class:`ShardImage`, the state at one input, between two messages (None while a
push or an INIT in parts is under way). What else a shard will hold joins here, as
a field of the image and a step of ``load``: a server-side compressor's residuals
(issue 46) travel with the core's tensors; an elastic move (issue 47) sends an image
of the slices that change hands to another shard's ``receive_state``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from paramserver.core.sharding import ShardPlan
from paramserver.core.transfer import CoreImage, export, quiet, restore
from paramserver.errors import ConfigError, ProtocolError
from paramserver.server.scriptopt import META_KEY
from paramserver.wire import replication as wrepl

if TYPE_CHECKING:
    import torch

    from paramserver.core.limits import PlanLimits
    from paramserver.core.shard import ShardCore
    from paramserver.sparse.shard import SparseShard
    from paramserver.wire.protocol import Limits

__all__ = ["ShardImage", "ShardState", "StateTransfer", "capture", "from_checkpoint",
           "from_snapshot", "receive_snapshot"]

#: fills a core just built from the state's plan (and its sparse tables, if any)
Load = Callable[["ShardCore", "SparseShard | None"], None]


@dataclass(frozen=True)
class ShardState:
    """What ``ShardServer.adopt_state`` puts in place of everything a shard held.
    ``plan`` None: no plan yet (the shard holds no core); ``meta``: the checkpoint's
    or snapshot's records, the script optimizer's among them (scriptopt.py)."""

    plan: ShardPlan | None
    meta: Mapping[str, Any] = field(default_factory=dict)
    owners: Mapping[int, str] = field(default_factory=dict)  # (CURVE: key per worker)
    load: Load | None = None


@dataclass(frozen=True)
class ShardImage:
    """A shard's state at one input, to send: the plan (JSON text, empty: none), the
    core's records and tensors (copies), the workers' keys, the script's optimizer."""

    plan: bytes
    core: CoreImage | None
    tensors: dict[str, torch.Tensor]
    owners: dict[int, str]
    optimizer: dict[str, Any] | None


class StateTransfer(Protocol):
    """A shard's side of moving its state (as torchft's checkpoint transport: one side
    sends, the other receives and puts it in place); the replication socket carries
    it (wire/replication.py's Snapshot, :func:`from_snapshot`)."""

    def send_state(self) -> ShardImage | None:
        """This shard's state now; None: not now (a push in parts under way)."""

    def adopt_state(self, state: ShardState) -> None:
        """Put ``state`` in place of everything this shard held (raises on a state it
        cannot take, and then holds none)."""


def capture(core: ShardCore | None, plan: ShardPlan | None, busy: bool,
            owners: Mapping[int, str], optimizer: dict[str, Any] | None) -> ShardImage | None:
    """The image to send a joining replica (tensors copied: the core goes on changing
    while they are sent); None while ``busy`` (a push or an INIT in parts)."""
    if busy:
        return None
    if core is None or plan is None:
        return ShardImage(b"", None, {}, dict(owners), optimizer)
    if not quiet(core):
        return None
    record, tensors = export(core)
    return ShardImage(msgspec.json.encode(plan.describe()), record,
                      {k: v.detach().clone() for k, v in tensors.items()}, dict(owners),
                      optimizer)


def from_checkpoint(plan: ShardPlan, tensors: Mapping[str, torch.Tensor],
                    meta: Mapping[str, Any]) -> ShardState:
    """A checkpoint read back (Checkpointer.read): the core's state and the tables'."""
    def load(core: ShardCore, sparse: SparseShard | None) -> None:
        core.load_state_dict(tensors, meta, time.monotonic())
        if sparse is not None:
            sparse.load_state_dict(tensors, meta["sparse"])

    return ShardState(plan, meta, {}, load)


def from_snapshot(snapshot: wrepl.Snapshot, frames: Sequence[Any], limits: Limits,
                  plan_limits: PlanLimits) -> ShardState:
    """A primary's snapshot, its tensors checked at the wire as a data message's are;
    ConfigError naming what is wrong with it."""
    tensors = wrepl.snapshot_tensors(snapshot, frames, limits)
    if not snapshot.plan:
        return ShardState(None, {}, snapshot.owners)
    try:
        plan = ShardPlan.from_description(msgspec.json.decode(snapshot.plan), plan_limits)
    except (ConfigError, ProtocolError, msgspec.DecodeError) as exc:
        raise ConfigError(f"snapshot: {exc}") from exc
    record = snapshot.core

    def load(core: ShardCore, sparse: SparseShard | None) -> None:
        if record is not None:
            # its instants are the primary's clock: moved onto ours (another host's
            # monotonic clock counts from another boot)
            restore(core, record, tensors, time.monotonic() - snapshot.now)

    return ShardState(plan, {META_KEY: snapshot.optimizer}, snapshot.owners, load)


def receive_snapshot(shard: StateTransfer, snapshot: wrepl.Snapshot, frames: Sequence[Any],
                     limits: Limits, plan_limits: PlanLimits) -> None:
    """Put a primary's snapshot in place of everything ``shard`` held, checked as a
    resume checks a checkpoint: ConfigError (and no state of either) when it does not
    fit; a ProtocolError for tensors the wire refuses (before anything changed)."""
    try:
        state = from_snapshot(snapshot, frames, limits, plan_limits)
    except ConfigError:
        shard.adopt_state(ShardState(None, {}, snapshot.owners))  # no old state stays
        raise
    try:
        shard.adopt_state(state)
    except (ProtocolError, msgspec.DecodeError) as exc:
        raise ConfigError(f"snapshot: {exc}") from exc
