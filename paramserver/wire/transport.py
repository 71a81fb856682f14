"""ZeroMQ sockets: a ROUTER for a shard, DEALER channels for its peers.

Everything zmq-specific lives here (and nowhere above it in the stack): bind
and connect with errors a person can act on, zero-copy multipart send/receive,
request/reply matching by sequence number with timeouts that name the peer,
and optional CURVE authentication/encryption (the keys and the ZAP handler
are in curve.py).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from paramserver.errors import RemoteError, RequestTimeoutError, TransportError
from paramserver.wire.curve import CurveKeys, KeyGrant, load_allow_list, start_authenticator
from paramserver.wire.messages import Push, ShmOffer
from paramserver.wire.protocol import (
    DEFAULT_LIMITS,
    Limits,
    Message,
    Op,
    PreparedTensors,
    decode,
    encode,
)
from paramserver.wire.retry import Judge, PatienceFrom, Retry

if TYPE_CHECKING:
    import torch


class SideChannel(Protocol):
    """What a channel needs of a same-host side channel for tensors (the worker's
    :class:`~paramserver.shm.link.ShmLink`): the wire only calls it, the shared
    memory layer above implements it."""

    @property
    def active(self) -> bool: ...

    def offer(self) -> ShmOffer | None: ...

    def granted(self, grant: Any) -> None: ...

    def write(self, tensors: Mapping[str, torch.Tensor]) -> list[list[Any]] | None: ...

    def close(self) -> None: ...

__all__ = [
    "RECV_QUEUE",
    "ZERO_COPY_BYTES",
    "Channel",
    "Fanout",
    "PatienceFrom",
    "Retry",
    "RouterSocket",
    "request_all",
    "tune_allocator",
]

log = logging.getLogger(__name__)


_TUNED: bool | None = None


def tune_allocator() -> bool:
    """Make glibc keep freed message buffers for reuse; once per process (Linux only).

    zmq receives every frame into a fresh malloc'ed buffer. By default glibc
    serves large ones with mmap and returns them to the kernel on free, so each
    received MiB costs 256 page faults (measured: half the time of a 100 MiB
    push + pull over loopback). One arena, an mmap threshold of 32 MiB (the
    most glibc allows) and a high trim threshold make frames of up to 32 MiB
    (plan chunks are 2 MiB) reuse warm memory instead. The process keeps its
    high-water mark. Set PARAMSERVER_MALLOC_TUNING=0 to leave malloc alone.
    """
    global _TUNED
    if _TUNED is not None:
        return _TUNED
    _TUNED = False
    if os.environ.get("PARAMSERVER_MALLOC_TUNING", "1") == "0" or sys.platform != "linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    _TUNED = bool(mallopt(m_arena_max, 1) and mallopt(m_mmap_threshold, 32 << 20)
                  and mallopt(m_trim_threshold, 2**31 - 1))
    return _TUNED


def _context() -> zmq.Context[Any]:
    return zmq.Context.instance()


def _normalise_bind(address: str) -> str:
    if "://" not in address:
        address = f"tcp://{address}"
    if address.startswith("tcp://") and address.rsplit(":", 1)[-1] == "0":
        address = address.rsplit(":", 1)[0] + ":*"  # zmq's spelling of "any free port"
    return address


# zmq's constants as plain ints: pyzmq's IntFlag arithmetic costs a few us per call
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
#: zmq's poll of several sockets (a name of this module's: benchmarks/breakdown.py times it)
poll = zmq.zmq_poll


#: the backend's send: pyzmq's Socket.send only adds the DRAFT routing_id and group
#: arguments (unused here) around it, a Python call per frame
_send = zmq.backend.Socket.send


def _send_frames(sock: zmq.Socket[Any], frames: Sequence[Any], *, copy: bool,
                 track: bool = False) -> zmq.MessageTracker | None:
    """``sock.send_multipart`` without its per-frame type check and flag arithmetic
    (the frames here are :func:`encode`'s bytes and memoryviews, and a routing id)."""
    last = len(frames) - 1
    for i in range(last):
        _send(sock, frames[i], _SNDMORE, copy, track)
    return _send(sock, frames[last], 0, copy, track)


def _recv_frames(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """``sock.recv_multipart(NOBLOCK, copy=False)`` without a ``RCVMORE`` query (and its
    flag enum) per frame: each frame says itself whether more follow (zmq_msg_more)."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


#: messages zmq queues per peer on a server before it stops reading from that peer
#: (1 stalls CURVE handshakes that go through a ZAP handler, with libzmq 4.3.5)
RECV_QUEUE = 2
#: how long a request's send may wait for a connection to its peer (milliseconds)
SEND_WAIT_MS = 500
#: below this many tensor bytes a message is copied into zmq rather than lent to it
ZERO_COPY_BYTES = 64 * 1024


class RouterSocket:
    """The server side: one ROUTER socket, bound once.

    With ``curve`` the socket is a CURVE server: traffic is encrypted and only
    peers that know its public key can connect. A ZAP handler then tags every
    message with its sender's public key (:meth:`user_id`), and with
    ``allowed_clients`` (a directory of client public ``.key`` files, an
    allow-list file, or the parsed grants) refuses every client key not listed;
    the socket gets a context of its own, since a context holds one ZAP handler.
    """

    def __init__(
        self,
        address: str,
        *,
        curve: CurveKeys | None = None,
        allowed_clients: str | Path | Mapping[str, KeyGrant] | None = None,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        tune_allocator()  # before zmq's I/O thread makes its first allocation
        self.limits = limits
        self._auth: ThreadAuthenticator | None = None
        self._own_context: zmq.Context[Any] | None = None
        if allowed_clients is not None and curve is None:
            raise TransportError("authorising client keys needs CURVE: give the server "
                                 "its secret key as well")
        if curve is not None:
            keys = (load_allow_list(allowed_clients)
                    if isinstance(allowed_clients, (str, Path)) else allowed_clients)
            if context is None:
                context = self._own_context = zmq.Context()
            try:
                self._auth = start_authenticator(context, keys)
            except BaseException:
                self._terminate()
                raise
        self.socket = (context or _context()).socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # a peer sending a frame over this size is disconnected by zmq before we allocate it
        self.socket.setsockopt(zmq.MAXMSGSIZE, limits.max_tensor_bytes)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # a few messages queued per peer, then zmq stops reading that peer's
        # connection (TCP pushes back on the sender): a shard holds a handful of
        # push parts per worker, not every gradient its workers managed to send
        self.socket.setsockopt(zmq.RCVHWM, RECV_QUEUE)
        if curve is not None:
            self.socket.curve_secretkey = curve.secret
            self.socket.curve_publickey = curve.public
            self.socket.curve_server = True
        target = _normalise_bind(address)
        try:
            self.socket.bind(target)
        except zmq.ZMQError as exc:
            self.socket.close(0)
            self._terminate()
            if exc.errno == errno.EADDRINUSE:
                raise TransportError(
                    f"cannot bind {address}: the port is already in use (choose another "
                    f"port, or 0 for any free one)"
                ) from exc
            raise TransportError(f"cannot bind {address}: {exc}") from exc
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_ms: int) -> tuple[bytes, list[zmq.Frame]] | None:
        """One raw message (routing id, frames) or None after ``timeout_ms``."""
        if not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return self.recv_nowait()

    def pending(self) -> bool:
        """Whether a message is waiting to be received."""
        return bool(self.socket.getsockopt(_EVENTS) & _POLLIN)

    def recv_nowait(self) -> tuple[bytes, list[zmq.Frame]] | None:
        if not self.pending():
            return None  # cheaper than the zmq.Again an empty recv raises
        try:
            frames = self.socket.recv_multipart(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if len(frames) < 2:
            return None  # not from a DEALER: nothing to answer
        return frames[0].bytes, frames[1:]

    def user_id(self, frames: Sequence[zmq.Frame]) -> str | None:
        """The Z85 public key that sent ``frames`` under CURVE (ZAP's User-Id, per
        message); None without CURVE."""
        if self._auth is None or not frames:
            return None
        try:
            user = frames[0].get("User-Id")
        except (zmq.ZMQError, AttributeError):
            return None
        return user if isinstance(user, str) else None

    def send(self, identity: bytes, msg: Message, *, track: bool = False,
             prepared: PreparedTensors | None = None, matched: bool = False,
             nbytes: int | None = None) -> zmq.MessageTracker | None:
        """Send ``msg`` to a peer. Tensor frames go zero-copy; with ``track`` the
        returned tracker tells when zmq no longer reads their memory.

        A message under ``ZERO_COPY_BYTES`` of tensors is copied instead and
        never tracked (None): a zero-copy frame costs a tracker and a release
        through pyzmq's garbage-collector thread, far more than copying a few KiB.
        ``prepared``: the tensors' frames made beforehand (see :func:`encode`, and
        ``matched``); ``nbytes``: ``msg.nbytes`` if the caller knows it already.
        """
        return self.send_frames(identity, encode(msg, prepared, matched=matched),
                                msg.nbytes if nbytes is None else nbytes, track=track)

    def send_frames(self, identity: bytes, frames: list[bytes | memoryview], nbytes: int, *,
                    track: bool = False) -> zmq.MessageTracker | None:
        """:meth:`send` of a message encoded already (``frames``: a header and its
        tensors' ``nbytes`` of frames)."""
        small = nbytes < ZERO_COPY_BYTES
        track = track and not small
        try:
            if small:  # the routing id and the frames in one pass, all copied
                res = _send_frames(self.socket, [identity, *frames], copy=True)
            else:  # the routing id copied, the tensors lent (and tracked)
                self.socket.send(identity, _SNDMORE)
                res = _send_frames(self.socket, frames, copy=False, track=track)
        except zmq.ZMQError as exc:
            log.warning("dropping a reply to a peer that is gone: %s", exc)
            return None
        return res if track else None

    def close(self, linger: float = 0.0) -> None:
        """Close; with ``linger`` seconds, replies still queued (a SHUTDOWN's answer)
        go out in the background for that long instead of being dropped."""
        self.socket.close(int(linger * 1000))
        self._terminate()

    def _terminate(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context is not None:
            self._own_context.term()
            self._own_context = None


#: the side channel a :class:`Channel` carries (its users read their own kind back)
SideT = TypeVar("SideT", bound=SideChannel)


class Channel(Generic[SideT]):
    """The client side of one server: a DEALER with sequence-numbered requests."""

    def __init__(
        self,
        address: str,
        *,
        peer: str,
        curve: CurveKeys | None = None,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context[Any] | None = None,
        drop_rate: float = 0.0,
        seed: int = 0,
        shm: SideT | None = None,
    ) -> None:
        tune_allocator()  # before zmq's I/O thread makes its first allocation
        self.address = address if "://" in address else f"tcp://{address}"
        self.peer = peer
        # same-host shared memory, offered at HELLO (paramserver/shm/link.py)
        self.shm = shm
        self.limits = limits
        # chaos testing: lose this fraction of requests and of replies, as a
        # flaky network would; retries and push ids must make up for it
        self.drop_rate = drop_rate
        self.dropped = 0
        self.unsent = 0  # sends given up: no connection to the peer (SEND_WAIT_MS)
        self._rng = random.Random(seed)
        self._seq = 0
        # replies of a layout known beforehand, read without the general decoder (a small
        # model's weights: wire/lanes.py); None from it: the general decoder reads them
        self.reader: Callable[[Sequence[Any]], Message | None] | None = None
        self.socket = (context or _context()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # a DEALER blocks a send while it has no pipe to the peer, and after a failed
        # handshake (a wrong CURVE key, a plaintext peer) it has none until one
        # succeeds: a send that waits this long is given up as lost instead, and the
        # request's own timeout and retries take over
        self.socket.setsockopt(zmq.SNDTIMEO, SEND_WAIT_MS)
        if curve is not None:
            if curve.server_public is None:
                raise TransportError(f"{peer}: CURVE needs the server's public key")
            self.socket.curve_secretkey = curve.secret
            self.socket.curve_publickey = curve.public
            self.socket.curve_serverkey = curve.server_public
        try:
            self.socket.connect(self.address)
        except zmq.ZMQError as exc:
            self.socket.close(0)
            raise TransportError(f"cannot connect to {peer} at {self.address}: {exc}") from exc

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _drop(self) -> bool:
        if self.drop_rate and self._rng.random() < self.drop_rate:
            self.dropped += 1
            return True
        return False

    def send(self, msg: Message) -> None:
        if self._drop():
            return
        if self.shm is not None:
            msg = self._via_shm(msg, self.shm)
        try:
            # a small message copied into zmq (as RouterSocket.send), so that its tensors'
            # memory may change once this returns (wire/lanes.py reuses a push's buffer)
            _send_frames(self.socket, encode(msg), copy=msg.nbytes < ZERO_COPY_BYTES)
        except zmq.Again:
            self.unsent += 1
            log.debug("%s: no connection to send on within %d ms; the request counts as "
                      "lost", self.peer, SEND_WAIT_MS)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot send to {self.peer} at {self.address}: {exc}") from exc

    @staticmethod
    def _via_shm(msg: Message, link: SideT) -> Message:
        """``msg`` as sent to a same-host shard: HELLO offers our segment; once the
        shard granted its board, tensors go into the segment and pulls ask for a
        ticket. The caller's message is left as it is (a retry sends it again)."""
        fields = msg.fields
        if msg.op is Op.HELLO and fields.get("role") == "worker":
            offer = link.offer()
            return msg if offer is None else Message(msg.op, msg.seq, {
                **fields, "shm": msgspec.to_builtins(offer)})
        if not link.active:
            return msg
        extra: dict[str, Any] = {}
        tensors = msg.tensors
        if msg.op in (Op.PUSH, Op.INIT) and tensors:
            descs = link.write(tensors)
            if descs is not None:
                extra["shm"], tensors = descs, {}
        if (msg.op is Op.PULL or fields.get("pull")) and "via_shm" not in fields:
            extra["via_shm"] = True
        return Message(msg.op, msg.seq, {**fields, **extra}, tensors,
                       msg.prepared) if extra else msg

    def recv_nowait(self, polled: bool = False) -> Message | None:
        """A reply if one is waiting, else None; ``polled``: poll just said one is."""
        if not polled and not self.socket.getsockopt(_EVENTS) & _POLLIN:
            return None  # (as RouterSocket.recv_nowait)
        try:
            frames = _recv_frames(self.socket)
        except zmq.Again:
            return None
        if self._drop():
            return self.recv_nowait()
        reader = self.reader
        rep = None if reader is None else reader(frames)
        if rep is None:
            rep = decode(frames, self.limits)
        if self.shm is not None and rep.get("re") == Op.HELLO.value:
            self.shm.granted(rep.get("shm"))
        return rep

    def request(self, msg: Message, retry: Retry | float, what: str | None = None) -> Message:
        return request_all([self], [msg], retry, what)[0]

    def close(self) -> None:
        self.socket.close(0)
        if self.shm is not None:
            self.shm.close()


class Fanout:
    """Distinct channels that each get one request at a time: what request_all's lean
    loop needs of them (the poll list, socket -> index), made once per channel set.
    A channel keeps its socket for life (a failover moves its connection, not it)."""

    __slots__ = ("channels", "index", "polled")

    def __init__(self, channels: Sequence[Channel[Any]]) -> None:
        self.channels = list(channels)
        self.index = {ch.socket: i for i, ch in enumerate(self.channels)}
        self.polled = [(ch.socket, _POLLIN) for ch in self.channels]

    @classmethod
    def of(cls, channels: Sequence[Channel[Any]]) -> Fanout | None:
        """The channels' fanout; None when one appears twice (requests pipelined)."""
        fan = cls(channels)
        return fan if len(fan.index) == len(fan.channels) else None


def _holdable(msg: Message) -> bool:
    """Whether a peer may hold ``msg`` unanswered on purpose: a pull (at a sync barrier,
    an SSP gate, the start), a push that asks for the weights back, or an early part
    (answered once its sum is final)."""
    if msg.op is Op.PULL:
        return True
    body = msg.body if msg.op is Op.PUSH else None  # (parsed only here: on a lapse)
    return isinstance(body, Push) and (body.pull or body.early)


class _Lapses:
    """What a request does each time an attempt's time passes with requests unanswered:
    ask its patience (``patience_from``'s, made now, at the first) whether to send them
    again, or send them again up to ``retries`` times, then name who did not answer.
    Made at a request's first timeout, with the time the request began."""

    def __init__(self, channels: Sequence[Channel], messages: Sequence[Message],
                 retry: Retry, label: str, started: float) -> None:
        self.channels, self.messages, self.label = channels, messages, label
        self.timeout, self.retries = retry.attempt, retry.retries
        self.patience: Judge | None = (
            retry.patience_from(started) if retry.patience_from is not None
            else retry.patience)
        self.attempts = 0

    def __call__(self, lost: list[int]) -> None:
        channels, messages = self.channels, self.messages
        if self.patience is not None:
            # waiting on is for what a peer holds (a pull at a barrier or gate); a
            # request pipelined behind a held one (a BYE behind the final pull) is
            # never held, so it is sent again: it may be what the held one waits for
            again = lost if self.patience(lost) else [i for i in lost
                                                      if not _holdable(messages[i])]
            for i in again:
                channels[i].send(messages[i])
            return
        if self.attempts < self.retries:
            self.attempts += 1
            for i in lost:
                log.warning("%s: no reply from %s in %.1fs; retrying (%d/%d)", self.label,
                            channels[i].peer, self.timeout, self.attempts, self.retries)
                channels[i].send(messages[i])
            return
        who = ", ".join(sorted({f"{channels[i].peer} at {channels[i].address}"
                                for i in lost}))
        waited = self.timeout * (self.attempts + 1)
        raise RequestTimeoutError(f"{self.label}: no reply within {waited:g}s from {who} (is "
                                  f"it running and reachable?)")


def request_all(
    channels: Sequence[Channel],
    messages: Sequence[Message],
    retry: Retry | float,
    what: str | None = None,
    *,
    raise_errors: bool = True,
    sent: bool = False,
    on_reply: Callable[[int, Message], None] | None = None,
    window: int = 0,
    fanout: Fanout | None = None,
) -> list[Message]:
    """Send one request per entry of ``channels``, then wait for every reply (concurrently).

    A channel may appear more than once (requests pipelined on one
    connection, answered in order). Replies are matched by sequence number;
    leftovers from earlier, timed-out requests are discarded. ``retry``
    (wire/retry.py; a number: one attempt of that many seconds) says how long:
    after each ``retry.attempt`` seconds the missing requests are sent again (same
    message, so a retried push keeps its push id) up to ``retry.retries`` times; then
    :class:`RequestTimeoutError` names who did not answer. An ERROR reply raises the
    :class:`RemoteError` subclass for its code (:meth:`RemoteError.from_reply`) naming the peer, or
    with ``raise_errors=False`` is returned in its place for the caller to
    handle. With ``sent`` the messages already went out (they
    carry their sequence numbers); ``on_reply(i, reply)`` is called as each
    non-error reply lands, so the caller can use it while others are in flight.
    With ``window`` at most that many requests are outstanding per channel: the
    next goes out as a reply comes back (flow control for a push in parts, so
    a server holds a few parts per worker, not all of them).

    With ``retry.patience`` the caller, who knows more of the peers than this
    request's replies (their heartbeat answers), decides instead of
    ``retries``: each time an attempt's time passes with requests unanswered it is
    called with their indices, and raises to give up or returns whether to
    send them again (False: the peer said it holds them, at a sync barrier or
    an SSP gate, so waiting on is legitimate). ``retry.patience_from`` makes that
    judge only when a timeout first passes (most requests never need one), given the
    monotonic time the request began; it may return None (then ``retries``).

    ``fanout``: ``channels``' :class:`Fanout`, made once by a caller that sends
    to the same channels often. Distinct channels, each sent one request without
    a window (the common case), take a lean loop with the same semantics.
    """
    if len(channels) != len(messages):
        raise ValueError("one message per channel entry")
    if sent and window:
        raise ValueError("a window needs the messages unsent")
    label = what or (messages[0].op.value.upper() if messages else "request")
    if not isinstance(retry, Retry):
        retry = Retry.of(retry)
    timeout = retry.attempt
    if not window and not sent:
        fan = fanout if fanout is not None else Fanout.of(channels)
        if fan is not None:
            return _request_each(fan, messages, retry, label, raise_errors, on_reply)
    started = time.monotonic()
    replies: list[Message | None] = [None] * len(channels)
    slots: dict[Any, tuple[Channel, dict[int, int]]] = {}  # socket -> (channel, seq -> index)
    queued: dict[Any, list[int]] = {}  # socket -> indices not sent yet, in order
    for i, ch in enumerate(channels):
        if ch.socket not in slots:
            slots[ch.socket] = (ch, {})
            queued[ch.socket] = []
        queued[ch.socket].append(i)
    # what zmq.Poller would poll, without making one per request (a few us each)
    polled = [(sock, _POLLIN) for sock in slots]
    is_sent = [sent] * len(channels)
    # per socket, the requests still unanswered: none, and it is not read again
    unanswered = {sock: len(indices) for sock, indices in queued.items()}

    def send_next(sock: Any, count: int) -> None:
        ch, table = slots[sock]
        for _ in range(count):
            if not queued[sock]:
                return
            i = queued[sock].pop(0)
            if not sent:
                messages[i].seq = ch.next_seq()
                ch.send(messages[i])
            is_sent[i] = True
            table[messages[i].seq] = i

    for sock in slots:
        send_next(sock, window or len(channels))
    lapses: _Lapses | None = None
    missing = len(channels)
    deadline = time.monotonic() + timeout
    while missing:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if lapses is None:  # the first timeout (most requests never have one)
                lapses = _Lapses(channels, messages, retry, label, started)
            lapses([i for i, r in enumerate(replies) if r is None and is_sent[i]])
            deadline = time.monotonic() + timeout
            continue
        for sock, _ in poll(polled, max(1, int(remaining * 1000))):
            ch, table = slots[sock]
            ready = True  # poll said so: the first receive asks zmq nothing more
            while missing:  # once every reply is in, nothing more is read
                rep = ch.recv_nowait(ready)
                ready = False
                if rep is None:
                    break
                slot = table.get(rep.seq)
                if slot is None or replies[slot] is not None:
                    continue  # an answer to an older request we gave up on
                if rep.op is Op.ERROR and raise_errors:
                    raise RemoteError.from_reply(f"{ch.peer} at {ch.address}", rep["code"],
                                                 rep["reason"])
                replies[slot] = rep
                missing -= 1
                unanswered[sock] -= 1
                if window:
                    send_next(sock, 1)
                if on_reply is not None and rep.op is not Op.ERROR:
                    on_reply(slot, rep)
                if not unanswered[sock]:
                    break  # (a stale answer left queued is read, and dropped, later)
    return [r for r in replies if r is not None]


def _request_each(fan: Fanout, messages: Sequence[Message], retry: Retry, label: str,
                  raise_errors: bool,
                  on_reply: Callable[[int, Message], None] | None) -> list[Message]:
    """request_all for distinct channels, one request each, no window: the same
    sends, matching, timeouts, retries and patience, without the per-socket tables
    and queues a pipelined request needs (one expected seq per channel)."""
    channels = fan.channels
    started = time.monotonic()
    seqs = []
    for ch, msg in zip(channels, messages, strict=True):
        msg.seq = seq = ch.next_seq()
        ch.send(msg)
        seqs.append(seq)
    replies: list[Any] = [None] * len(channels)
    missing = len(channels)
    index, polled = fan.index, fan.polled
    lapses: _Lapses | None = None
    timeout = retry.attempt
    deadline = time.monotonic() + timeout
    while missing:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if lapses is None:  # the first timeout (most requests never have one)
                lapses = _Lapses(channels, messages, retry, label, started)
            lapses([i for i, r in enumerate(replies) if r is None])
            deadline = time.monotonic() + timeout
            continue
        for sock, _ in poll(polled, max(1, int(remaining * 1000))):
            i = index[sock]
            ch, want = channels[i], seqs[i]
            ready = True  # poll said so: the first receive asks zmq nothing more
            while missing:
                rep = ch.recv_nowait(ready)
                ready = False
                if rep is None:
                    break
                if rep.seq != want or replies[i] is not None:
                    continue  # an answer to an older request we gave up on: dropped
                if rep.op is Op.ERROR and raise_errors:
                    raise RemoteError.from_reply(f"{ch.peer} at {ch.address}", rep["code"],
                                                 rep["reason"])
                replies[i] = rep
                missing -= 1
                if on_reply is not None and rep.op is not Op.ERROR:
                    on_reply(i, rep)
                break  # its one request is answered (a stale answer left is read later)
    return replies


#: moved to curve.py; still importable from here
_MOVED_TO_CURVE = frozenset({"ANY_KEY", "AUTHORIZED_CLIENTS_DIR", "CurveKeyFiles", "admin_key_pair",
                             "generate_curve_keys", "parse_allow_list", "public_key"})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_CURVE:
        from paramserver.wire import curve
        return getattr(curve, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
