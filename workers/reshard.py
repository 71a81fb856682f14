"""``paramserver reshard``: move a running job's shards to another shard count, live
(issue 47, item 2). The admin side of server/elastic.py's steps.

The admin gathers and redistributes: each old shard, frozen at one cut, sends its
state (its checkpoint, as a resume reads it) here; core/reshard.py computes the
new plan's shards from them (the same rule as ``checkpoint reshard``); each shard of
the new plan is sent its part, and only once every one holds it do they commit.
(The shards do not send slices to each other: one process sees every state, checks
the shards agree, and the move is all or nothing; the cost is each byte crossing
twice, which the benchmark's pause includes: ``paramserver bench --part reshard``.)

0. prepare: each shard to add answers (and loads what a first core needs), or the
   move fails before any shard froze.
1. freeze: sync, at a round boundary every shard reaches (``at`` rounds closed, or
   the next one); async and SSP, now. Each shard holds the requests that come.
2. align (async, SSP): a push that reached some shards before the cut is taken by
   the others too, from what they hold; each worker's clock is the largest any
   shard saw (an SSP pull that reached one shard first).
3. capture, reshard, adopt: the new states go to the new plan's shards (the old
   ones in it and those ``add`` names, started empty: ``paramserver server``).
4. commit: added shards first, then kept, then removed. A failure before any kept
   or removed shard committed aborts: the old shards serve on with what they held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from paramserver.core.reshard import ReshardError, reshard
from paramserver.errors import ConfigError, ParamServerError, RemoteError, TransportError
from paramserver.server.elastic import META_TENSOR, decode_meta, encode_meta
from paramserver.wire.curve import CurveKeys
from paramserver.wire.messages import ReshardReply
from paramserver.wire.protocol import Message, Op
from paramserver.wire.retry import Retry
from paramserver.wire.transport import Channel, SideChannel, request_all

__all__ = ["MoveFailed", "MoveReport", "live_reshard", "new_servers"]

log = logging.getLogger(__name__)

#: how long a shard may hold one freeze or align answer while it gets there
STEP_WAIT = 2.0


class MoveFailed(ParamServerError):
    """A live move did not happen; the old plan serves on (the message says why)."""


@dataclass(frozen=True)
class MoveReport:
    """What a move did: its epoch, shard counts, where, at which version and round,
    how long the shards held requests (``pause_s``: from the last shard frozen to
    the last commit), the whole move's time, and the state's bytes."""

    epoch: int
    from_shards: int
    to_shards: int
    servers: tuple[str, ...]
    version: int
    rounds: int
    freeze_s: float
    pause_s: float
    total_s: float
    bytes: int

    def describe(self) -> str:
        return (f"moved {self.from_shards} -> {self.to_shards} shard(s) at round {self.rounds} "
                f"(version {self.version}), plan epoch {self.epoch}: paused {self.pause_s:.3f}s "
                f"({self.bytes / 2**20:.1f} MiB moved; {self.total_s:.3f}s in all)")


def new_servers(servers: Sequence[str], to: int, add: Sequence[str]) -> list[str]:
    """The new plan's addresses: the first ``to`` of the old ones, then ``add``."""
    if isinstance(to, bool) or not isinstance(to, int) or to < 1:
        raise ConfigError(f"--to must be an integer >= 1, got {to!r}")
    if len(set(servers) | set(add)) != len(servers) + len(add):
        raise ConfigError("an address is named twice in --servers and --add")
    if to <= len(servers):
        if add:
            raise ConfigError(f"--add starts shards for a move to more than {len(servers)}; "
                              f"a move to {to} keeps the first {to} of --servers")
        return list(servers[:to])
    if len(servers) + len(add) != to:
        raise ConfigError(f"a move from {len(servers)} to {to} shards needs {to - len(servers)} "
                          f"--add address(es) of started, empty shards; got {len(add)}")
    return [*servers, *add]


class _Admin:
    def __init__(self, addresses: Sequence[str], curve: CurveKeys | None, timeout: float
                 ) -> None:
        self.timeout = timeout
        self.chans: dict[str, Channel[SideChannel]] = {
            a: Channel(a, peer=f"server {a}", curve=curve) for a in addresses}

    def ask(self, steps: dict[str, Message], timeout: float | None = None) -> dict[str, Message]:
        addresses = list(steps)
        replies = request_all([self.chans[a] for a in addresses], [steps[a] for a in addresses],
                              Retry(timeout or self.timeout, 0), "RESHARD")
        return dict(zip(addresses, replies, strict=True))

    def close(self) -> None:
        for ch in self.chans.values():
            ch.close()


def _step(step: str, tensors: dict[str, Any] | None = None, **fields: Any) -> Message:
    return Message(Op.RESHARD, 0, {"step": step, **fields}, dict(tensors or {}))


def live_reshard(servers: Sequence[str], to: int, add: Sequence[str] = (), *, at: int = -1,
                 timeout: float = 60.0, freeze_timeout: float | None = None,
                 curve: CurveKeys | None = None,
                 progress: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> MoveReport:
    """Move the job whose shards listen at ``servers`` (in shard order) to ``to`` shards
    (``add``: the addresses of the shards it adds, started and empty), at the sync
    round ``at`` (-1: the next boundary; ignored outside sync). ``timeout``: for each
    step's answers; ``freeze_timeout`` (default: ``timeout``): for the shards to reach
    the cut (a round far ahead, weights not sent yet). Raises :class:`MoveFailed`
    (the old plan serves on) or ConfigError for bad arguments. ``cancel``: set, the
    wait for the cut ends (MoveFailed; the shards stop waiting for it too)."""
    say = progress or (lambda text: log.info("%s", text))
    target = new_servers(servers, to, add)
    started = time.perf_counter()
    admin = _Admin([*servers, *add], curve, timeout)
    old = list(servers)
    committed: list[str] = []
    try:
        if add:  # (a shard that does not answer fails the move before anything froze)
            try:
                admin.ask({a: _step("prepare") for a in add})
            except (RemoteError, TransportError) as exc:
                raise MoveFailed(f"a shard to add did not get ready: {exc}; nothing moved, "
                                 "the old plan serves on") from exc
        try:
            replies = _freeze(admin, old, at, started + (freeze_timeout or timeout) - timeout,
                              say, cancel)
            froze = time.perf_counter()
            first: ReshardReply = replies[old[0]].body
            mode = first.mode
            if mode != "sync":
                _align(admin, old, replies, started)
            say(f"frozen at round {first.rounds} ({mode}); capturing "
                f"{len(old)} shard(s)")
            states = []
            for rep in admin.ask({a: _step("capture") for a in old}).values():
                tensors = dict(rep.tensors)
                states.append((tensors, decode_meta(tensors)))
            _even_clocks([m for _, m in states])
            try:
                moved = reshard(states, to)
            except ReshardError as exc:
                raise MoveFailed(str(exc)) from exc
            epoch = max(r.body.epoch for r in replies.values()) + 1
            size = sum(t.numel() * t.element_size() for ts, _ in moved for t in ts.values())
            say(f"sending {size / 2**20:.1f} MiB to {to} shard(s) (plan epoch {epoch})")
            plan_fields = {"epoch": epoch, "servers": target}
            removed = [a for a in old if a not in target]
            # the shards it removes are asked too, frozen still: one lost since the
            # capture fails the move before anything committed (no way back after)
            got = admin.ask({**{a: _step("adopt", {**moved[k][0],
                                                   META_TENSOR: encode_meta(moved[k][1])},
                                         shard=k, **plan_fields)
                                for k, a in enumerate(target)},
                             **{a: _step("freeze", at=-1, wait=0) for a in removed}})
            thawed = [a for a in removed if not got[a].body.frozen]
            if thawed:
                raise MoveFailed(f"shard(s) {thawed} no longer stand frozen at the cut "
                                 "(restarted?)")
            say("every shard of the new plan holds its state; committing")
            order = [a for a in target if a not in old] + [a for a in target if a in old]
            for address in order:  # added first: their failure aborts with nothing lost
                admin.ask({address: _step("commit", shard=target.index(address),
                                          **plan_fields)})
                committed.append(address)
            if removed:
                admin.ask({a: _step("commit", shard=0, **plan_fields) for a in removed})
        except (RemoteError, TransportError, ConfigError, MoveFailed) as exc:
            if any(a in old for a in committed):
                raise MoveFailed(f"the move failed after shard(s) {committed} committed: "
                                 f"{exc}") from exc
            silent = _abort(admin, old + [a for a in add if a not in committed])
            lost = [a for a in silent if a in old]
            if lost:  # (its state is in no process now: its checkpoint has it)
                raise MoveFailed(f"{exc}; old shard(s) {lost} stopped answering: the move "
                                 f"is called off, the other {len(old) - len(lost)} serve "
                                 "on (restart the lost one(s) from a checkpoint)") from exc
            raise MoveFailed(f"{exc}; the old plan of {len(old)} shard(s) serves on") from exc
        done = time.perf_counter()
        rep0: ReshardReply = replies[old[0]].body
        return MoveReport(epoch, len(old), to, tuple(target), rep0.version, rep0.rounds,
                          froze - started, done - froze, done - started, size)
    finally:
        admin.close()


def _freeze(admin: _Admin, old: list[str], at: int, started: float,
            say: Callable[[str], None], cancel: threading.Event | None = None
            ) -> dict[str, Message]:
    """Freeze every old shard at one cut: in sync, one number of rounds closed."""
    while True:
        if cancel is not None and cancel.is_set():
            raise MoveFailed("cancelled before the shards reached the cut")
        replies = admin.ask({a: _step("freeze", at=at, wait=STEP_WAIT) for a in old},
                            STEP_WAIT + admin.timeout)
        bodies: list[ReshardReply] = [r.body for r in replies.values()]
        rounds = {b.rounds for b in bodies}
        if all(b.frozen for b in bodies) and (bodies[0].mode != "sync" or len(rounds) == 1):
            return replies
        if any(b.epoch != bodies[0].epoch for b in bodies):
            raise MoveFailed(f"the shards hold different plan epochs "
                             f"{sorted({b.epoch for b in bodies})}: not one plan's")
        if time.perf_counter() - started > admin.timeout:
            raise MoveFailed(f"the shards did not reach one cut within {admin.timeout:g}s "
                             f"(rounds {sorted(rounds)}, frozen "
                             f"{[b.frozen for b in bodies]})")
        if bodies[0].mode == "sync" and any(b.frozen for b in bodies) and len(rounds) > 1:
            at = max(max(rounds), at)  # one shard is a round ahead: all go there
            say(f"waiting for every shard to close round {at}")


def _align(admin: _Admin, old: list[str], replies: dict[str, Message], started: float
           ) -> None:
    """Every shard takes the pushes any shard took before the cut (from what it holds)."""
    bodies: list[ReshardReply] = [r.body for r in replies.values()]
    windows: dict[int, int] = {}
    for b in bodies:
        for w, p in b.windows.items():
            windows[w] = max(windows.get(w, 0), p)
    lagging = [a for a, r in replies.items()
               if any(r.body.windows.get(w, 0) < p for w, p in windows.items())]
    while lagging:
        got = admin.ask({a: _step("align", windows={str(w): p for w, p in windows.items()},
                                       wait=STEP_WAIT) for a in lagging},
                        STEP_WAIT + admin.timeout)
        lagging = [a for a, r in got.items()
                   if any(r.body.windows.get(w, 0) < p for w, p in windows.items())]
        if lagging and time.perf_counter() - started > admin.timeout:
            raise MoveFailed(f"shard(s) {lagging} did not receive pushes other shards took "
                             f"within {admin.timeout:g}s")


def _even_clocks(metas: list[dict[str, Any]]) -> None:
    """Each worker's clock: the largest any shard saw (an SSP pull that reached one
    shard before the cut and another after it)."""
    clocks: dict[str, int] = {}
    for meta in metas:
        for w, record in (meta.get("workers") or {}).items():
            if isinstance(record, dict) and isinstance(record.get("clock"), int):
                clocks[w] = max(clocks.get(w, 0), record["clock"])
    for meta in metas:
        for w, record in (meta.get("workers") or {}).items():
            if isinstance(record, dict) and w in clocks:
                record["clock"] = clocks[w]


def _abort(admin: _Admin, addresses: list[str]) -> list[str]:
    """Undo the freeze (and drop what was sent); returns the shards that did not
    answer (each named in the log)."""
    silent = []
    for address in addresses:
        try:
            admin.ask({address: _step("abort")}, min(admin.timeout, 10.0))
        except (RemoteError, TransportError) as exc:
            log.warning("%s did not take the abort: %s", address, exc)
            silent.append(address)
    return silent
