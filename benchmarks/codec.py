"""``python -m paramserver.benchmarks.codec``: header decoding, today's against msgspec's.

Today a message's header is decoded by msgpack into dicts and lists, then checked
field by field against the op's schema (:func:`paramserver.wire.protocol.decode`).
``msgspec`` decodes msgpack straight into typed structs (one per op, a tagged
union on ``"op"``), validating as it goes. This script measures both on the
headers of the hot path, the same bytes (the wire format is msgpack either way):

* ``push``: a PUSH asking for the weights back (push + pull in one round trip),
  8 tensors of 128 float32 (the async benchmark's 4 KiB model in 8 tensors);
* ``pull``: a PULL;
* ``push-ack``: the REPLY to a PUSH with its outcome (no tensors);
* ``push-pull-reply``: the REPLY carrying the outcome and the 8 weight tensors.

Three figures per header, medians over repeats of many decodes: ``today`` (the
whole :func:`~paramserver.wire.protocol.decode`: header, schema, the typed record
of wire/messages.py, tensor views), ``msgspec`` (the same Message built from
msgspec's structs: struct fields to the dict the server reads, the same record and
tensor views) and ``msgspec-struct`` (the typed decode alone, what a server
rewritten around structs would pay). ``--quick`` is a smoke run (tests/test_bench_codec.py).
"""

# no "from __future__ import annotations": msgspec reads the local structs' annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch

from paramserver.wire.lanes import OutcomeFields
from paramserver.wire.messages import parse
from paramserver.wire.protocol import DTYPES, PROTOCOL_VERSION, Message, Op, decode, encode

from .common import Timing

__all__ = ["HEADERS", "main", "measure", "msgspec_decoder"]

_BOUND = 1 << 62


def _messages() -> dict[str, Message]:
    params = {f"w{i}": torch.zeros(128) for i in range(8)}
    outcome = {"accepted": True, "weight": 1.0, "reason": "", "staleness": 0,
               "version": 1234, "applied": True, "duplicate": False}
    return {
        "push": Message(Op.PUSH, 41, {"worker": 3, "push_id": 977, "clock": 976,
                                      "read_version": 3901, "num_samples": 32,
                                      "loss": 0.6931, "pull": True}, params),
        "pull": Message(Op.PULL, 42, {"worker": 3, "clock": 977}),
        "push-ack": Message(Op.REPLY, 43, {"re": "push", **outcome}),
        "push-pull-reply": Message(Op.REPLY, 44, {"re": "push", "version": 1234,
                                                  "clock": 977, "waited": 0.0,
                                                  "push": outcome}, params),
    }


HEADERS: tuple[str, ...] = tuple(_messages())


_Decode = Callable[[Sequence[Any]], tuple[Message, Any]]


def msgspec_decoder() -> tuple[_Decode, _Decode]:
    """Decoders of the same frames through msgspec structs: the first returns the
    Message the server would get (and the typed header), the second the typed header
    alone. Raises ImportError without msgspec."""
    import msgspec
    from msgspec import Meta, Struct

    Int = Annotated[int, Meta(gt=-_BOUND, lt=_BOUND)]
    # the version the wire speaks now, never a copy of it: a mirror pinned to 1 refused
    # every header once packed frames made it 2
    Version = Annotated[int, Meta(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)]
    # a descriptor is [key, dtype, shape] (a frame of its own) or, since protocol 2,
    # [dtype, [[key, shape, offset], ...]] (a packed frame); msgspec allows one array
    # type in a union, so each is told by its length and checked in _views
    Desc = Annotated[list[Any], Meta(min_length=2, max_length=3)]
    Seq = Annotated[int, Meta(ge=0, lt=_BOUND)]

    class PushFields(Struct, omit_defaults=True):
        worker: Int
        push_id: Int
        clock: Int
        read_version: Int
        num_samples: Int
        loss: float | None = None
        pull: bool = False
        part: Int | None = None
        parts: Int | None = None

    class PullFields(Struct, omit_defaults=True):
        worker: Int
        clock: Int
        observer: bool = False
        wait_init: bool = False

    class ReplyFields(Struct, omit_defaults=True):
        re: str
        version: int | None = None
        clock: int | None = None
        waited: float | None = None
        push: OutcomeFields | None = None  # the wire's own record of an outcome
        accepted: bool | None = None
        weight: float | None = None
        reason: str | None = None
        staleness: int | None = None
        applied: bool | None = None
        duplicate: bool | None = None
        partial: bool | None = None

    class PushHeader(Struct, tag_field="op", tag="push"):
        v: Version
        f: PushFields
        seq: Seq = 0
        t: list[Desc] = []

    class PullHeader(Struct, tag_field="op", tag="pull"):
        v: Version
        f: PullFields
        seq: Seq = 0
        t: list[Desc] = []

    class ReplyHeader(Struct, tag_field="op", tag="reply"):
        v: Version
        f: ReplyFields
        seq: Seq = 0
        t: list[Desc] = []

    dec = msgspec.msgpack.Decoder(PushHeader | PullHeader | ReplyHeader)
    ops: dict[Any, Op] = {PushHeader: Op.PUSH, PullHeader: Op.PULL, ReplyHeader: Op.REPLY}
    to_builtins = msgspec.to_builtins

    def decode_msgspec(frames: Sequence[Any]) -> tuple[Message, Any]:
        head = dec.decode(frames[0])
        if len(head.t) != len(frames) - 1:
            raise ValueError("frame count")
        # the server reads a dict of fields; omit_defaults leaves out what was not sent
        op = ops[type(head)]
        fields = to_builtins(head.f)
        msg = Message(op, head.seq, fields, _views(head.t, frames[1:]))
        msg.body = parse(op, fields)  # the same typed record decode makes
        return msg, head

    def struct_only(frames: Sequence[Any]) -> tuple[Message, Any]:
        head = dec.decode(frames[0])
        return Message(ops[type(head)], head.seq), head

    return decode_msgspec, struct_only


def _views(descs: Sequence[list[Any]], frames: Sequence[Any]) -> dict[str, torch.Tensor]:
    """The tensors the descriptors name, views of their frames, checked as decode checks
    them: the dtype allow-list, each frame's bytes filled exactly, no key twice."""
    tensors: dict[str, torch.Tensor] = {}
    for desc, frame in zip(descs, frames, strict=True):
        buf = memoryview(frame)
        if len(desc) == 3:
            key, dtype_name, shape = desc
            rows = [(key, shape, 0)]
        else:
            dtype_name, entries = desc
            rows = [(key, shape, offset) for key, shape, offset in entries]
        dtype = DTYPES.get(dtype_name)  # the same allow-list
        if dtype is None:
            raise ValueError("dtype")
        flat = torch.frombuffer(buf, dtype=dtype) if buf.nbytes else torch.empty(0, dtype=dtype)
        end = 0
        sizes = []
        for key, shape, offset in rows:
            numel = math.prod(shape)
            if (type(key) is not str or key in tensors
                    or (len(desc) == 2 and offset != end)):
                raise ValueError("tensor")
            sizes.append(numel)
            end += numel * dtype.itemsize
        if end != buf.nbytes:
            raise ValueError("frame size")
        # the entries tile the frame (checked): one call makes every view, as decode does
        for (key, shape, _), view in zip(rows, flat.split_with_sizes(sizes), strict=True):
            tensors[key] = view if len(shape) == 1 else view.view(shape)
    return tensors


def _time(fn: Callable[[], Any], number: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - t0) / number)
    return out


@dataclass(frozen=True)
class HeaderTiming:
    """One header's three decodes (``today``, ``msgspec``, ``msgspec-struct``)."""

    header: str
    bytes: int
    tensors: int
    today: Timing
    msgspec: Timing
    struct_only: Timing


def measure(number: int = 2000, repeats: int = 15) -> list[HeaderTiming]:
    """Per header: microseconds per decode, median [min-max] over interleaved repeats."""
    new, struct_only = msgspec_decoder()
    rows = []
    for name, msg in _messages().items():
        frames = [bytes(f) for f in encode(msg)]
        old_msg = decode(frames)
        new_msg, _ = new(frames)
        # the same message either way (the check that the comparison is fair)
        assert old_msg.op == new_msg.op and old_msg.seq == new_msg.seq
        assert old_msg.fields == new_msg.fields, (old_msg.fields, new_msg.fields)
        assert old_msg.body == new_msg.body, (old_msg.body, new_msg.body)
        assert list(old_msg.tensors) == list(new_msg.tensors)
        assert all(torch.equal(t, new_msg.tensors[k]) for k, t in old_msg.tensors.items())
        times: dict[str, list[float]] = {"today": [], "msgspec": [], "msgspec-struct": []}
        fns = {"today": lambda f=frames: decode(f), "msgspec": lambda f=frames: new(f),
               "msgspec-struct": lambda f=frames: struct_only(f)}
        for r in range(repeats):  # interleaved, rotating which goes first
            order = list(fns)[r % 3:] + list(fns)[:r % 3]
            for key in order:
                times[key] += _time(fns[key], number, 1)
        rows.append(HeaderTiming(name, len(frames[0]), len(frames) - 1,
                                 *(Timing.of_seconds(times[k]) for k in
                                   ("today", "msgspec", "msgspec-struct"))))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m paramserver.benchmarks.codec",
                                 description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--number", type=int, default=2000, help="decodes per repeat")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 50 decodes, 3 repeats (the figures mean little)")
    args = ap.parse_args(argv)
    number, repeats = (50, 3) if args.quick else (args.number, args.repeats)
    try:
        rows = measure(number, repeats)
    except ImportError:
        raise SystemExit("needs msgspec: pip install msgspec") from None
    print(f"protocol {PROTOCOL_VERSION}; us per decode, median [min-max] over {repeats} "
          f"repeats of {number}")
    print("| header | header bytes | tensors | today | msgspec (same Message) "
          "| msgspec struct only | today / msgspec |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [t.cell() for t in (r.today, r.msgspec, r.struct_only)]
        ratio = r.today.median_us / r.msgspec.median_us
        print(f"| {r.header} | {r.bytes} | {r.tensors} | {' | '.join(cells)} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
