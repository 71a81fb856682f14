"""Packed frames (protocol version 2): several tensors of one dtype in one frame.

Pure protocol tests, no sockets: what encode packs (and what it leaves in frames
of their own), that the views decode exactly, and that every malformed packed
descriptor is refused with the code a malformed single frame gets.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire import frames as wire_frames
from paramserver.wire.protocol import (
    PACK_BYTES,
    PROTOCOL_VERSION,
    Limits,
    Message,
    Op,
    PreparedTensors,
    decode,
    encode,
)

PUSH = {"worker": 3, "push_id": 9, "clock": 4, "read_version": 17, "num_samples": 32}


def _descs(frames: list[Any]) -> list[Any]:
    return list(msgpack.unpackb(bytes(frames[0]))["t"])


def test_small_tensors_share_one_frame_per_dtype_and_large_ones_keep_their_own() -> None:
    big = torch.randn(PACK_BYTES // 4)  # at the limit: a frame of its own, no copy
    tensors = {"a": torch.randn(3, 4), "h": torch.randn(5, dtype=torch.float64),
               "b": torch.randn(7), "big": big, "e": torch.zeros(0, 2),
               "i": torch.arange(4, dtype=torch.int64), "j": torch.arange(2, dtype=torch.int64)}
    frames = encode(Message(Op.PUSH, 1, PUSH, tensors))
    descs = _descs(frames)
    assert descs[0] == ["float32", [["a", [3, 4], 0], ["b", [7], 48], ["e", [0, 2], 76]]]
    assert descs[1] == ["big", "float32", [PACK_BYTES // 4]]
    assert descs[2] == ["h", "float64", [5]]  # alone in its dtype: the plain form
    assert descs[3] == ["int64", [["i", [4], 0], ["j", [2], 32]]]
    assert len(frames) == 5
    big[0] = 123.0  # the large tensor's frame is a view, not a copy
    got = decode([bytes(f) for f in frames]).tensors
    assert got["big"][0] == 123.0
    assert set(got) == set(tensors)
    for key, t in tensors.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape
        assert torch.equal(got[key], t)


def test_slices_of_one_buffer_go_as_that_buffer_without_a_copy() -> None:
    flat = torch.zeros(300_000)  # over PACK_BYTES: only sent as it is, never copied
    weights = {"s0": flat[:100_000], "s1": flat[100_000:250_000].view(1000, 150),
               "s2": flat[250_000:]}
    for frames in (encode(Message(Op.REPLY, 1, {"re": "pull"}, weights)),
                   encode(Message(Op.REPLY, 1, {"re": "pull"}, weights),
                          PreparedTensors(weights))):
        assert len(frames) == 2 and _descs(frames)[0][0] == "float32"
        flat[250_000] = 5.0
        got = decode(frames).tensors
        assert got["s2"][0] == 5.0 and got["s1"].shape == (1000, 150)
        # one buffer under every view: the receiver made one frombuffer
        assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    # a parameter's chunks lie back to back in its gradient: one frame, whatever else
    grad = torch.randn(200_000)
    chunks = {"w[0]": grad[:100_000], "w[1]": grad[100_000:], "b": torch.randn(100_000)}
    frames = encode(Message(Op.PUSH, 1, PUSH, chunks))
    assert [d[0] for d in _descs(frames)] == ["float32", "b"]


def test_a_packed_frame_stays_under_the_frame_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """zmq drops a peer whose frame passes the receiver's size limit: packing must not
    build one (a shard's flat buffer, or many small tensors, over the cap)."""
    monkeypatch.setattr(wire_frames, "MAX_PACKED_BYTES", 64)
    flat = torch.arange(40, dtype=torch.float32)
    views = {f"s{i}": flat[i * 8:(i + 1) * 8] for i in range(5)}  # 32 bytes each
    apart = {f"a{i}": torch.full((8,), float(i)) for i in range(5)}
    for tensors in (views, apart):
        frames = encode(Message(Op.INIT, 1, {"worker": 0}, tensors))
        assert [len(bytes(f)) for f in frames[1:]] == [64, 64, 32]
        got = decode([bytes(f) for f in frames]).tensors
        assert all(torch.equal(got[k], t) for k, t in tensors.items())


def test_a_gradient_packed_in_slice_order_decodes_as_consecutive_views() -> None:
    """The shard joins a push's slices by viewing them (paramserver/util/flat.py) when they
    are consecutive ranges of one buffer: a packed frame decodes to exactly that."""
    grads = {f"p{i}": torch.randn(128) for i in range(8)}
    got = decode(encode(Message(Op.PUSH, 1, PUSH, grads))).tensors
    first = got["p0"]
    for i, t in enumerate(got.values()):
        assert t.storage_offset() == first.storage_offset() + 128 * i
        assert t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def _packed(entries: Any, *data: bytes, dtype: Any = "float32", extra: Any = ()) -> list[bytes]:
    header = {"v": PROTOCOL_VERSION, "op": "push", "seq": 1, "f": PUSH,
              "t": [[dtype, entries], *extra]}
    return [msgpack.packb(header), *data]


F4 = torch.arange(4, dtype=torch.float32).numpy().tobytes()  # 16 bytes
F2 = F4[:8]


def test_a_well_formed_packed_frame_decodes() -> None:
    got = decode(_packed([["a", [2], 0], ["b", [1, 2], 8]], F4)).tensors
    assert got["a"].tolist() == [0.0, 1.0] and got["b"].tolist() == [[2.0, 3.0]]


@pytest.mark.parametrize(("frames", "code"), [
    (_packed([["a", [2], 0], ["b", [2], 4]], F4), ErrorCode.BAD_TENSOR),  # overlap
    (_packed([["a", [2], 0], ["b", [1], 12]], F4), ErrorCode.BAD_TENSOR),  # a gap
    (_packed([["a", [2], 0], ["b", [3], 8]], F4), ErrorCode.BAD_TENSOR),  # past the end
    (_packed([["a", [2], 0], ["b", [1], 8]], F4), ErrorCode.BAD_TENSOR),  # bytes left over
    (_packed([["a", [2], 0], ["b", [2], 8]], F4 + b"\0"), ErrorCode.BAD_TENSOR),
    (_packed([["a", [2], 8], ["b", [2], 0]], F4), ErrorCode.BAD_TENSOR),  # out of order
    (_packed([["a", [2], 0], ["a", [2], 8]], F4), ErrorCode.BAD_TENSOR),  # key twice
    (_packed([["a", [2], 0]], F2, F2, extra=[["a", "float32", [2]]]), ErrorCode.BAD_TENSOR),
    (_packed([["a", [2], 0], ["b", [2], True]], F4), ErrorCode.BAD_TENSOR),  # bool offset
    (_packed([["a", [2], 0], ["b", [2], 8.0]], F4), ErrorCode.BAD_TENSOR),
    (_packed([["a", [2], -8], ["b", [2], 0]], F4), ErrorCode.BAD_TENSOR),
    (_packed([["a", [2], 0], ["b", [-2], 8]], F4), ErrorCode.BAD_TENSOR),  # bad shape
    (_packed([["a", [2], 0], ["b", [2, True], 8]], F4), ErrorCode.BAD_TENSOR),
    (_packed([["a", [2], 0], ["b", [1 << 61, 1 << 61], 8]], F4), ErrorCode.BAD_TENSOR),
    (_packed([["a", [2], 0], ["b", 2, 8]], F4), ErrorCode.BAD_TENSOR),
    # empty, but torch's strides for it would overflow (the frame form too, below)
    (_packed([["a", [0, 1 << 61, 1 << 61], 0]], b""), ErrorCode.BAD_TENSOR),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "op": "push", "seq": 1, "f": PUSH,
                     "t": [["a", "float32", [0, 1 << 61, 1 << 61]]]}), b""],
     ErrorCode.BAD_TENSOR),
    (_packed([["a", [2], 0], ["", [2], 8]], F4), ErrorCode.BAD_TENSOR),  # empty key
    (_packed([["a", [2], 0], [7, [2], 8]], F4), ErrorCode.BAD_TENSOR),
    (_packed([["a", [2], 0], ["b", [2]]], F4), ErrorCode.BAD_TENSOR),  # no offset
    (_packed([["a", [2], 0], "b"], F4), ErrorCode.BAD_TENSOR),
    (_packed([], b""), ErrorCode.BAD_TENSOR),  # an empty packed frame
    (_packed({"a": 1}, F4), ErrorCode.BAD_TENSOR),
    (_packed([["a", [4], 0]], F4, dtype="object"), ErrorCode.BAD_TENSOR),
    (_packed([["a", [4], 0]], F4, dtype=None), ErrorCode.BAD_TENSOR),
    (_packed([["a", [4], 0]]), ErrorCode.BAD_MESSAGE),  # its frame missing
    (_packed([["a", [4], 0]], F4, F4), ErrorCode.BAD_MESSAGE),  # a frame too many
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_packed_frames_are_refused_with_a_code(frames: list[bytes],
                                                         code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.code == code


def test_packed_frames_count_against_the_limits() -> None:
    entries = [["a", [2], 0], ["b", [2], 8]]
    for limits in (Limits(max_tensors=1), Limits(max_tensor_bytes=4),
                   Limits(max_total_bytes=12)):
        with pytest.raises(ProtocolError) as err:
            decode(_packed(entries, F4), limits)
        assert err.value.code == ErrorCode.TOO_LARGE
    # a packed frame plus a frame of its own over the tensor count
    both = _packed(entries, F4, F2, extra=[["c", "float32", [2]]])
    assert len(decode(both).tensors) == 3
    with pytest.raises(ProtocolError) as err:
        decode(both, Limits(max_tensors=2))
    assert err.value.code == ErrorCode.TOO_LARGE


def test_version_1_peers_are_refused_by_version() -> None:
    """Version 1 framed every tensor alone; a peer of it is told so, not misread."""
    header = {"v": 1, "op": "push", "seq": 1, "f": PUSH, "t": [["g", "float32", [2]]]}
    with pytest.raises(ProtocolError) as err:
        decode([msgpack.packb(header), F2])
    assert err.value.code == ErrorCode.PROTOCOL_VERSION
