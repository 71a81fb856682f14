"""SmallShare (paramserver/wire/lanes.py): a small model's push packed and its pull landed
in a few calls, to the byte what the general path does, and None or False (the
general path) for anything else."""

from __future__ import annotations

import msgpack
import pytest
import torch

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import ProtocolError
from paramserver.wire.frames import DEFAULT_LIMITS, Limits
from paramserver.wire.lanes import SmallShare
from paramserver.wire.protocol import PACK_BYTES, Message, Op, decode, encode

SHAPES = [(3, 4), (7,), (2, 2, 2), (5,)]


def _plan(shapes: list[tuple[int, ...]] = SHAPES, shards: int = 1,
          dtypes: list[str] | None = None, chunk_bytes: int = ShardPlan.DEFAULT_CHUNK_BYTES
          ) -> ShardPlan:
    dtypes = dtypes or ["float32"] * len(shapes)
    return ShardPlan([ParamSpec(f"p{i}", s, d) for i, (s, d) in
                      enumerate(zip(shapes, dtypes, strict=True))], shards, chunk_bytes)


def _grads(plan: ShardPlan, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # made one by one: not back to back in one buffer
    return {p.name: torch.randn(p.shape, generator=g) for p in plan.params}


def _push(tensors: dict[str, torch.Tensor] | None = None, prepared: object = None) -> Message:
    return Message(Op.PUSH, 9, {"worker": 1, "push_id": 3, "clock": 2, "num_samples": 4,
                                "read_version": 5}, tensors or {}, prepared)  # type: ignore


def test_a_push_packed_by_the_share_is_the_general_paths_bytes() -> None:
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None
    grads = _grads(plan)
    general = [bytes(f) for f in encode(_push(plan.split_tensors(grads)[0]))]
    packed = share.pack(grads)
    assert packed is not None
    lane = [bytes(f) for f in encode(_push(prepared=packed))]
    assert lane == general
    assert _push(prepared=packed).nbytes == sum(t.nbytes for t in grads.values())
    got = decode(lane)
    for name, g in grads.items():
        assert torch.equal(got.tensors[name].view(g.shape), g)


def test_each_shard_of_a_spread_small_model_has_its_share() -> None:
    plan = _plan([(8,)] * 8, shards=4)
    grads = _grads(plan)
    for shard in range(4):
        share = SmallShare.of(plan, shard)
        assert share is not None
        packed = share.pack(grads)
        assert packed is not None
        general = [bytes(f) for f in encode(_push(plan.split_tensors(grads)[shard]))]
        assert [bytes(f) for f in encode(_push(prepared=packed))] == general


@pytest.mark.parametrize("shape", [(16,), (4, 5)])
def test_a_shard_of_one_tensor_sends_it_in_a_frame_of_its_own(shape: tuple[int, ...]) -> None:
    plan = _plan([shape])
    share = SmallShare.of(plan, 0)
    assert share is not None
    grads = _grads(plan)
    packed = share.pack(grads)
    assert packed is not None
    general = [bytes(f) for f in encode(_push(plan.split_tensors(grads)[0]))]
    assert [bytes(f) for f in encode(_push(prepared=packed))] == general
    weights = _grads(plan, seed=3)
    params = {"p0": torch.zeros(shape)}
    assert share.land(params, _reply(plan, weights).tensors)
    assert torch.equal(params["p0"], weights["p0"])


@pytest.mark.parametrize("plan", [
    _plan([(4,), (4,)], dtypes=["float32", "float64"]),  # two dtypes
    _plan([(PACK_BYTES // 4,), (4,)]),  # a tensor too large to pack
    _plan([(64,), (64,)], chunk_bytes=128),  # parameters split into chunks
    _plan([(15_000,)] * 70),  # each small, but more than one packed frame holds
], ids=["two-dtypes", "too-large", "chunked", "over-a-frame"])
def test_no_share_where_the_general_path_packs_otherwise(plan: ShardPlan) -> None:
    assert SmallShare.of(plan, 0) is None


def test_pack_leaves_what_it_cannot_take_to_the_general_path() -> None:
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None
    good = _grads(plan)
    assert share.pack({k: v for k, v in good.items() if k != "p1"}) is None  # missing
    assert share.pack({**good, "p0": torch.zeros(4, 3)}) is None  # other shape
    assert share.pack({**good, "p1": torch.zeros(7, dtype=torch.float64)}) is None
    assert share.pack({**good, "p1": torch.zeros(7, device="meta")}) is None  # not CPU


def test_pack_takes_non_contiguous_and_grad_requiring_tensors() -> None:
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None
    grads = _grads(plan)
    grads["p0"] = torch.randn(4, 3).t()  # non-contiguous, shape (3, 4)
    grads["p1"] = torch.randn(7, requires_grad=True)
    packed = share.pack(grads)
    assert packed is not None
    got = decode([bytes(f) for f in encode(_push(prepared=packed))])
    for name, g in grads.items():
        assert torch.equal(got.tensors[name].view(g.shape), g.detach())


def _reply(plan: ShardPlan, values: dict[str, torch.Tensor]) -> Message:
    """A shard's pull reply as a worker decodes it: one packed frame of 1-D slices."""
    flat = torch.cat([values[p.name].reshape(-1) for p in plan.params])
    views = dict(zip([p.name for p in plan.params],
                     flat.split([p.numel for p in plan.params]), strict=True))
    frames = [bytes(f) for f in encode(Message(Op.REPLY, 1, {"re": "pull"}, views))]
    return decode(frames)


def test_land_copies_a_reply_into_the_parameters_bit_for_bit() -> None:
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None
    weights = _grads(plan, seed=1)
    params = {p.name: torch.nn.Parameter(torch.zeros(p.shape)) for p in plan.params}
    assert share.land(params, _reply(plan, weights).tensors)
    for name, w in weights.items():
        assert torch.equal(params[name].detach(), w)


def test_land_refuses_without_copying_what_is_not_its_share() -> None:
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None
    rep = _reply(plan, _grads(plan, seed=2))

    def fresh() -> dict[str, torch.Tensor]:
        return {p.name: torch.zeros(p.shape) for p in plan.params}

    reordered = dict(reversed(list(rep.tensors.items())))
    cases = {
        "keys in another order": (fresh(), reordered),
        "a key missing": (fresh(), {k: v for k, v in rep.tensors.items() if k != "p2"}),
        "a parameter of another dtype": ({**fresh(), "p1": torch.zeros(7, dtype=torch.float64)},
                                         rep.tensors),
        "a non-contiguous parameter": ({**fresh(), "p0": torch.zeros(4, 3).t()}, rep.tensors),
        "a parameter of another shape": ({**fresh(), "p3": torch.zeros(6)}, rep.tensors),
    }
    for what, (params, tensors) in cases.items():
        before = {k: v.clone() for k, v in params.items()}
        assert not share.land(params, tensors), what
        for k, v in params.items():
            assert torch.equal(v, before[k]), what


def test_a_scalar_parameter_travels_as_one_element() -> None:
    plan = _plan([(), (3,)])
    share = SmallShare.of(plan, 0)
    assert share is not None
    grads = {"p0": torch.tensor(2.5), "p1": torch.tensor([1.0, 2.0, 3.0])}
    packed = share.pack(grads)
    assert packed is not None
    general = [bytes(f) for f in encode(_push(plan.split_tensors(grads)[0]))]
    assert [bytes(f) for f in encode(_push(prepared=packed))] == general
    params = {"p0": torch.tensor(0.0), "p1": torch.zeros(3)}
    assert share.land(params, _reply(plan, grads).tensors)
    assert params["p0"].item() == 2.5 and torch.equal(params["p1"], grads["p1"])


def test_a_pushs_buffer_is_reused_and_holds_each_pushs_gradients() -> None:
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None and share.frame is not None
    for seed in (3, 4):
        grads = _grads(plan, seed=seed)
        packed = share.pack(grads)
        assert packed is share.prepared  # no new buffer, view or frame per push
        general = [bytes(f) for f in encode(_push(plan.split_tensors(grads)[0]))]
        assert [bytes(f) for f in encode(_push(prepared=packed))] == general


_OUTCOME = {"accepted": True, "weight": 1.0, "reason": "", "staleness": 2, "version": 8,
            "applied": True, "duplicate": False}


def _weights_reply(plan: ShardPlan, fields: dict[str, object], seq: int = 7,
                   values: dict[str, torch.Tensor] | None = None) -> list[bytes]:
    """A shard's reply carrying weights, as it sends them: its flat buffer's slices."""
    values = values or _grads(plan, seed=5)
    flat = torch.cat([values[p.name].reshape(-1) for p in plan.params])
    views = dict(zip([p.name for p in plan.params],
                     flat.split([p.numel for p in plan.params]), strict=True))
    return [bytes(f) for f in encode(Message(Op.REPLY, seq, fields, views))]


def _same(a: Message, b: Message) -> None:
    assert (a.op, a.seq, a.body) == (b.op, b.seq, b.body)
    assert list(a.tensors) == list(b.tensors)
    for k, t in a.tensors.items():
        assert t.dtype == b.tensors[k].dtype and torch.equal(t, b.tensors[k])


def test_the_reader_reads_weight_replies_as_the_general_decoder_does() -> None:
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None
    read = share.reader(DEFAULT_LIMITS)
    assert read is not None
    for fields in ({"re": "push", "version": 8, "clock": 3, "waited": 0.5, "push": _OUTCOME},
                   {"re": "push", "version": 8, "clock": 3, "waited": 0.5, "push": None},
                   {"re": "pull", "version": 8, "clock": 3, "waited": 0.0},
                   # an int where a float goes, as the general decoder takes it
                   {"re": "push", "version": 8, "clock": 3, "waited": 1,
                    "push": {**_OUTCOME, "weight": 1}},
                   {"re": "pull", "version": 8, "clock": 3}):  # waited: 0.0 by default
        frames = _weights_reply(plan, fields)
        got = read(frames)
        assert got is not None, fields
        _same(got, decode(frames))


def test_the_reader_leaves_every_other_reply_to_the_general_decoder() -> None:
    """A reply of any other form, or of a field of another type, is not the reader's:
    the general decoder reads it or refuses it, with its error code."""
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None
    read = share.reader(DEFAULT_LIMITS)
    assert read is not None
    good = {"re": "push", "version": 8, "clock": 3, "waited": 0.5, "push": _OUTCOME}
    other = _plan([(12,), (8,), (7,), (5,)])  # as many bytes, other slices
    cases: dict[str, list[bytes]] = {
        "a refusal": [bytes(f) for f in encode(Message(Op.ERROR, 7, {
            "code": "bad_field", "reason": "no"}))],
        "a push's outcome alone": [bytes(f) for f in encode(Message(Op.REPLY, 7, {
            "re": "push", **_OUTCOME}))],
        "HELLO's answer": _weights_reply(plan, {"re": "hello", "version": 1}),
        "a ticket to the board": _weights_reply(plan, {**good, "shm": {"nbytes": 4}}),
        "early weights": _weights_reply(plan, {**good, "early": 2}),
        "an outcome field of another type": _weights_reply(plan, {
            **good, "push": {**_OUTCOME, "accepted": 1}}),
        "an outcome field more": _weights_reply(plan, {**good, "push": {**_OUTCOME, "x": 1}}),
        "a version that is a bool": _weights_reply(plan, {**good, "version": True}),
        "a pull's reply with an outcome": _weights_reply(plan, {**good, "re": "pull"}),
        "another layout": _weights_reply(other, good),
        "a frame more": [*_weights_reply(plan, good), b"\x00" * 4],
        "a frame short": [*_weights_reply(plan, good)[:1], b"\x00" * 4],
    }
    frames = _weights_reply(plan, good)
    header = msgpack.unpackb(frames[0])
    for key, value in (("v", 1), ("v", True), ("op", "push"), ("seq", -1), ("seq", 1 << 62),
                       ("x", 1)):
        cases[f"header {key}={value!r}"] = [
            msgpack.packb({**header, key: value}, use_bin_type=True), frames[1]]
    for what, case in cases.items():
        assert read(case) is None, what  # (then the general decoder reads or refuses it)
    assert read(frames) is not None
    # limits the layout is over: no reader; a header over them: not read
    assert share.reader(Limits(max_tensors=3)) is None
    assert share.reader(Limits(max_key_len=1)) is None
    tight = share.reader(Limits(max_header_bytes=len(frames[0]) - 1))
    assert tight is not None and tight(frames) is None
    with pytest.raises(ProtocolError):
        decode(frames, Limits(max_header_bytes=len(frames[0]) - 1))


def test_a_clients_channels_read_with_their_shares_readers() -> None:
    from paramserver.workers.client import PSClient

    small = PSClient(["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"], _plan(shards=2), 0,
                     heartbeat_interval=0, shm=False)
    wide = PSClient(["tcp://127.0.0.1:9"], _plan(), 0, heartbeat_interval=0, shm=False,
                    wire_dtype="bfloat16")  # narrowed gradients: the general path
    try:
        assert all(ch.reader is not None for ch in small.channels)
        assert wide.channels[0].reader is None
    finally:
        small.close()
        wide.close()


def test_land_follows_parameters_replaced_between_rounds() -> None:
    """A landing reuses its flat views of the parameters only while each is the same
    tensor at the same address: a parameter or its .data replaced, reshaped, made
    non-contiguous or of another dtype since is landed into afresh or refused."""
    plan = _plan()
    share = SmallShare.of(plan, 0)
    assert share is not None
    params = {p.name: torch.nn.Parameter(torch.zeros(p.shape)) for p in plan.params}

    def lands(seed: int) -> dict[str, torch.Tensor]:
        weights = _grads(plan, seed=seed)
        assert share.land(params, _reply(plan, weights).tensors)
        for name, w in weights.items():
            assert torch.equal(params[name].detach(), w), name
        return weights

    lands(1)
    lands(2)  # (the views of the first landing)
    old = params["p0"]
    params["p0"] = torch.nn.Parameter(torch.zeros(3, 4))  # another tensor
    before = old.detach().clone()
    lands(3)
    assert torch.equal(old.detach(), before)  # the replaced one is left alone
    with torch.no_grad():
        params["p2"].data = torch.zeros(2, 2, 2)  # the same tensor, new memory
    lands(4)
    refused = {
        "reshaped": torch.zeros(4, 2),
        "non-contiguous": torch.zeros(4, 3).t(),
        "another dtype, same memory": params["p0"].detach().view(torch.int32),
        "another dtype": torch.zeros(3, 4, dtype=torch.float64),
    }
    for what, data in refused.items():
        p = params["p0"] if what != "reshaped" else params["p2"]
        saved = p.data
        p.requires_grad_(False)  # (.data of an integer dtype needs it)
        p.data = data
        snapshot = {k: v.detach().clone() for k, v in params.items()}
        assert not share.land(params, _reply(plan, _grads(plan, seed=5)).tensors), what
        for k, v in params.items():
            assert torch.equal(v.detach(), snapshot[k]), what
        p.data = saved
        p.requires_grad_(True)
    lands(6)
