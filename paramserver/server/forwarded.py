"""What a primary forwards to its backups of a data message it received
(paramserver/server/replication.py): the message as it came over TCP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paramserver.wire.protocol import Message, encode

__all__ = ["as_tcp", "owned"]


#: the fields by which a same-host worker's message refers to shared memory
_SHM_FIELDS = ("shm", "via_shm")


def as_tcp(msg: Message, frames: list[Any]) -> list[Any]:
    """What the backups get for ``msg``: its frames as received, or, for a message
    that refers to its sender's shared memory (a segment offered at HELLO, tensors
    lent in it, an answer through the weight board), the same message as it would
    have come over TCP: those fields left out, the tensors the primary read from the
    segment as frames (zero-copy: the worker writes its segment again only after our
    answer, and we answer after every backup has received the whole message)."""
    fields = msg.fields
    if not any(k in fields for k in _SHM_FIELDS):
        return frames
    plain = {k: v for k, v in fields.items() if k not in _SHM_FIELDS}
    return encode(Message(msg.op, msg.seq, plain, msg.tensors))


def owned(frames: Sequence[Any]) -> list[Any]:
    """``frames`` with the memory views (as_tcp's tensors read from a worker's segment)
    copied: a backup that is not waited for may still be sent them once the worker has
    its answer and writes its segment again."""
    return [bytes(f) if isinstance(f, memoryview) else f for f in frames]
