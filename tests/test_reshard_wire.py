"""A live reshard's messages are bounded at the wire (issue 47, item 2): RESHARD's steps
and fields, and the ``plan_moved`` ERROR's epoch and servers, refused when hostile."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paramserver.errors import ErrorCode, PlanMovedError, ProtocolError, RemoteError
from paramserver.server.elastic import META_TENSOR, decode_meta, encode_meta
from paramserver.wire.messages import MAX_PLAN_SERVERS, PlanMoved, Reshard
from paramserver.wire.protocol import Message, Op, decode, encode


def _roundtrip(op: Op, fields: dict[str, Any]) -> Any:
    return decode(encode(Message(op, 1, fields))).body


def test_a_reshard_step_reads_back_typed() -> None:
    body = _roundtrip(Op.RESHARD, {"step": "adopt", "epoch": 2, "shard": 1,
                                   "servers": ["tcp://a:1", "tcp://b:2"],
                                   "windows": {"3": 7}, "wait": 1.5})
    assert body == Reshard("adopt", -1, 2, 1, ("tcp://a:1", "tcp://b:2"), {3: 7}, 1.5)


@pytest.mark.parametrize("fields", [
    {"step": "explode"},
    {"step": "freeze", "at": -2},
    {"step": "freeze", "wait": 1e9},
    {"step": "freeze", "shard": MAX_PLAN_SERVERS},
    {"step": "adopt", "epoch": 1, "shard": 0},  # no servers
    {"step": "commit", "epoch": 0, "shard": 0, "servers": ["tcp://a:1"]},  # epoch 0
    {"step": "commit", "epoch": 1, "shard": 2, "servers": ["tcp://a:1"]},  # shard past them
    {"step": "adopt", "epoch": 1, "servers": ["x" * 300]},
    {"step": "adopt", "epoch": 1, "servers": ["tcp://a:1"] * (MAX_PLAN_SERVERS + 1)},
    {"step": "align", "windows": {"-1": 3}},
    {"step": "align", "windows": {"1": -3}},
    {"step": "align", "windows": {"w": 3}},
])
def test_hostile_reshard_fields_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as err:
        _roundtrip(Op.RESHARD, fields)
    assert err.value.code in (ErrorCode.BAD_FIELD, ErrorCode.BAD_HEADER)


def test_plan_moved_carries_the_new_plan_and_is_bounded() -> None:
    good = _roundtrip(Op.ERROR, {"code": "plan_moved", "reason": "moved",
                                 "moved": {"epoch": 3, "servers": ["tcp://a:1"]}})
    assert good.moved == PlanMoved(3, ("tcp://a:1",))
    assert isinstance(RemoteError.from_reply("p", "plan_moved", "r"), PlanMovedError)
    for moved in ({"epoch": -1, "servers": []}, {"epoch": 1, "servers": "tcp://a:1"},
                  {"epoch": 1, "servers": [1]}, {"servers": ["tcp://a:1"]}):
        with pytest.raises(ProtocolError):
            _roundtrip(Op.ERROR, {"code": "plan_moved", "reason": "r", "moved": moved})


def test_a_state_manifest_travels_as_a_bounded_tensor() -> None:
    meta = {"version": 3, "workers": {"0": {"clock": 2}}}
    tensors = {"param/w": torch.ones(2), META_TENSOR: encode_meta(meta)}
    assert decode_meta(tensors) == meta and list(tensors) == ["param/w"]
    for bad in ({}, {META_TENSOR: torch.ones(3)}, {META_TENSOR: encode_meta(meta)[:-2]},
                {META_TENSOR: torch.frombuffer(bytearray(b"[1, 2]"), dtype=torch.uint8)}):
        with pytest.raises(ProtocolError):
            decode_meta(dict(bad))
