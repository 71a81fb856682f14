"""Wire protocol: round trips of every op, and refusal of each kind of malformed input."""

from __future__ import annotations

import msgpack
import pytest
import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire.protocol import (
    PROTOCOL_VERSION,
    Limits,
    Message,
    Op,
    decode,
    encode,
    error_reply,
    reply,
)

FIELDS = {
    Op.HELLO: {"worker": 1, "role": "worker", "protocol": PROTOCOL_VERSION, "plan_hash": "ab",
               "plan": {"num_shards": 2}, "incarnation": "x"},
    Op.INIT: {"worker": 0},
    Op.PULL: {"worker": 2, "clock": 5, "observer": False},
    Op.PUSH: {"worker": 3, "push_id": 9, "clock": 4, "read_version": 17, "num_samples": 32},
    Op.HEARTBEAT: {"worker": 0},
    Op.BYE: {"worker": 0},
    Op.STATS: {},
    Op.CHECKPOINT: {"path": "/tmp/x"},
    Op.SHUTDOWN: {},
    Op.REPLY: {"re": "pull", "version": 3},
    Op.ERROR: {"code": "bad_field", "reason": "why"},
    Op.SPULL: {"worker": 1},
    Op.SPUSH: {"worker": 3, "push_id": 2, "clock": 1, "read_version": 4, "num_samples": 8},
    Op.SINIT: {"worker": 0, "part": 0, "parts": 2},
    Op.RESHARD: {"step": "commit", "epoch": 2, "shard": 0, "servers": ["tcp://a:1"]},
}


def roundtrip(msg: Message) -> Message:
    return decode([bytes(f) for f in encode(msg)])


@pytest.mark.parametrize("op", list(Op))
def test_every_op_round_trips(op):
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b[0:4]": torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.float64)}
    msg = Message(op, 42, dict(FIELDS[op]), tensors if op in (Op.INIT, Op.PUSH, Op.REPLY) else {})
    got = roundtrip(msg)
    assert got.op is op and got.seq == 42 and got.fields == msg.fields
    assert list(got.tensors) == list(msg.tensors)
    for k, t in msg.tensors.items():
        assert got.tensors[k].dtype == t.dtype and torch.equal(got.tensors[k], t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.int64, torch.uint8])
def test_dtypes_bit_exact(dtype):
    t = (torch.randn(33) * 100).to(dtype)
    got = roundtrip(Message(Op.INIT, 1, {"worker": 0}, {"t": t})).tensors["t"]
    assert got.dtype == dtype and torch.equal(got, t)


def test_frames_share_tensor_memory():
    t = torch.zeros(1024)
    frames = encode(Message(Op.INIT, 1, {"worker": 0}, {"t": t}))
    t[0] = 7.0  # encode made no copy: the frame sees the change
    assert decode(frames).tensors["t"][0] == 7.0


def test_reply_helpers():
    req = Message(Op.PULL, 5, FIELDS[Op.PULL])
    rep = reply(req, version=3)
    assert rep.seq == 5 and rep["re"] == "pull" and rep["version"] == 3
    err = roundtrip(error_reply(5, ErrorCode.BAD_FIELD, "x" * 5000))
    assert err.op is Op.ERROR and len(err["reason"]) == 2000


def _frames(header: dict, *data: bytes) -> list[bytes]:
    return [msgpack.packb(header), *data]


GOOD = {"v": PROTOCOL_VERSION, "op": "push", "seq": 1, "f": FIELDS[Op.PUSH],
        "t": [["g", "float32", [2]]]}
DATA = torch.ones(2).numpy().tobytes()


@pytest.mark.parametrize(("frames", "code"), [
    ([], ErrorCode.BAD_MESSAGE),
    ([b"\xc1garbage"], ErrorCode.BAD_HEADER),
    ([msgpack.packb([1, 2])], ErrorCode.BAD_HEADER),
    (_frames({**GOOD, "v": 99}, DATA), ErrorCode.PROTOCOL_VERSION),
    (_frames({**GOOD, "op": "explode"}, DATA), ErrorCode.UNKNOWN_OP),
    (_frames({**GOOD, "seq": -1}, DATA), ErrorCode.BAD_HEADER),
    (_frames({**GOOD, "f": {**FIELDS[Op.PUSH], "worker": "one"}}, DATA), ErrorCode.BAD_FIELD),
    (_frames({**GOOD, "f": {**FIELDS[Op.PUSH], "clock": True}}, DATA), ErrorCode.BAD_FIELD),
    (_frames({**GOOD, "f": {"worker": 1}}, DATA), ErrorCode.BAD_FIELD),
    (_frames({**GOOD, "f": {**FIELDS[Op.PUSH], "clock": 1 << 63}}, DATA), ErrorCode.BAD_FIELD),
    (_frames(GOOD), ErrorCode.BAD_MESSAGE),  # descriptor without its frame
    (_frames(GOOD, DATA, DATA), ErrorCode.BAD_MESSAGE),
    (_frames(GOOD, DATA[:-1]), ErrorCode.BAD_TENSOR),  # truncated frame
    (_frames({**GOOD, "t": [["g", "object", [2]]]}, DATA), ErrorCode.BAD_TENSOR),
    (_frames({**GOOD, "t": [["g", "float32", [-2]]]}, DATA), ErrorCode.BAD_TENSOR),
    (_frames({**GOOD, "t": [["", "float32", [2]]]}, DATA), ErrorCode.BAD_TENSOR),
    (_frames({**GOOD, "t": [["g", "float32"]]}, DATA), ErrorCode.BAD_TENSOR),
    (_frames({**GOOD, "t": [["g", "float32", [2]], ["g", "float32", [2]]]}, DATA, DATA),
     ErrorCode.BAD_TENSOR),
    (_frames({**GOOD, "t": "nope"}, DATA), ErrorCode.BAD_HEADER),
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_messages_are_refused_with_a_code(frames, code):
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.code == code


def test_size_limits():
    limits = Limits(max_header_bytes=64, max_tensor_bytes=4, max_tensors=1)
    with pytest.raises(ProtocolError) as err:
        decode([b"\x80" * 100], limits)
    assert err.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError) as err:
        decode(_frames(GOOD, DATA), Limits(max_tensor_bytes=4))
    assert err.value.code == ErrorCode.TOO_LARGE
    two = {**GOOD, "t": [["a", "float32", [2]], ["b", "float32", [2]]]}
    with pytest.raises(ProtocolError) as err:
        decode(_frames(two, DATA, DATA), Limits(max_tensors=1))
    assert err.value.code == ErrorCode.TOO_LARGE


def test_never_pickles():
    import pickle

    payload = pickle.dumps({"op": "push"})
    with pytest.raises(ProtocolError):
        decode([payload])


def test_prepared_tensors_encode_the_same_bytes_and_follow_the_weights() -> None:
    from paramserver.wire.protocol import PreparedTensors, usable

    flat = torch.arange(8, dtype=torch.float32)  # a shard's flat buffer: slices are views
    weights = {"a": flat[:6].view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
               "c": flat[6:6], "d": flat[6:8]}
    prepared = PreparedTensors(weights)
    assert len(prepared.frames) == 2  # one per dtype: the float32 buffer as it is
    for seq, fields in ((0, {"re": "pull", "version": 3}),
                        (2**40, {"re": "push", "push": {"accepted": True, "weight": 0.5}})):
        msg = Message(Op.REPLY, seq, fields, weights)
        plain, fast = encode(msg), encode(msg, prepared)
        assert [bytes(f) for f in fast] == [bytes(f) for f in plain]
        back = decode([bytes(f) for f in fast])
        assert back.fields == fields and torch.equal(back.tensors["a"], weights["a"])
    weights["a"].add_(1)  # written in place: the frames are views, the next reply shows it
    assert decode([bytes(f) for f in encode(Message(Op.REPLY, 1, {"re": "pull"}, weights),
                                            prepared)]).tensors["a"][0, 0] == 1
    moved = dict(weights, a=weights["a"].clone())  # copy-on-write: new storage
    assert not prepared.matches(moved)
    frames = encode(Message(Op.REPLY, 1, {"re": "pull"}, moved), prepared)
    assert frames[1] is not prepared.frames[0]  # encoded afresh, not from stale frames
    assert not usable({"t": torch.ones(4, 4).t()})  # a transposed view is no frame of itself
    apart = {"a": torch.zeros(3), "b": torch.zeros(2)}  # small, but not back to back
    prepared = PreparedTensors(apart)
    assert len(prepared.frames) == 2  # frames of their own: a packed copy would go stale
    apart["b"].add_(5)
    assert decode([bytes(f) for f in encode(Message(Op.REPLY, 1, {"re": "pull"}, apart),
                                            prepared)]).tensors["b"][1] == 5


_INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 62) - 1,
         (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -32, -33, -128, -129, -32768, -32769,
         -(1 << 31) - 1, -(1 << 63)]
_FLOATS = [0.0, -0.0, 1.5, 1e-310, 1e308, float("inf"), float("-inf"), float("nan"), 3]
_REASONS = ["", "stale", "x" * 31, "x" * 32, "é" * 20, "x" * 255, "x" * 256, "x" * 70000]


def test_a_weights_replys_header_is_encodes_to_the_byte() -> None:
    """The outbox's header of a weights reply (protocol.weights_reply_head) is the one
    encode makes of its fields, across values of every size msgpack tells apart."""
    import msgspec

    from paramserver.core.records import PushOutcome
    from paramserver.wire.protocol import PreparedTensors, weights_reply_head

    flat = torch.arange(24, dtype=torch.float32)
    prepared = PreparedTensors(dict(zip(["a", "b", "c"], flat.split([4, 8, 12]), strict=True)))

    def general(seq: int, version: int, clock: int, waited: float,
                outcome: PushOutcome | None) -> bytes:
        fields = {"re": "pull", "version": version, "clock": clock, "waited": waited}
        if outcome is not None:
            fields.update(re="push", push=outcome.as_dict())
        msg = Message(Op.REPLY, seq, fields, {})
        return bytes(encode(msg, prepared, matched=True)[0])

    cases = 0
    for i, n in enumerate(_INTS):
        waited = _FLOATS[i % len(_FLOATS)]
        reason = _REASONS[i % len(_REASONS)]
        for outcome in (None, PushOutcome(i % 2 == 0, waited, reason, n, n, i % 3 == 0,
                                          i % 5 == 0),
                        PushOutcome(True, 1, "", 0, n, True)):
            for seq, version, clock in ((n, 3, 4), (0, n, n), (max(n, 0), -n - 1, 7)):
                try:
                    want = general(seq, version, clock, waited, outcome)
                except (OverflowError, ValueError, TypeError):
                    with pytest.raises((OverflowError, ValueError, TypeError)):
                        weights_reply_head(seq, version, clock, waited, outcome or
                                           msgspec.UNSET, prepared.descs)
                    continue
                got = weights_reply_head(seq, version, clock, waited,
                                         msgspec.UNSET if outcome is None else outcome,
                                         prepared.descs)
                assert got == want, (seq, version, clock, waited, outcome)
                cases += 1
    assert cases > 150
    # and it decodes as the general decoder reads any reply
    head = weights_reply_head(7, 9, 2, 0.5, PushOutcome(True, 1.0, "", 0, 9, True),
                              prepared.descs)
    got = decode([head, *prepared.frames])
    assert got.body.push.version == 9 and got.body.answers_push
    assert torch.equal(got.tensors["c"], flat[12:])
