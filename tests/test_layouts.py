"""The packed-layout cache of decode (paramserver/wire/layouts.py): a layout checked once
gives the same tensors again without the per-entry checks, and nothing it keeps
lets a message through that the full check refuses."""

from __future__ import annotations

import msgpack
import pytest
import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire import frames, protocol
from paramserver.wire.layouts import LayoutCache
from paramserver.wire.protocol import PROTOCOL_VERSION, Limits, Message, Op, decode, encode


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> LayoutCache:
    cache = LayoutCache()
    monkeypatch.setattr(frames, "_LAYOUTS", cache)
    return cache


def _push(tensors: dict[str, torch.Tensor], push_id: int = 1) -> list[bytes]:
    msg = Message(Op.PUSH, push_id, {"worker": 0, "push_id": push_id, "clock": 0,
                                     "num_samples": 1, "read_version": 0}, tensors)
    return [bytes(f) for f in encode(msg)]


def _tensors(shapes: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    # separate tensors (not back to back): encode packs them into one frame
    return {f"w{i}": torch.arange(float(torch.Size(s).numel())).reshape(s) + i
            for i, s in enumerate(shapes)}


def _header(frames: list[bytes]) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(header: dict, frames: list[bytes]) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


@pytest.mark.parametrize("shapes", [[(128,)] * 8, [(3, 4), (5,), (2, 0, 3), (1, 1, 2)]])
def test_a_second_decode_gives_the_same_tensors_without_the_full_check(
        shapes: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _tensors(shapes)
    first = decode(_push(sent, 1))

    def full_check(*args: object) -> int:
        raise AssertionError("the full check ran for a layout it had passed")

    monkeypatch.setattr(frames, "_unpack", full_check)
    second = decode(_push(sent, 2))
    assert second.seq == 2 and second["push_id"] == 2
    assert list(second.tensors) == list(first.tensors) == list(sent)
    for key, t in sent.items():
        assert second.tensors[key].shape == t.shape
        assert torch.equal(second.tensors[key], t)


def test_a_layout_of_other_keys_is_checked_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    decode(_push(_tensors([(4,), (4,)])))
    calls = []
    real = frames._unpack

    def counted(*args: object) -> int:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(frames, "_unpack", counted)
    other = {"a": torch.ones(4), "b": torch.ones(4)}
    assert list(decode(_push(other)).tensors) == ["a", "b"]
    assert calls == [1]


def _refused(frames: list[bytes], limits: Limits = protocol.DEFAULT_LIMITS) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits)
    return info.value.code


@pytest.mark.parametrize("bad", [0.0, True])
def test_an_offset_equal_in_value_but_not_an_integer_is_still_refused(bad: object) -> None:
    frames = _push(_tensors([(4,), (4,)]))
    decode(frames)  # the good layout is cached now
    header = _header(frames)
    header["t"][0][1][0][2] = bad  # the first entry's offset, 0, as 0.0 or true
    assert _refused(_with_header(header, frames)) == ErrorCode.BAD_TENSOR


def test_a_shape_equal_in_value_but_of_floats_is_still_refused() -> None:
    frames = _push(_tensors([(4,), (4,)]))
    decode(frames)
    header = _header(frames)
    header["t"][0][1][1][1] = [4.0]
    assert _refused(_with_header(header, frames)) == ErrorCode.BAD_TENSOR


def test_a_frame_of_another_length_gets_the_full_checks_verdict() -> None:
    frames = _push(_tensors([(4,), (4,)]))
    decode(frames)
    short = [frames[0], frames[1][:-4]]
    assert _refused(short) == ErrorCode.BAD_TENSOR


def test_tighter_limits_still_hold_for_a_cached_layout() -> None:
    frames = _push(_tensors([(64,), (64,)]))
    decode(frames)
    assert _refused(frames, Limits(max_total_bytes=256)) == ErrorCode.TOO_LARGE
    assert _refused(frames, Limits(max_tensor_bytes=128)) == ErrorCode.TOO_LARGE
    assert _refused(frames, Limits(max_tensors=1)) == ErrorCode.TOO_LARGE
    assert _refused(frames, Limits(max_key_len=1)) == ErrorCode.BAD_TENSOR


def _pack(*pairs: tuple[str, object]) -> bytes:
    """A msgpack map written pair by pair (repeated keys kept, as a peer may send)."""
    out = bytes([0x80 | len(pairs)])
    for key, value in pairs:
        out += msgpack.packb(key) + msgpack.packb(value, use_bin_type=True)
    return out


def _float_descriptor(frames: list[bytes]) -> tuple[dict, list]:
    good = _header(frames)
    bad_t = msgpack.unpackb(msgpack.packb(good["t"]), raw=False)
    bad_t[0][1][0][2] = 0.0
    return good, bad_t


def test_the_checked_bytes_ending_another_field_do_not_stand_in_for_the_descriptor() -> None:
    """A header that ends with a checked descriptor's bytes, as a value nested in
    "f", while its own "t" (earlier) has a float offset: refused."""
    frames = _push(_tensors([(4,), (4,)]))
    decode(frames)
    good, bad_t = _float_descriptor(frames)
    for nested in ("note", "t"):
        head = _pack(("v", PROTOCOL_VERSION), ("op", "push"), ("seq", 1), ("t", bad_t),
                     ("f", {**good["f"], nested: good["t"]}))
        assert head.endswith(msgpack.packb(good["t"], use_bin_type=True))
        assert _refused([head, frames[1]]) == ErrorCode.BAD_TENSOR


def test_a_repeated_key_does_not_put_the_checked_bytes_last() -> None:
    """Five keys, "t" last in the decoded map, but a repeated "f" ends the bytes."""
    frames = _push(_tensors([(4,), (4,)]))
    decode(frames)
    good, bad_t = _float_descriptor(frames)
    head = _pack(("v", PROTOCOL_VERSION), ("op", "push"), ("seq", 1), ("f", good["f"]),
                 ("t", bad_t), ("f", {**good["f"], "note": good["t"]}))
    assert list(msgpack.unpackb(head, raw=False))[-1] == "t"
    assert _refused([head, frames[1]]) == ErrorCode.BAD_TENSOR


def test_the_cache_stays_bounded(fresh_cache: LayoutCache) -> None:
    for n in range(1, 3 * LayoutCache.SIZES):
        decode(_push({"a": torch.ones(n), "b": torch.ones(1)}))
    sizes = fresh_cache._by_size
    assert len(sizes) <= LayoutCache.SIZES
    assert all(len(v) <= LayoutCache.PER_SIZE for v in sizes.values())
