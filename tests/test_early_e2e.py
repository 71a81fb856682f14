"""Weights returned before a round closes (issue 17, item 4), over real shard processes.

A lone worker's sync round is stepped ahead part by part (paramserver/core/ahead.py);
with ``early`` each part's answer brings that part's next weights, and the
round's answer only the rest. The weights must be exactly one SGD step either
way, and a round that does not make what came early (a later part not finite)
must leave the worker's weights as they were.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from paramserver.core.sharding import ShardPlan
from paramserver.errors import ProtocolError, RemoteError
from paramserver.wire.protocol import Message, Op
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from paramserver.workers.overlap import make_buckets
from paramserver.workers.pushstream import take_early
from tests.agent_shards import sync_shards

LR = 0.1


@pytest.fixture(scope="module")
def _shard_sets() -> Iterator[dict[int, list[str]]]:
    """Sync shards for one worker, 1 and 2 of them, in agent processes started once for
    the module (before any test's own guard looks for processes left behind): each
    test's session connects as worker 0 and says BYE, and the next one goes on from
    the version it reads (the counters checked are each test's own)."""
    with sync_shards(1, LR, "early1x") as one, sync_shards(2, LR, "early2x") as two:
        yield {1: one, 2: two}


@pytest.fixture
def shards(request: pytest.FixtureRequest, _shard_sets: dict[int, list[str]]) -> list[str]:
    """The module's sync shards (``parametrize`` the count)."""
    return _shard_sets[getattr(request, "param", 1)]


def _counters(addresses: list[str]) -> list[dict[str, int]]:
    return [dict(s.counters) for s in server_stats(addresses)]


def _since(before: list[dict[str, int]], stats: list, name: str) -> list[int]:
    """Each shard's counter ``name`` now, less what it was ``before``."""
    return [s.counters.get(name, 0) - b.get(name, 0) for s, b in zip(stats, before,
                                                                      strict=True)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 20),
                               torch.nn.Linear(20, 5))


def _steps(addresses: list[str], early: bool, steps: int = 4
           ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """``steps`` pushes in parts (one per tensor, answered one at a time, so each
    part finds the shard idle and the round is stepped ahead); checks each step."""
    model = _model()
    params = dict(model.named_parameters())
    plan = ShardPlan.from_module(model, len(addresses), chunk_bytes=1 << 10)
    buckets = make_buckets(list(params.items()), bucket_bytes=1)
    with PSClient(addresses, plan, 0, timeout=60, shm=False) as client:
        clock = client.connect()
        client.initialize(params)
        versions = client.pull(params, clock).versions
        start = versions[0]
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
            before = {n: p.detach().clone() for n, p in params.items()}
            stream = client.push_stream(buckets, versions, 1, clock + step, early=early)
            stream.window = 1  # each part waits for the answer to the one before
            for bucket in buckets:
                stream.send({n: grads[n] for n in bucket})
            pushed, pulled = stream.finish(params)
            assert pushed.accepted and pulled is not None
            assert pulled.versions == tuple([start + step + 1] * len(addresses))
            with torch.no_grad():
                for n, p in params.items():
                    torch.testing.assert_close(p, before[n].add(grads[n], alpha=-LR),
                                               rtol=0, atol=0)
            versions = pulled.versions
        stats = server_stats(addresses)
        client.bye()
    return {n: p.detach().clone() for n, p in params.items()}, stats


@pytest.mark.integration
@pytest.mark.parametrize("shards", [1, 2], indirect=True)
def test_early_weights_are_the_rounds_exactly(shards: list[str]) -> None:
    before = _counters(shards)
    _, stats = _steps(shards, early=True)
    # every part but the last came back with weights, and every answer took them in
    assert all(n > 0 for n in _since(before, stats, "early_parts")), stats
    assert _since(before, stats, "early_answers") == [4] * len(shards), stats
    counted = _since(before, stats, "early_parts")
    # the same shards, 4 rounds on (each step checked exact again), nothing early
    _, stats = _steps(shards, early=False)
    assert _since(before, stats, "early_parts") == counted
    assert _since(before, stats, "early_answers") == [4] * len(shards)


@pytest.mark.integration
def test_a_void_round_leaves_the_early_weights_unused(shards: list[str]) -> None:
    """A later part that is not finite voids the round after earlier parts came back
    with next weights: the worker's weights stay those of the version it read."""
    model = _model()
    params = dict(model.named_parameters())
    plan = ShardPlan.from_module(model, 1, chunk_bytes=1 << 10)
    buckets = make_buckets(list(params.items()), bucket_bytes=1)
    before_counts = _counters(shards)
    with PSClient(shards, plan, 0, timeout=60, shm=False) as client:
        clock = client.connect()
        client.initialize(params)
        versions = client.pull(params, clock).versions
        before = {n: p.detach().clone() for n, p in params.items()}
        grads = {n: torch.ones_like(p) for n, p in params.items()}
        grads[buckets[-1][0]] = torch.full_like(params[buckets[-1][0]], float("nan"))
        stream = client.push_stream(buckets, versions, 1, clock)
        stream.window = 1
        for bucket in buckets:
            stream.send({n: grads[n] for n in bucket})
        with pytest.raises(RemoteError, match="NaN"):
            stream.finish(params)
        # weights did come back early
        assert _since(before_counts, server_stats(shards), "early_parts")[0] >= 1
        for n, p in params.items():
            assert torch.equal(p, before[n]), n
        # and the shard's weights are the same: nothing was stepped
        fresh = {n: torch.zeros_like(p) for n, p in params.items()}
        assert client.pull(fresh, clock).versions == versions
        for n, p in fresh.items():
            assert torch.equal(p, before[n]), n
        client.bye()


_OUTCOME = {"accepted": True, "weight": 1.0, "reason": "", "staleness": 0, "version": 5,
            "applied": True, "duplicate": False}


def _answer(tensors: dict[str, torch.Tensor], **fields) -> Message:
    """The answer to a push's last part that asked for the weights (its outcome in it)."""
    return Message(Op.REPLY, 1, {"re": "push", "push": _OUTCOME, **fields}, tensors)


def _part(tensors: dict[str, torch.Tensor], **fields) -> Message:
    """The answer to an earlier part."""
    return Message(Op.REPLY, 1, {"re": "push", "partial": True, **fields}, tensors)


def test_take_early_merges_only_what_adds_up() -> None:
    a, b, c = torch.ones(2), torch.zeros(3), torch.full((1,), 2.0)
    keys = ["a", "b", "c"]
    final = _answer({"c": c}, version=5, early=2)
    assert take_early(final, [_part({"a": a}, early=5), _part({"b": b}, early=5)], keys)
    assert list(final.tensors) == ["a", "b", "c"]
    # no "early" in the answer: it holds every key, whatever came with the parts
    whole = _answer({"a": a, "b": b, "c": c}, version=5)
    assert take_early(whole, [_part({"a": torch.zeros(2)}, early=5)], keys)
    assert torch.equal(whole.tensors["a"], a)
    refused = [
        # a part's weights for another version
        (_answer({"c": c}, version=5, early=2), [_part({"a": a}, early=4),
                                                 _part({"b": b}, early=5)]),
        # fewer came than the answer counts
        (_answer({"c": c}, version=5, early=2), [_part({"a": a}, early=5)]),
        # the keys do not cover the shard
        (_answer({}, version=5, early=2), [_part({"a": a, "b": b}, early=5)]),
    ]
    for answer, partials in refused:
        assert not take_early(answer, partials, keys)
        assert "a" not in answer.tensors  # left as it was
    # a count that is not an int is refused where the reply is parsed, before any merge
    odd = _answer({"c": c}, version=5, early="2")
    with pytest.raises(ProtocolError, match="'early' must be int"):
        take_early(odd, [_part({"a": a, "b": b}, early=5)], keys)
    assert "a" not in odd.tensors  # left as it was


@pytest.mark.integration
def test_early_is_refused_unless_a_boolean(shards: list[str]) -> None:
    """A part whose "early" is not a boolean is refused whole (the shard counts it and
    serves on); the worker's next push goes through."""
    model = _model()
    params = dict(model.named_parameters())
    plan = ShardPlan.from_module(model, 1, chunk_bytes=1 << 10)  # the module's shards
    before = _counters(shards)
    with PSClient(shards, plan, 0, timeout=60, shm=False) as client:
        clock = client.connect()
        client.initialize(params)
        versions = client.pull(params, clock).versions
        bad = Message(Op.PUSH, 0, {"worker": 0, "push_id": 1, "clock": clock,
                                   "read_version": 0, "num_samples": 1, "part": 0,
                                   "parts": 2, "early": "yes"})
        bad.seq = client.channels[0].next_seq()
        client.channels[0].send(bad)
        grads = {n: torch.ones_like(p) for n, p in params.items()}
        # answered on the same connection after the bad part, so that one was handled
        pushed, _ = client.push_pull(grads, versions, 1, clock, params)
        assert pushed.accepted
        assert _since(before, server_stats(shards), "error_bad_field") == [1]
        client.bye()
