"""A shard core's complete state, for a replica that joins late (issue 32).

A checkpoint (:mod:`paramserver.core.snapshot`) holds what *resuming* needs: the
weights, the optimizer's state, versions, clocks and each worker's counts. A backup
that is to go on applying its primary's inputs needs more, bit for bit: each worker's
push-id window with its last outcome (a retried push is answered as a duplicate),
liveness and pace, the left-out set, and the open sync round as it is, with the parts
set aside for their turn (a round sums in worker-id order: folding them early would
change the sum's rounding). :func:`export` is the checkpoint's snapshot plus those, as
typed records (:class:`CoreImage`) and tensors; :func:`restore` puts them into a core
built from the same plan and configuration, checking the checkpoint part as a resume
does. The rules live here once; the wire (paramserver/wire/replication.py) carries
the records as they are.

A core is exported only when :func:`quiet`: no push in parts half-received and no INIT
in parts under way (their parts live in the server and the core together, and are
not carried). Parked pulls are not carried either: a worker whose pull waits asks
again, through the same retry that carries it over a failover.

Times: the image's instants (when each worker was last heard, last pushed, first
contended; when the round opened) are the exporter's monotonic clock, which means
nothing on another host (each machine's clock counts from its own boot). The sender
tells its ``now`` beside the image, and :func:`restore` moves every instant by the
receiver's ``now`` minus it (``shift``): ages are kept, whatever the two clocks read.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated

import msgspec
import torch

from paramserver.core import snapshot
from paramserver.core.membership import CONTENDERS, PACES
from paramserver.core.modes import MAX_WORKERS
from paramserver.core.probe import all_finite
from paramserver.core.records import (
    MAX_REASONS,
    BoundTotals,
    PushOutcome,
    WorkerState,
    check_tensors,
)
from paramserver.errors import ConfigError, ProtocolError

if TYPE_CHECKING:
    from paramserver.core.corestate import CoreState

__all__ = ["CoreImage", "RoundImage", "WaitingPart", "WorkerImage", "export", "quiet",
           "restore"]

#: the most bytes of a checkpoint's metadata (its workers' records, the optimizer's
#: hyperparameters); a worker's record takes a few hundred bytes
MAX_META = 64 << 20
Count = Annotated[int, msgspec.Meta(ge=0)]
Ids = Annotated[list[Count], msgspec.Meta(max_length=MAX_WORKERS)]
Text = Annotated[str, msgspec.Meta(max_length=512)]
Keys = Annotated[list[Annotated[str, msgspec.Meta(max_length=1024)]],
                 msgspec.Meta(max_length=1 << 20)]


class WorkerImage(msgspec.Struct, frozen=True):
    """One :class:`~paramserver.core.records.WorkerState`, every field of it."""

    worker: Count
    incarnation: Text
    last_seen: float
    clock: Count
    live: bool
    finished: bool
    pushes: int
    applied: int
    rejected: Annotated[dict[str, int], msgspec.Meta(max_length=MAX_REASONS + 1)]
    downweighted: int
    weight_sum: float
    staleness: Annotated[dict[int, int], msgspec.Meta(max_length=256)]
    staleness_max: int
    staleness_sum: int
    last_push_id: int
    last_outcome: PushOutcome | None
    pulls: int
    deferred_pulls: int
    wait_seconds: float
    deaths: int
    reported_dead: bool
    anchored: bool
    spoke: bool
    pushed_at: float
    origin: Text
    contenders: Annotated[dict[Text, float], msgspec.Meta(max_length=CONTENDERS + 1)]


class WaitingPart(msgspec.Struct, frozen=True):
    """One part of a joined worker's push set aside for its turn in the round's sum;
    its tensors are ``wait/<index>/<key>``, ``index`` its place in the list."""

    worker: Count
    alpha: float
    keys: Keys


class RoundImage(msgspec.Struct, frozen=True):
    """The open sync round beyond what a checkpoint keeps of it: its sums as they are
    (``agg/<key>`` for each written key), the parts set aside, whose turn came."""

    written: Keys
    opened: float | None
    void: bool
    in_place: Count
    waiting: Annotated[list[WaitingPart], msgspec.Meta(max_length=MAX_WORKERS)]


class CoreImage(msgspec.Struct, frozen=True):
    """A core's state but its tensors: the checkpoint's metadata (JSON text, as a
    checkpoint file holds it; checked on restore as a resume checks it), and what a
    checkpoint does not keep."""

    checkpoint: Annotated[bytes, msgspec.Meta(max_length=MAX_META)]
    workers: Annotated[list[WorkerImage], msgspec.Meta(max_length=MAX_WORKERS)]
    round: RoundImage
    left_out: Ids
    workers_evicted: Count
    paces: Annotated[list[float], msgspec.Meta(max_length=PACES)]
    bound: Count
    max_bound: Count
    totals: BoundTotals  # what an adaptive SSP bound is set from
    refused: Count  # steps undone as not finite (the stepper's count)


def quiet(core: CoreState) -> bool:
    """Whether ``core`` may be exported now: no push in parts, no INIT in parts."""
    return not core.round.streams and core.seeding.owner is None


def export(core: CoreState) -> tuple[CoreImage, dict[str, torch.Tensor]]:
    """Everything ``core``'s state is, as records and tensors (the tensors are the
    core's own or copies of them: send them before the core changes)."""
    if not quiet(core):
        raise RuntimeError("a core with a push or INIT in parts is not exported")
    tensors, meta = snapshot.save(core)
    sync = core.round
    tensors = {k: v for k, v in tensors.items() if not k.startswith("agg/")}
    for key in sync.written:
        tensors[f"agg/{key}"] = sync.agg[key]
    waiting: list[WaitingPart] = []
    for worker in sorted(sync.waiting):
        for grads, alpha in sync.waiting[worker]:
            for key, g in grads.items():
                tensors[f"wait/{len(waiting)}/{key}"] = g
            waiting.append(WaitingPart(worker, alpha, list(grads)))
    members, totals = core.members, core.totals
    image = CoreImage(
        checkpoint=msgspec.json.encode(meta),
        workers=[_worker_image(w) for w in members.workers.values()],
        round=RoundImage(sorted(sync.written), sync.opened, sync.void, sync.in_place,
                         waiting),
        left_out=sorted(members.left_out), workers_evicted=members.workers_evicted,
        paces=list(members.paces), bound=core.bound, max_bound=core.max_bound,
        totals=dataclasses.replace(totals),
        refused=core.stepper.refused)
    return image, tensors


def restore(core: CoreState, image: CoreImage, tensors: Mapping[str, torch.Tensor],
            shift: float = 0.0) -> None:
    """Put :func:`export`'s output into ``core`` (built from the same plan and
    configuration, nothing applied to it yet). ``shift``: the receiver's monotonic
    now minus the exporter's when it exported (0: the same clock); every instant of
    the image is moved by it. :class:`ConfigError` naming the field when the snapshot
    is not one this core would export."""
    if not math.isfinite(shift):
        raise ConfigError(f"a clock shift of {shift} s: the snapshot's time is not finite")
    waits = {k: v for k, v in tensors.items() if k.startswith("wait/")}
    try:
        meta = msgspec.json.decode(image.checkpoint)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"field 'checkpoint' is not JSON: {exc}") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("workers"), dict):
        raise ConfigError("field 'checkpoint' must be a checkpoint's metadata (an object)")
    snapshot.load(core, {k: v for k, v in tensors.items() if not k.startswith("wait/")}, meta)
    members, sync = core.members, core.round
    members.workers = {w.worker: _worker_state(w, shift) for w in image.workers}
    members.left_out = set(image.left_out)
    members.workers_evicted = image.workers_evicted
    members.paces.clear()
    members.paces.extend(image.paces)
    core.pulls.clear()
    core.rows.reset()
    r = image.round
    if set(r.written) - core.specs.keys():
        raise ConfigError("field 'round.written' names a key this shard does not hold")
    restored = dict(sync.agg)
    if set(r.written) - restored.keys():
        raise ConfigError("field 'round.written' names a key without its sums (agg/*)")
    sync.agg = {}
    sync.written = set()
    if r.written:
        sync._allocate()  # the round's own buffer (flat), as a live round has it
        for key in r.written:
            sync.agg[key].copy_(restored[key])
        sync.written = set(r.written)
    sync.opened = r.opened + shift if r.opened is not None else None
    sync.void, sync.in_place = r.void, r.in_place
    sync.waiting = {}
    for i, part in enumerate(r.waiting):
        grads = {key: waits[f"wait/{i}/{key}"].clone() for key in part.keys}
        _check_part(core, grads, f"wait/{i}")
        sync.waiting.setdefault(part.worker, []).append((grads, part.alpha))
    core.bound, core.max_bound = image.bound, image.max_bound
    core.totals = dataclasses.replace(image.totals)
    core.stepper.refused = image.refused


def _check_part(core: CoreState, grads: Mapping[str, torch.Tensor], where: str) -> None:
    """A part set aside must be one a push could carry: this shard's keys, shapes and
    dtypes (16-bit allowed), finite."""
    try:
        check_tensors(core.specs, grads, where, narrow_ok=True, whole=False)
    except ProtocolError as exc:
        raise ConfigError(exc.reason) from exc
    if not all(g.is_floating_point() and all_finite(g) for g in grads.values()):
        raise ConfigError(f"tensor {where} holds NaN or Inf, or is not floating point")


def _worker_image(w: WorkerState) -> WorkerImage:
    fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}
    fields.update(rejected=dict(w.rejected), staleness=dict(w.staleness),
                  contenders=dict(w.contenders))
    return WorkerImage(**fields)


def _worker_state(image: WorkerImage, shift: float) -> WorkerState:
    """The worker's record, its instants moved onto the receiver's clock by ``shift``."""
    fields = {f: getattr(image, f) for f in image.__struct_fields__}
    fields.update(rejected=Counter(image.rejected), staleness=Counter(image.staleness),
                  contenders={k: t + shift for k, t in image.contenders.items()},
                  last_seen=image.last_seen + shift)
    state = WorkerState(**fields)
    # set after __post_init__, which reads a negative pushed_at as "never": a shifted
    # instant may be below 0 on a receiver whose clock started later
    state.pushed_at = image.pushed_at + shift
    return state
