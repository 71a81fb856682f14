"""decode_request (paramserver/wire/requests.py): a worker's PUSH of a known layout and
its PULL read by one typed decode, to the field what the general decoder reads, and
everything else left to the general decoder, which reads it or refuses it with its
error code. A hostile peer gets nothing through the typed decode that the general
decoder refuses."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire.frames import DEFAULT_LIMITS, INT_BOUND, Limits
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op, decode, encode
from paramserver.wire.requests import _read, decode_request

_FIELDS = {"worker": 1, "push_id": 3, "clock": 2, "num_samples": 4, "read_version": 5}


def _grads(shapes: list[tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}


def _frames(fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
            op: Op = Op.PUSH, seq: int = 9) -> list[bytes]:
    """What a worker sends: encode's frames (a small push: one packed frame)."""
    return [bytes(f) for f in encode(Message(op, seq, fields, tensors or {}))]


def _pack_map(pairs: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map of ``pairs`` as given (a key may come twice)."""
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
    return head + b"".join(msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True)
                           for k, v in pairs)


def _raw_header(pairs: list[tuple[str, Any]], f: bytes | None = None,
                t: bytes | None = None) -> bytes:
    """A header of ``pairs`` with "f" and "t" given as their msgpack bytes, if given."""
    raw = {"f": f, "t": t}
    return bytes([0x80 | len(pairs)]) + b"".join(
        msgpack.packb(k) + (raw[k] if raw.get(k) is not None else msgpack.packb(v))  # type: ignore[operator]
        for k, v in pairs)


def _same(a: Message, b: Message) -> None:
    # (by repr: a NaN loss equal to itself, 1 and 1.0 told apart)
    assert (a.op, a.seq, repr(a.fields), repr(a.body)) == (b.op, b.seq, repr(b.fields),
                                                           repr(b.body))
    assert list(a.tensors) == list(b.tensors)
    for k, t in a.tensors.items():
        u = b.tensors[k]
        assert (t.dtype, t.shape) == (u.dtype, u.shape) and torch.equal(t, u)


def _check(frames: list[bytes], limits: Limits = DEFAULT_LIMITS) -> str | None:
    """The typed decode either reads ``frames`` as the general decoder does or leaves
    them to it; a refusal is the general decoder's, with its code (returned)."""
    fast = _read(frames, limits)
    try:
        general = decode(frames, limits)
    except ProtocolError as exc:
        assert fast is None, f"the typed decode took what the general one refuses: {exc}"
        with pytest.raises(ProtocolError) as caught:
            decode_request(frames, limits)
        assert caught.value.code == exc.code
        return exc.code
    if fast is not None:
        _same(fast, general)
    _same(decode_request(frames, limits), general)
    return None


SHAPES = [[(16,)] * 8, [(3, 4), (7,), (2, 2, 2), (5,)], [(32,)], [(4, 5)]]


@pytest.mark.parametrize("shapes", SHAPES)
def test_a_workers_push_is_read_as_the_general_decoder_reads_it(
        shapes: list[tuple[int, ...]]) -> None:
    grads = _grads(shapes)
    decode(_frames(_FIELDS, grads))  # its layout checked once, by the general decoder
    for fields in (_FIELDS, {**_FIELDS, "pull": True}, {**_FIELDS, "pull": False},
                   {**_FIELDS, "loss": 0.25, "pull": True}, {**_FIELDS, "loss": 3},
                   {**_FIELDS, "loss": float("nan")}, {**_FIELDS, "loss": -1e300},
                   {**_FIELDS, "worker": 0, "push_id": 0, "clock": 0, "read_version": 0,
                    "num_samples": 1},
                   {k: INT_BOUND - 1 for k in _FIELDS}):
        for seq in (0, 9, INT_BOUND - 1):
            frames = _frames(fields, _grads(shapes, seed=seq % 7), seq=seq)
            assert _read(frames, DEFAULT_LIMITS) is not None, fields
            assert _check(frames) is None


def test_a_pull_is_read_as_the_general_decoder_reads_it() -> None:
    for fields in ({"worker": 1, "clock": 2}, {"worker": 0, "clock": 0, "observer": True},
                   {"worker": 1, "clock": 2, "observer": False, "wait_init": True}):
        frames = _frames(fields, op=Op.PULL)
        assert _read(frames, DEFAULT_LIMITS) is not None, fields
        assert _check(frames) is None


_BAD_INTS: list[Any] = [True, False, 1.0, -1, INT_BOUND, -INT_BOUND, 1 << 63, "1", None, [1]]


def test_every_hostile_field_is_refused_with_the_general_code_or_left_to_it() -> None:
    grads = _grads(SHAPES[0])
    decode(_frames(_FIELDS, grads))
    codes: dict[str, str | None] = {}
    for name in _FIELDS:
        for bad in _BAD_INTS:
            codes[f"{name}={bad!r}"] = _check(_frames({**_FIELDS, name: bad}, grads))
        codes[f"no {name}"] = _check(_frames(
            {k: v for k, v in _FIELDS.items() if k != name}, grads))
    codes["num_samples=0"] = _check(_frames({**_FIELDS, "num_samples": 0}, grads))
    for name, bad in (("loss", None), ("loss", True), ("loss", "0.5"), ("pull", 1),
                      ("pull", None), ("pull", "yes"), ("x", 1), ("part", 0),
                      ("parts", 2), ("shm", []), ("via_shm", True), ("early", True)):
        codes[f"{name}={bad!r}"] = _check(_frames({**_FIELDS, name: bad}, grads))
    for name in ("worker", "clock"):
        for bad in _BAD_INTS:
            codes[f"pull {name}={bad!r}"] = _check(_frames(
                {"worker": 1, "clock": 2, name: bad}, op=Op.PULL))
    for name, bad in (("observer", 1), ("wait_init", None), ("via_shm", True), ("x", 1)):
        codes[f"pull {name}={bad!r}"] = _check(_frames(
            {"worker": 1, "clock": 2, name: bad}, op=Op.PULL))
    # the general decoder's refusals stay its own, code for code
    assert codes["worker=True"] == codes["worker=1.0"] == ErrorCode.BAD_FIELD
    assert codes["worker=-1"] == codes[f"clock={INT_BOUND}"] == ErrorCode.BAD_FIELD
    assert codes["no push_id"] == codes["num_samples=0"] == ErrorCode.BAD_FIELD
    assert codes["loss=None"] == codes["pull=1"] == ErrorCode.BAD_FIELD
    assert codes["pull clock=-1"] == codes["pull worker=True"] == ErrorCode.BAD_FIELD
    # and what it takes that the typed decode does not, it reads itself
    assert codes["loss=True"] is codes["x=1"] is codes["pull x=1"] is None


def test_every_hostile_header_is_refused_with_the_general_code_or_left_to_it() -> None:
    grads = _grads(SHAPES[1])
    good = _frames({**_FIELDS, "pull": True}, grads)
    decode(good)
    data = good[1]
    header = msgpack.unpackb(good[0])
    pairs = list(header.items())
    codes: dict[str, str | None] = {}
    for key, value in (("v", 1), ("v", True), ("v", 2.0), ("v", "2"), ("op", "pusher"),
                       ("op", "reply"), ("op", "heartbeat"), ("op", None), ("seq", -1),
                       ("seq", INT_BOUND), ("seq", True), ("seq", 1.0), ("f", []),
                       ("f", None), ("t", {}), ("t", None), ("t", []), ("x", 1)):
        codes[f"{key}={value!r}"] = _check([msgpack.packb({**header, key: value}), data])
    for key in header:
        codes[f"no {key}"] = _check([msgpack.packb(
            {k: v for k, v in header.items() if k != key}), data])
    # a key twice (both decoders read the last), in the header and in the fields
    codes["op twice"] = _check([_pack_map([*pairs, ("op", "pull")]), data])
    codes["v twice"] = _check([_pack_map([("v", 1), *pairs]), data])
    f = list(header["f"].items())
    codes["worker twice"] = _check([_raw_header(pairs, _pack_map([*f, ("worker", -1)])), data])
    codes["worker twice, good last"] = _check([_raw_header(pairs, _pack_map(
        [("worker", -1), *f])), data])
    twice = [(k, {"worker": -1, **v} if k == "f" else v) for k, v in pairs]
    codes["f's worker first"] = _check([_pack_map(twice), data])
    # a map over the general decoder's 4096 pairs, of one key again and again
    # (a layout of its own, checked under these limits: the typed decode would take it)
    wide = Limits(max_header_bytes=1 << 16)
    wide_frames = _frames(_FIELDS, _grads([(6,), (10,)]))
    decode(wide_frames, wide)
    assert _read(wide_frames, wide) is not None
    wide_pairs = list(msgpack.unpackb(wide_frames[0]).items())
    long_f = _pack_map([*f, *[("clock", 2)] * (5000 - len(f))])
    codes["a map of 5000 pairs"] = _check([_raw_header(wide_pairs, long_f), wide_frames[1]],
                                          wide)
    long_head = _pack_map([*[("seq", 1)] * (5000 - 5), *wide_pairs])
    codes["a header of 5000 pairs"] = _check([long_head, wide_frames[1]], wide)
    # frames, bytes and limits
    codes["a frame more"] = _check([*good, data])
    codes["a frame short"] = _check(good[:1])
    codes["no frames"] = _check([])
    codes["an empty header"] = _check([b"", data])
    codes["a byte short"] = _check([good[0], data[:-1]])
    codes["a byte more"] = _check([good[0], data + b"\x00"])
    codes["not msgpack"] = _check([b"\xc1" + good[0][1:], data])
    codes["trailing bytes"] = _check([good[0] + b"\x00", data])
    codes["cut short"] = _check([good[0][:-1], data])
    codes["over the header limit"] = _check(good, Limits(max_header_bytes=len(good[0]) - 1))
    codes["over the tensor count"] = _check(good, Limits(max_tensors=3))
    codes["over the total bytes"] = _check(good, Limits(max_total_bytes=len(data) - 1))
    codes["another layout"] = _check(_frames(_FIELDS, _grads([(12,), (8,), (7,), (5,)])))
    assert codes["v=1"] == codes["v=True"] == codes["v=2.0"] == ErrorCode.PROTOCOL_VERSION
    assert codes["v twice"] is None  # (the last: 2)
    assert codes["op='pusher'"] == codes["op=None"] == ErrorCode.UNKNOWN_OP
    assert codes["seq=-1"] == codes["seq=True"] == codes["f=[]"] == ErrorCode.BAD_HEADER
    assert codes["not msgpack"] == codes["trailing bytes"] == ErrorCode.BAD_HEADER
    assert codes["an empty header"] == ErrorCode.BAD_HEADER
    assert codes["a map of 5000 pairs"] == codes["a header of 5000 pairs"] == ErrorCode.BAD_HEADER
    assert codes["a frame more"] == codes["a frame short"] == ErrorCode.BAD_MESSAGE
    assert codes["a byte short"] == ErrorCode.BAD_TENSOR
    assert codes["over the header limit"] == codes["over the tensor count"] == ErrorCode.TOO_LARGE
    assert codes["f's worker first"] is None  # (read as the last, 1)
    assert codes["worker twice"] == ErrorCode.BAD_FIELD  # (read as the last, -1)
    assert codes["worker twice, good last"] is None


def test_a_deeply_nested_descriptor_is_left_to_the_general_decoder() -> None:
    head = _raw_header([("v", PROTOCOL_VERSION), ("op", "push"), ("seq", 1), ("f", _FIELDS),
                        ("t", None)], None, b"\x91" * 50_000 + b"\x90")
    assert _check([head, b""], Limits(max_header_bytes=1 << 20)) == ErrorCode.BAD_HEADER


def test_a_server_decodes_its_requests_with_the_typed_decode() -> None:
    from paramserver.server import loop

    assert loop.decode_request is decode_request
