"""Compressed pulls without sockets (core/pullsqueeze.py, workers/pullcopy.py): the
worker's copy follows the shard's reconstruction bit for bit through the wire's
encoding, what a pull leaves out goes with the next, a lost answer is answered again,
a worker without its copy gets the reconstruction whole, the reconstructions survive a
checkpoint, a joining replica's snapshot and resharding, and a hostile answer is
refused at the worker with its copy unchanged."""

from __future__ import annotations

import dataclasses
import itertools
import json

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from paramserver.compress import parse_compression
from paramserver.core.pullsqueeze import PullAnswer, PullSqueeze
from paramserver.core.reshard import reshard
from paramserver.core.shard import ShardCore
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import ConfigError, ProtocolError
from paramserver.server.config import ServerConfig
from paramserver.wire.protocol import Message, Op, decode, encode, weights_reply_fields
from paramserver.workers.pullcopy import PullCopies
from tests.test_reshard import Run, _plan

SHAPES = {"w": (40, 30), "b": (30,)}


def _plan1() -> ShardPlan:
    return ShardPlan([ParamSpec(n, s, "float32") for n, s in SHAPES.items()], 1)


def _wire(ans: PullAnswer, seq: int = 1) -> Message:
    """The answer as a shard sends it, through the wire's encoding and decoding."""
    fields = weights_reply_fields(ans.version, 0, 0.0, msgspec.UNSET)
    fields.update(squeeze=ans.count, **({"delta": True} if ans.delta else {}))
    frames = encode(Message(Op.REPLY, seq, fields, ans.tensors))
    return decode([bytes(f) for f in frames])


def _setup(spec: str = "topk:ratio=0.1"
           ) -> tuple[ShardPlan, PullSqueeze, PullCopies, dict[str, torch.Tensor],
                      dict[str, torch.Tensor]]:
    plan = _plan1()
    gen = torch.Generator().manual_seed(0)
    weights = {sl.key: torch.randn(sl.numel, generator=gen) for sl in plan.shard_slices(0)}
    copies = PullCopies(plan)
    copies.enable(0, True)
    squeeze = PullSqueeze(parse_compression(spec), copies.specs[0])
    model = {n: torch.zeros(s) for n, s in SHAPES.items()}
    return plan, squeeze, copies, weights, model


_VERSIONS = itertools.count(1)


def _pull(squeeze: PullSqueeze, copies: PullCopies, weights: dict[str, torch.Tensor],
          model: dict[str, torch.Tensor], worker: int = 0, version: int | None = None
          ) -> PullAnswer:
    """A pull answered at ``version`` (default: a new one each time), landed."""
    squeeze.ask(worker, copies.base(0))
    ans = squeeze.answer(worker, weights, next(_VERSIONS) if version is None else version)
    assert ans is not None
    copies.land(model, 0, _wire(ans))
    return ans


def test_the_copy_follows_the_reconstruction_and_what_is_left_out_comes_next() -> None:
    _, squeeze, copies, weights, model = _setup()
    first = _pull(squeeze, copies, weights, model)
    assert not first.delta and copies.base(0) == 1  # a new worker: the dense weights
    gen = torch.Generator().manual_seed(1)
    dense_bytes = sum(t.numel() * 4 for t in weights.values())
    for _ in range(20):
        for t in weights.values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.01)
        ans = _pull(squeeze, copies, weights, model)
        assert ans.delta and ans.nbytes < dense_bytes / 6  # top-k 10 %: 6 bytes a value
        held = squeeze.held[0]
        assert all(torch.equal(copies.held[0][k], held[k]) for k in held)  # bit for bit
        for n, t in model.items():
            assert torch.equal(t.reshape(-1), held[n])
    gap = max(float((weights[k] - squeeze.held[0][k]).abs().max()) for k in weights)
    for _ in range(40):  # the weights stand still: what was left out arrives
        _pull(squeeze, copies, weights, model)
    after = max(float((weights[k] - squeeze.held[0][k]).abs().max()) for k in weights)
    assert gap > 1e-3 and after < 1e-6
    count = copies.base(0)
    same = _pull(squeeze, copies, weights, model, version=10**6)
    assert same.delta and same.tensors and copies.base(0) == count + 1
    still = _pull(squeeze, copies, weights, model, version=10**6)  # at the same weights:
    assert still.delta and not still.tensors and copies.base(0) == count + 1  # nothing


def test_a_lost_answer_is_sent_again_and_a_stranger_gets_the_reconstruction() -> None:
    _, squeeze, copies, weights, model = _setup("int8")
    _pull(squeeze, copies, weights, model)
    weights["w"].mul_(1.5)
    squeeze.ask(0, copies.base(0))
    lost = squeeze.answer(0, weights, 2)  # never reached the worker
    assert lost is not None and lost.delta
    weights["w"].mul_(1.5)  # (async: the weights moved on meanwhile)
    squeeze.ask(0, copies.base(0))
    again = squeeze.answer(0, weights, 3)
    assert again is lost  # the same answer, at its version
    copies.land(model, 0, _wire(again))
    assert copies.base(0) == squeeze.counts[0] == 2
    squeeze.ask(0, -1)  # a restarted worker (or a resumed run's): it holds no copy
    before = {k: t.clone() for k, t in squeeze.held[0].items()}
    whole = squeeze.answer(0, weights, 3)  # the reconstruction, moved on by this change
    assert whole is not None and not whole.delta and whole.count == 3
    assert all(torch.equal(whole.tensors[k], squeeze.held[0][k]) for k in before)
    assert not all(torch.equal(before[k], squeeze.held[0][k]) for k in before)
    assert not all(torch.equal(weights[k], squeeze.held[0][k]) for k in before)
    squeeze.ask(0, None)  # a plain pull (an old worker): no state moves
    assert squeeze.answer(0, weights, 3) is None and squeeze.counts[0] == 3


def test_hostile_answers_are_refused_and_the_copy_stays() -> None:
    _, squeeze, copies, weights, model = _setup()
    _pull(squeeze, copies, weights, model)
    before = {k: t.clone() for k, t in copies.held[0].items()}
    squeeze.ask(0, copies.base(0))
    ans = squeeze.answer(0, weights, 2)
    assert ans is not None
    bad = [dataclasses.replace(ans, count=ans.count + 5),  # a change to a copy it lacks
           dataclasses.replace(ans, tensors={k: t for k, t in ans.tensors.items()
                                             if not k.startswith("b")}),  # a slice missing
           dataclasses.replace(ans, tensors={**ans.tensors,  # counts that lie
                                             "w#c": torch.tensor([10_000], dtype=torch.int32)}),
           dataclasses.replace(ans, tensors={**ans.tensors, "x#v": ans.tensors["w#v"]})]
    for hostile in bad:
        with pytest.raises(ProtocolError):
            copies.land(model, 0, _wire(hostile))
        assert all(torch.equal(before[k], copies.held[0][k]) for k in before)


def _core(spec: str) -> ShardCore:
    plan = _plan1()
    core = ServerConfig(mode="async", pull_compression=spec).new_core(plan)
    core.register(0, "inc0", now=0.0)
    gen = torch.Generator().manual_seed(2)
    core.initialize({sl.key: torch.randn(sl.numel, generator=gen)
                     for sl in plan.shard_slices(0)})
    return core


def test_the_reconstructions_survive_a_checkpoint(tmp_path) -> None:
    core = _core("topk:ratio=0.05")
    assert core.squeeze is not None
    for step in range(3):
        core.squeeze.ask(0, -1 if step == 0 else core.squeeze.counts[0])
        core.squeeze.answer(0, core.params, core.version)
        core.push(0, step, step, core.version, 4,
                  {k: torch.ones_like(p) for k, p in core.params.items()}, now=0.0)
    tensors, meta = core.state_dict()
    assert meta["pull_counts"] == {"0": [3, core.version - 1]}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "t.st"))
    resumed = _core("topk:ratio=0.05")
    resumed.load_state_dict(load_file(str(tmp_path / "t.st")),
                            json.loads(json.dumps(meta)), now=0.0)
    assert resumed.squeeze is not None
    for c in (core, resumed):
        assert c.squeeze is not None
        c.squeeze.ask(0, 3)
    a = core.squeeze.answer(0, core.params, core.version)
    b = resumed.squeeze.answer(0, resumed.params, resumed.version)
    assert a is not None and b is not None and a.delta and b.delta
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    meta["pull_counts"] = {"0": [0, 1]}
    with pytest.raises(ConfigError, match="pull_counts"):
        resumed.load_state_dict(tensors, meta, now=0.0)


def test_reshard_moves_each_reconstruction_with_its_slices() -> None:
    run = Run(_plan(2), "sgd").start().step(1)
    for core in run.cores:
        core.squeeze = PullSqueeze(parse_compression("int8"), core.specs, core.config.shard)
        core.squeeze.ask(1, -1)
        core.squeeze.answer(1, core.params, core.version)
    states = run.states()
    three = reshard(states, 3)
    new = _plan(3)
    for k, (tensors, meta) in enumerate(three):
        assert meta["pull_counts"] == {"1": [1, 1]}
        for sl in new.shard_slices(k):
            old = states[run.plan.slice_for(sl.key).shard][0]
            assert torch.equal(tensors[f"pull/1/{sl.key}"], old[f"pull/1/{sl.key}"])
    states[0][1]["pull_counts"] = {"1": [2, 1]}  # counted apart: dropped (whole next)
    assert all("pull_counts" not in m and not any(n.startswith("pull/") for n in t)
               for t, m in reshard(states, 3))


def test_the_option_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="ef=0 has no meaning"):
        ServerConfig(pull_compression="sign:ef=0")
    with pytest.raises(Exception, match="nope"):
        ServerConfig(pull_compression="nope")
    assert ServerConfig(pull_compression="none").new_core(_plan1()).squeeze is None
    with pytest.raises(ProtocolError, match="base must be >= -1"):
        decode([bytes(f) for f in encode(Message(Op.PULL, 1, {"worker": 0, "clock": 0,
                                                              "base": -2}))])


def test_an_experiment_axis_compresses_both_ways() -> None:
    """``--compression PUSH/PULL`` (experiment, simulate): the workers' push compression
    and the shards' pull compression; a bad half is refused in one line."""
    from paramserver.workers.experiments.spec import ExperimentSpec

    spec = ExperimentSpec(compressions=["none", "int8", "int8/topk:ratio=0.01"], workers=[2],
                          seeds=1)
    got = {(r.config.compression, (c := spec.cluster_spec(r.config, 0)).worker.compression,
            c.server.pull_compression) for r in spec.runs()}
    assert got == {("none", None, None), ("int8", "int8", None),
                   ("int8/topk:ratio=0.01", "int8", "topk:ratio=0.01")}
    with pytest.raises(ConfigError, match="ef=0 has no meaning"):
        ExperimentSpec(compressions=["int8/sign:ef=0"])


def test_a_joining_replica_takes_the_reconstructions_bit_for_bit() -> None:
    """A primary's snapshot (core/transfer.py) carries each worker's reconstruction and
    count: the replica's next compressed answer is the primary's, to the bit."""
    from paramserver.core.transfer import CoreImage, export, restore

    core = _core("int8")
    assert core.squeeze is not None
    core.squeeze.ask(0, -1)
    core.squeeze.answer(0, core.params, core.version)
    core.push(0, 0, 0, core.version, 4, {k: torch.ones_like(p) for k, p in core.params.items()},
              now=0.0)
    image, tensors = export(core)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(image), type=CoreImage)
    replica = ServerConfig(mode="async", pull_compression="int8").new_core(_plan1())
    restore(replica, wire, {k: v.clone() for k, v in tensors.items()})
    answers = []
    for c in (core, replica):
        assert c.squeeze is not None and c.squeeze.counts == {0: 1}
        c.squeeze.ask(0, 1)
        answers.append(c.squeeze.answer(0, c.params, c.version))
    a, b = answers
    assert a is not None and b is not None and a.delta and b.delta
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
