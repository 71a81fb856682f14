"""The replication protocol between a shard's replicas, and the role probe workers use.

Its messages share the shard's ROUTER socket with the data protocol
(paramserver/wire/protocol.py) and never look like it: their first frame is
:data:`MAGIC`, which no msgpack header starts with. Then comes one msgspec record
(bounded: :data:`MAX_HEADER`), and for a forwarded input the data message's own
frames, as the primary received them, which the backup decodes and handles through
the same code (paramserver/server/replication.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from paramserver.errors import ErrorCode, ProtocolError

__all__ = ["MAGIC", "MAX_HEADER", "Ack", "Apply", "Record", "RoleReply", "WhoIs", "decode",
           "encode", "is_replication"]

#: the first frame of every replication message (a data header is a msgpack map)
MAGIC = b"\x00psrepl1"
#: the most bytes a replication record may take (what follows it is bounded by the
#: data protocol's own limits, as any message the shard receives)
MAX_HEADER = 4096

Count = Annotated[int, msgspec.Meta(ge=0)]
Address = Annotated[str, msgspec.Meta(max_length=512)]


class Apply(msgspec.Struct, tag="apply", frozen=True):
    """Primary -> backup: apply input ``seq`` of ``epoch`` (``seq`` 0: only a keep-alive).

    ``kind``: ``msg`` (the data message follows in frames), ``dead`` (the primary's
    heartbeat timeout removed ``workers``), ``left_out`` (a round deadline left them
    out; the workers one tick of its timer decided on, applied as one). ``now``: the
    primary's monotonic time when it applied it."""

    epoch: Count
    seq: Count
    now: float
    kind: Literal["msg", "dead", "left_out", "ping"]
    workers: Annotated[list[int], msgspec.Meta(max_length=65536)] = []


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """Backup -> primary: input ``seq`` is applied (``ok``), or refused with the epoch
    the backup holds (``ok`` false: a higher epoch fences the sender)."""

    epoch: Count
    seq: Count
    ok: bool
    reason: Annotated[str, msgspec.Meta(max_length=200)] = ""


class WhoIs(msgspec.Struct, tag="whois", frozen=True):
    """Anyone -> a replica: which role do you hold?"""


class RoleReply(msgspec.Struct, tag="role", frozen=True):
    """A replica's answer to :class:`WhoIs` (also what ``paramserver status`` shows)."""

    role: Literal["primary", "backup", "fenced", "joining"]
    epoch: Count
    applied: Count  # last input applied (a primary: sent)
    replica: Count  # its index among the shard's replicas (0 started as the primary)
    backups: Annotated[list[Address], msgspec.Meta(max_length=16)] = []
    lag: Annotated[list[float], msgspec.Meta(max_length=16)] = []  # each backup's last ack, s
    failovers: Count = 0
    behind: Annotated[list[int], msgspec.Meta(max_length=16)] = []  # inputs it has not acked


Record = Apply | Ack | WhoIs | RoleReply

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def is_replication(frames: Sequence[Any]) -> bool:
    """Whether ``frames`` (without the ROUTER identity) are a replication message."""
    if not frames:
        return False
    head = frames[0]
    view = memoryview(head.buffer if hasattr(head, "buffer") else head)
    return bytes(view[:len(MAGIC)]) == MAGIC  # (a prefix: a large header is not copied)


def encode(record: Record) -> list[bytes]:
    """The frames of ``record`` (append a forwarded message's frames after them)."""
    return [MAGIC, _encoder.encode(record)]


def decode(frames: Sequence[Any]) -> tuple[Record, list[Any]]:
    """The record of a replication message and the frames that follow it."""
    if len(frames) < 2:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a replication message without its record")
    head = frames[1]
    data = bytes(head.buffer if hasattr(head, "buffer") else head)
    if len(data) > MAX_HEADER:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"a replication record of {len(data)} bytes (limit {MAX_HEADER})")
    try:
        return _decoder.decode(data), list(frames[2:])
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_HEADER, f"replication record: {exc}") from exc
