"""The replication protocol between a shard's replicas, and the role probe workers use.

Its messages share the shard's ROUTER socket with the data protocol
(paramserver/wire/protocol.py) and never look like it: their first frame is
:data:`MAGIC`, which no msgpack header starts with. Then comes the seal that proves a
replica of the shard sent it (paramserver/wire/replauth.py; empty on the role probe
and its answer, which anyone may ask), one msgspec record (bounded:
:data:`MAX_HEADER`), and for a forwarded input the data message's own
frames, as the primary received them, which the backup decodes and handles through
the same code (paramserver/server/replication.py). A replica that joins late asks
with :class:`Join` and is sent one :class:`Snapshot`: the core's state as typed
records (paramserver/core/transfer.py) and one frame of raw bytes per tensor, each
checked as a data message's tensors are (:func:`snapshot_tensors`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
import torch

from paramserver.core.transfer import MAX_META, CoreImage
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire.frames import DTYPES, Limits, check_desc

__all__ = ["MAGIC", "MAX_HEADER", "MAX_SNAPSHOT", "Ack", "Apply", "Join", "Record",
           "Refusal", "RoleReply", "Snapshot", "TensorHead", "WhoIs", "decode", "encode",
           "is_replication", "snapshot_frames", "snapshot_tensors"]

#: the first frame of every replication message (a data header is a msgpack map); its
#: last digit is the protocol's version (2: sealed, issue 42)
MAGIC = b"\x00psrepl2"
#: what every version's first frame starts with (another version is told, not ignored)
PREFIX = MAGIC[:-1]
#: the most bytes a replication record may take (what follows it is bounded by the
#: data protocol's own limits, as any message the shard receives)
MAX_HEADER = 4096
#: the most bytes a snapshot's record may take (its tensors follow in frames)
MAX_SNAPSHOT = MAX_META + (8 << 20)

Count = Annotated[int, msgspec.Meta(ge=0)]
Address = Annotated[str, msgspec.Meta(max_length=512)]


class Apply(msgspec.Struct, tag="apply", frozen=True):
    """Primary -> backup: apply input ``seq`` of ``epoch`` (``seq`` 0: only a keep-alive).

    ``kind``: ``msg`` (the data message follows in frames), ``dead`` (the primary's
    heartbeat timeout removed ``workers``), ``left_out`` (a round deadline left them
    out; the workers one tick of its timer decided on, applied as one). ``now``: the
    primary's monotonic time when it applied it, for logs only: a backup applies each
    input at its own clock, never at this one (another host's clock is another).
    ``key``: under CURVE, the public key the message came with (the backup checks and
    binds worker ids by it, as the primary did); only a peer holding the shard's own key
    may send an Apply. ``peers``: on a keep-alive, the primary's backups in its order
    (whom a backup asks when the primary falls silent; the first writes checkpoints)."""

    epoch: Count
    seq: Count
    now: float
    kind: Literal["msg", "dead", "left_out", "ping"]
    workers: Annotated[list[int], msgspec.Meta(max_length=65536)] = []
    key: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    peers: Annotated[list[Address], msgspec.Meta(max_length=16)] = []


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


class Refusal(msgspec.Struct, tag="refusal", frozen=True):
    """A replica -> whoever sent it a replication message it refused for its seal
    (unsealed: it changes no state anywhere, it only lets the sender say why it is
    ignored). ``key_id``: the receiver's key fingerprint, so that two replicas given
    different keys both name both."""

    reason: Annotated[str, msgspec.Meta(max_length=300)]
    key_id: Annotated[str, msgspec.Meta(max_length=16)]
    replica: Count
    shard: Count


class Join(msgspec.Struct, tag="join", frozen=True):
    """A joining replica -> each of its peers: send me your state, I listen at
    ``address``. Only the primary answers (with a :class:`Snapshot`); ``nonce`` tells
    a resend (ignored) from a new process at the same address (it replaces the old)."""

    replica: Count
    address: Address
    nonce: Annotated[str, msgspec.Meta(max_length=64)]


class TensorHead(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a snapshot: its frame holds its bytes, C order."""

    name: Annotated[str, msgspec.Meta(max_length=1024)]
    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    shape: Annotated[list[Count], msgspec.Meta(max_length=8)]


class Snapshot(msgspec.Struct, tag="snapshot", frozen=True):
    """Primary -> a joining replica: its state once input ``seq`` of ``epoch`` was
    applied; the inputs after ``seq`` follow as :class:`Apply`. ``plan``: the shard
    plan's description as JSON text (empty: no worker brought one yet, and ``core``
    is None); one frame per entry of ``tensors`` follows, in order."""

    epoch: Count
    seq: Count
    #: the primary's monotonic time at the snapshot: the receiver moves the image's
    #: instants by its own now minus this (core/transfer.restore)
    now: float
    primary: Address  # where the primary listens
    plan: Annotated[bytes, msgspec.Meta(max_length=MAX_META)]
    core: CoreImage | None
    tensors: Annotated[list[TensorHead], msgspec.Meta(max_length=1 << 20)]
    #: under CURVE, which key registered each worker id (only that key acts for it)
    owners: Annotated[dict[int, Annotated[str, msgspec.Meta(max_length=64)]],
                      msgspec.Meta(max_length=65536)] = {}
    #: the optimizer a worker script's HELLO brought (paramserver/core/hyper.py's wire
    #: form, checked as a HELLO's is), which the joining replica runs too; None: the
    #: launch's own
    optimizer: dict[str, Any] | None = None


Record = Apply | Ack | WhoIs | RoleReply | Join | Snapshot | Refusal
#: the records anyone may send, unsealed: they change no replica's state
OPEN = (WhoIs, RoleReply, Refusal)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def is_replication(frames: Sequence[Any]) -> bool:
    """Whether ``frames`` (without the ROUTER identity) are a replication message."""
    if not frames:
        return False
    head = frames[0]
    view = memoryview(head.buffer if hasattr(head, "buffer") else head)
    return bytes(view[:len(PREFIX)]) == PREFIX  # (a prefix: a large header is not copied)


def encode(record: Record) -> list[bytes]:
    """The frames of ``record``, its seal left empty (append a forwarded message's
    frames after them, then seal them: replauth.ReplicationKey.seal)."""
    return [MAGIC, b"", _encoder.encode(record)]


def decode(frames: Sequence[Any]) -> tuple[Record, list[Any]]:
    """The record of a replication message and the frames that follow it (its seal
    is checked apart: replauth.ReplicationKey.open)."""
    if len(frames) < 3:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a replication message without its record")
    if bytes(_view(frames[0])) != MAGIC:
        raise ProtocolError(ErrorCode.PROTOCOL_VERSION,
                            f"a replication message of another version "
                            f"({bytes(_view(frames[0]))[len(PREFIX):]!r}; ours "
                            f"{MAGIC[len(PREFIX):]!r}): every replica must run one version")
    head = frames[2]
    data = bytes(head.buffer if hasattr(head, "buffer") else head)
    if len(data) > MAX_SNAPSHOT:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"a replication record of {len(data)} bytes (limit {MAX_SNAPSHOT})")
    try:
        record = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_HEADER, f"replication record: {exc}") from exc
    if len(data) > MAX_HEADER and not isinstance(record, Snapshot):  # (only it is large)
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"a replication record of {len(data)} bytes (limit {MAX_HEADER})")
    return record, list(frames[3:])


def _view(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def snapshot_frames(epoch: int, seq: int, now: float, primary: str, plan: bytes,
                    core: CoreImage | None, tensors: Mapping[str, torch.Tensor],
                    owners: Mapping[int, str] | None = None,
                    optimizer: dict[str, Any] | None = None) -> list[Any]:
    """The frames of a :class:`Snapshot` of these tensors (sent as they are: pass
    tensors nothing writes until they are sent)."""
    heads, bodies = [], []
    for name, t in tensors.items():
        t = t.detach().contiguous()
        heads.append(TensorHead(name, _NAMES[t.dtype], list(t.shape)))
        bodies.append(t.reshape(-1).view(torch.uint8).numpy().data if t.numel()
                      else b"")
    return [*encode(Snapshot(epoch, seq, now, primary, plan, core, heads,
                             dict(owners or {}), optimizer)), *bodies]


def snapshot_tensors(record: Snapshot, frames: Sequence[Any],
                     limits: Limits) -> dict[str, torch.Tensor]:
    """A snapshot's tensors, each checked as a data message's are (name, dtype, shape,
    and its frame's length), copied out of their frames."""
    if len(frames) != len(record.tensors):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a snapshot describes "
                            f"{len(record.tensors)} tensors but {len(frames)} frames came")
    out: dict[str, torch.Tensor] = {}
    for head, frame in zip(record.tensors, frames, strict=True):
        name, dtype, shape = check_desc([head.name, head.dtype, head.shape], limits)
        buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
        numel = math.prod(shape)
        if buf.nbytes != numel * dtype.itemsize or name in out:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"snapshot tensor {name!r}: its frame "
                                f"holds {buf.nbytes} bytes, or it came twice")
        out[name] = (torch.frombuffer(buf, dtype=dtype).clone().reshape(shape) if numel
                     else torch.empty(shape, dtype=dtype))
    return out
