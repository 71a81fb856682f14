"""Telling a live shard that holds a request apart from a dead one.

A worker's :class:`Heartbeat` thread sends HEARTBEAT to every shard from its own
sockets; each reply says whether the shard holds one of this worker's pulls, and
why (the start barrier, a sync round, the SSP gate). :class:`Patience` judges a
request that is taking long from those replies: wait for a shard that holds it
(up to ``barrier_timeout``, with a progress line), send it again to one that
answers heartbeats but holds nothing, give up on one that answers nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq

from paramserver.errors import BarrierTimeoutError, ErrorCode, RequestTimeoutError, WrongRunError
from paramserver.shm.link import ShmLink
from paramserver.wire.curve import CurveKeys
from paramserver.wire.messages import HeartbeatReply
from paramserver.wire.protocol import Message, Op
from paramserver.wire.transport import Channel, SideChannel

__all__ = ["Heartbeat", "HeldPull", "Patience", "Waiter", "span"]

log = logging.getLogger(__name__)


class Waiter(Protocol):
    """What :class:`Patience` reads of the client whose request it judges."""

    timeout: float
    attempt_timeout: float
    barrier_timeout: float
    barrier_label: str  # what errors call that bound (the option, or the call's argument)
    worker: int
    channels: list[Channel[ShmLink]]


@dataclass(frozen=True)
class HeldPull:
    """What a shard's heartbeat answer says it holds for us: a pull parked at its gate
    (or a sparse push in its round), at which clock, and why."""

    clock: int | None = None
    waited: float | None = None  # seconds it has held it
    why: str | None = None

    @classmethod
    def of(cls, held: Mapping[str, Any] | None) -> HeldPull | None:
        if held is None:
            return None
        try:
            return msgspec.convert(held, type=cls)
        except msgspec.ValidationError:  # held all the same: the shard says no more
            return cls()


class Heartbeat(threading.Thread):
    """Sends HEARTBEAT to every shard every ``interval`` s from its own sockets."""

    def __init__(self, addresses: Sequence[str], worker: int, interval: float,
                 curve: CurveKeys | None, run_id: str | None = None) -> None:
        super().__init__(name=f"heartbeat-w{worker}", daemon=True)
        self.addresses, self.worker, self.interval, self.curve = addresses, worker, interval, curve
        self.run_id = run_id
        # per shard: a shard of another run's refusal (wrong_run), once it said so: the
        # process at that address is not our shard, whatever else it answers
        self.foreign: dict[int, WrongRunError] = {}
        self._stop_event = threading.Event()
        self.started = time.monotonic()
        # per shard: when it last answered a heartbeat, and the pull of ours it said it
        # holds then (clock, waited, why), or None
        self.last_reply: dict[int, float] = {}
        self.held: dict[int, HeldPull | None] = {}

    def status(self, shard: int) -> tuple[float | None, HeldPull | None]:
        """When ``shard`` last answered a heartbeat (monotonic; None: never) and the
        pull it said it holds for us then."""
        return self.last_reply.get(shard), self.held.get(shard)

    def run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        chans: list[Channel[SideChannel]] = [
            Channel(a, peer=f"shard {i}", curve=self.curve, context=ctx)
                 for i, a in enumerate(self.addresses)]
        beat: dict[str, object] = {"worker": self.worker}
        if self.run_id:
            beat["run"] = self.run_id
        try:
            while not self._stop_event.wait(self.interval):
                for i, ch in enumerate(chans):
                    try:
                        self._prepare(i, ch)
                        while (rep := ch.recv_nowait()) is not None:
                            if rep.op is Op.ERROR and rep.get("code") == ErrorCode.WRONG_RUN:
                                self.foreign[i] = WrongRunError(
                                    f"{ch.peer} at {ch.address}", ErrorCode.WRONG_RUN,
                                    str(rep.get("reason")))
                                continue
                            body = rep.body if rep.op is Op.REPLY else None
                            self.held[i] = HeldPull.of(body.held if isinstance(
                                body, HeartbeatReply) else None)
                            self.last_reply[i] = time.monotonic()
                        ch.send(Message(Op.HEARTBEAT, ch.next_seq(), beat))
                    except Exception as exc:  # a heartbeat must never kill the worker
                        log.debug("heartbeat to shard %d failed: %s", i, exc)
        finally:
            for ch in chans:
                ch.close()

    def _prepare(self, shard: int, channel: Channel[SideChannel]) -> None:
        """Before a beat to ``shard``: nothing here (a subclass may move the channel)."""

    def stop(self) -> None:
        self._stop_event.set()


def span(seconds: float) -> str:
    """``seconds`` for a person: 42s, 3 min 20s, 1 h 5 min."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min" + (f" {secs}s" if secs else "")
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h" + (f" {minutes} min" if minutes else "")


class Patience:
    """How long one request may wait, judged from the shards' heartbeat answers.

    A shard that answers nothing (neither the request nor heartbeats) for the
    client's ``timeout`` is dead or unreachable: give up, naming it. A shard that
    answers heartbeats and says it holds our pull (a sync barrier, an SSP gate,
    the start barrier) is waited for, up to ``barrier_timeout`` (0: no bound),
    with a progress line every ``progress_every`` seconds; the request is not
    sent again meanwhile. A shard that answers heartbeats but holds nothing gets
    the request again each attempt, for ``timeout`` in all.
    """

    def __init__(self, client: Waiter, heartbeat: Heartbeat, label: str,
                 shards: Sequence[int], started: float | None = None) -> None:
        self.client, self.heartbeat, self.label, self.shards = client, heartbeat, label, shards
        # when the request began (monotonic): a judge made at its first timeout is given it
        self.started = time.monotonic() if started is None else started
        self.last_progress = self.started
        self.progress_every = max(client.attempt_timeout, min(30.0, client.timeout))
        # per shard: when it last held this request (or the request started)
        self.last_held: dict[int, float] = {}
        self.retried = 0

    def _where(self, shard: int) -> str:
        return f"shard {shard} at {self.client.channels[shard].address}"

    def _unanswered(self, shard: int, quiet: float, silence: float, beats: float) -> str:
        """Why a request unanswered for the client's timeout is given up: its shard
        answers heartbeats (the last within a few beats) but not it, or answers
        nothing (it went quiet after the request began: dead, or gone)."""
        if silence <= max(beats, self.client.attempt_timeout):
            return (f"{self.label}: {self._where(shard)} answers heartbeats (the last "
                    f"{span(silence)} ago) but not this request, within {span(quiet)}")
        return (f"{self.label}: {self._where(shard)} does not answer: no reply to this "
                f"request for {span(quiet)}, nor to heartbeats for {span(silence)} (it "
                f"stopped; is it running and reachable?)")

    def __call__(self, lost: list[int]) -> bool:
        client, now = self.client, time.monotonic()
        holding: list[tuple[int, HeldPull]] = []
        resend = False
        # heartbeats are read every interval: a few missed ones are no silence
        beats = 3 * self.heartbeat.interval
        for shard in sorted({self.shards[i] for i in lost}):
            foreign = self.heartbeat.foreign.get(shard)
            if foreign is not None:  # another run's shard took over its address
                raise foreign
            heard, held = self.heartbeat.status(shard)
            silence = now - (heard if heard is not None else self.heartbeat.started)
            if silence > max(client.timeout, beats):
                raise RequestTimeoutError(
                    f"{self.label}: {self._where(shard)} does not answer: no reply to this "
                    f"request or to heartbeats for {span(silence)} (is it running and "
                    f"reachable?)")
            if held is not None:
                self.last_held[shard] = now
                holding.append((shard, held))
                continue
            quiet = now - self.last_held.get(shard, self.started)
            if quiet > client.timeout:
                raise RequestTimeoutError(self._unanswered(shard, quiet, silence, beats))
            resend = True
        if resend:
            self.retried += 1
            log.warning("%s: no reply yet in %.1fs; sending it again (%d)", self.label,
                        client.attempt_timeout, self.retried)
        if holding:
            waited = now - self.started
            shard, held = holding[0]
            what = (f"{self.label}: shard {shard} is alive and holding your pull for worker "
                    f"{client.worker} (clock {'?' if held.clock is None else held.clock}), "
                    f"waited {span(waited)}: {held.why or 'its gate is closed'}")
            if client.barrier_timeout and waited > client.barrier_timeout:
                raise BarrierTimeoutError(f"{what}; giving up after {client.barrier_label} "
                                          f"{client.barrier_timeout:g}s")
            if now - self.last_progress >= self.progress_every:
                self.last_progress = now
                bound = (f"{client.barrier_label} {client.barrier_timeout:g}s"
                         if client.barrier_timeout else f"no {client.barrier_label}")
                log.warning("%s (still waiting; %s)", what, bound)
        return resend
