"""ZeroMQ sockets: a ROUTER for a shard, DEALER channels for its peers.

Everything zmq-specific lives here (and nowhere above it in the stack): bind
and connect with errors a person can act on, zero-copy multipart send/receive,
request/reply matching by sequence number with timeouts that name the peer,
and optional CURVE authentication/encryption.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from .errors import RemoteError, TimeoutError, TransportError
from .protocol import DEFAULT_LIMITS, Limits, Message, Op, decode, encode

__all__ = [
    "Channel",
    "CurveKeys",
    "RouterSocket",
    "request_all",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurveKeys:
    """CURVE key material (Z85 text). A server needs its secret key; a client the
    server's public key and a key pair of its own."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None

    @classmethod
    def load(cls, key_file: str | Path, server_public_file: str | Path | None = None) -> CurveKeys:
        """Read a key file written by ``paramserver keys generate`` (zmq's format)."""
        try:
            public, secret = zmq.auth.load_certificate(str(key_file))
            server_public = None
            if server_public_file is not None:
                server_public, _ = zmq.auth.load_certificate(str(server_public_file))
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot read CURVE key file: {exc}") from exc
        if secret is None:
            raise TransportError(f"{key_file} holds no secret key (use the .key_secret file)")
        return cls(public, secret, server_public)


def _context() -> zmq.Context[Any]:
    return zmq.Context.instance()


def _normalise_bind(address: str) -> str:
    if "://" not in address:
        address = f"tcp://{address}"
    if address.startswith("tcp://") and address.rsplit(":", 1)[-1] == "0":
        address = address.rsplit(":", 1)[0] + ":*"  # zmq's spelling of "any free port"
    return address


class RouterSocket:
    """The server side: one ROUTER socket, bound once."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveKeys | None = None,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.limits = limits
        self.socket = (context or _context()).socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # a peer sending a frame over this size is disconnected by zmq before we allocate it
        self.socket.setsockopt(zmq.MAXMSGSIZE, limits.max_tensor_bytes)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if curve is not None:
            self.socket.curve_secretkey = curve.secret
            self.socket.curve_publickey = curve.public
            self.socket.curve_server = True
        target = _normalise_bind(address)
        try:
            self.socket.bind(target)
        except zmq.ZMQError as exc:
            self.socket.close(0)
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

    def recv_nowait(self) -> tuple[bytes, list[zmq.Frame]] | None:
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if len(frames) < 2:
            return None  # not from a DEALER: nothing to answer
        return frames[0].bytes, frames[1:]

    def send(self, identity: bytes, msg: Message, *, track: bool = False) -> zmq.MessageTracker | None:
        """Send ``msg`` to a peer. Tensor frames go zero-copy; with ``track`` the
        returned tracker tells when zmq no longer reads their memory."""
        frames = encode(msg)
        try:
            self.socket.send(identity, zmq.SNDMORE)
            res = self.socket.send_multipart(frames, copy=False, track=track)
        except zmq.ZMQError as exc:
            log.warning("dropping a reply to a peer that is gone: %s", exc)
            return None
        return res if track else None

    def close(self) -> None:
        self.socket.close(0)


class Channel:
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
    ) -> None:
        self.address = address if "://" in address else f"tcp://{address}"
        self.peer = peer
        self.limits = limits
        # chaos testing: lose this fraction of requests and of replies, as a
        # flaky network would; retries and push ids must make up for it
        self.drop_rate = drop_rate
        self.dropped = 0
        self._rng = random.Random(seed)
        self._seq = 0
        self.socket = (context or _context()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
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
        try:
            self.socket.send_multipart(encode(msg), copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot send to {self.peer} at {self.address}: {exc}") from exc

    def recv_nowait(self) -> Message | None:
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if self._drop():
            return self.recv_nowait()
        return decode(frames, self.limits)

    def request(self, msg: Message, timeout: float, what: str | None = None) -> Message:
        return request_all([self], [msg], timeout, what)[0]

    def close(self) -> None:
        self.socket.close(0)


def request_all(
    channels: Sequence[Channel],
    messages: Sequence[Message],
    timeout: float,
    what: str | None = None,
    *,
    retries: int = 0,
    raise_errors: bool = True,
) -> list[Message]:
    """Send one request per channel, then wait for every reply (concurrently).

    Replies are matched by sequence number; leftovers from earlier, timed-out
    requests are discarded. After ``timeout`` seconds the missing requests are
    sent again (same message, so a retried push keeps its push id) up to
    ``retries`` times; then :class:`TimeoutError` names who did not answer.
    An ERROR reply raises :class:`RemoteError` naming the peer, or with
    ``raise_errors=False`` is returned in its place for the caller to handle.
    """
    if len(channels) != len(messages):
        raise ValueError("one message per channel")
    label = what or (messages[0].op.value.upper() if messages else "request")
    for ch, msg in zip(channels, messages, strict=True):
        msg.seq = ch.next_seq()
        ch.send(msg)
    replies: list[Message | None] = [None] * len(channels)
    poller = zmq.Poller()
    index = {}
    for i, ch in enumerate(channels):
        poller.register(ch.socket, zmq.POLLIN)
        index[ch.socket] = i
    attempts = 0
    deadline = time.monotonic() + timeout
    while any(r is None for r in replies):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [i for i, r in enumerate(replies) if r is None]
            if attempts < retries:
                attempts += 1
                for i in missing:
                    log.warning("%s: no reply from %s in %.1fs; retrying (%d/%d)",
                                label, channels[i].peer, timeout, attempts, retries)
                    channels[i].send(messages[i])
                deadline = time.monotonic() + timeout
                continue
            who = ", ".join(f"{channels[i].peer} at {channels[i].address}" for i in missing)
            waited = timeout * (attempts + 1)
            raise TimeoutError(f"{label}: no reply within {waited:g}s from {who} (is it "
                               f"running and reachable?)")
        for sock, _ in poller.poll(max(1, int(remaining * 1000))):
            i = index[sock]
            ch = channels[i]
            while True:
                rep = ch.recv_nowait()
                if rep is None:
                    break
                if rep.seq != messages[i].seq or replies[i] is not None:
                    continue  # an answer to an older request we gave up on
                if rep.op is Op.ERROR and raise_errors:
                    raise RemoteError(f"{ch.peer} at {ch.address}", rep["code"], rep["reason"])
                replies[i] = rep
    return [r for r in replies if r is not None]
