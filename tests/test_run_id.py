"""A run's identity, the pure parts (no sockets): the rule that keeps two runs apart
(core/membership.check_run), the wire's bounds on a run id, and what a worker says of
a shard that answers heartbeats, or another run's, or nothing (workers/liveness.py).
tests/test_run_id_e2e.py runs a shard of one run and a worker of another."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from paramserver.core.membership import check_run
from paramserver.errors import ErrorCode, ProtocolError, RequestTimeoutError, WrongRunError
from paramserver.wire.messages import MAX_RUN_ID, Heartbeat, Hello
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op, decode, encode
from paramserver.workers.liveness import Heartbeat as Beats
from paramserver.workers.liveness import Patience

A, B = "a" * 32, "b" * 32


def test_two_runs_never_mix_and_a_run_without_an_id_mixes_with_any() -> None:
    check_run(A, A, "worker 1", "shard 0")
    for own, theirs in ((None, A), (A, None), (None, None), ("", A)):
        check_run(own, theirs, "worker 1", "shard 0")  # by hand: as before run ids
    with pytest.raises(ProtocolError) as err:
        check_run(A, B, "worker 1", "this shard (0)")
    assert err.value.code is ErrorCode.WRONG_RUN
    assert A in err.value.reason and B in err.value.reason  # both named
    # the client's class for the code
    assert isinstance(WrongRunError.from_reply("shard 0", "wrong_run", "x"), WrongRunError)


def _hello(**extra: object) -> Message:
    fields = {"worker": 1, "role": "worker", "protocol": PROTOCOL_VERSION, "plan_hash": "h",
              "incarnation": "i", **extra}
    return decode(encode(Message(Op.HELLO, 1, fields)))


def test_hello_and_heartbeat_carry_a_bounded_run_id() -> None:
    hello = _hello(run=A).body
    assert isinstance(hello, Hello) and hello.run == A
    assert _hello().body.run is None  # an older worker, or one started by hand
    beat = decode(encode(Message(Op.HEARTBEAT, 2, {"worker": 1, "run": B}))).body
    assert isinstance(beat, Heartbeat) and beat.run == B
    for bad in ("", "x" * (MAX_RUN_ID + 1)):
        with pytest.raises(ProtocolError) as err:
            _hello(run=bad)
        assert err.value.code is ErrorCode.BAD_FIELD
    with pytest.raises(ProtocolError) as err:
        _hello(run=7)
    assert err.value.code is ErrorCode.BAD_FIELD


@dataclass
class _Client:
    """What Patience reads of a client (a Waiter)."""

    timeout: float = 60.0
    attempt_timeout: float = 5.0
    barrier_timeout: float = 0.0
    worker: int = 1
    channels: list[object] = field(default_factory=lambda: [_Where()])


@dataclass
class _Where:
    address: str = "tcp://127.0.0.1:5600"


def _judge(heard_ago: float | None, began_ago: float) -> Patience:
    beats = Beats(["tcp://127.0.0.1:5600"], 1, 1.0, None)  # not started: read only
    now = time.monotonic()
    beats.started = now - began_ago
    if heard_ago is not None:
        beats.last_reply[0] = now - heard_ago
        beats.held[0] = None
    return Patience(_Client(), beats, "PULL", [0], started=now - began_ago)  # type: ignore[arg-type]


def test_answers_heartbeats_is_said_only_of_a_shard_that_answered_them_lately() -> None:
    # the shard died 11 s after the request began: its last heartbeat answer is 50 s
    # old, the request 61 s, past the 60 s timeout. It answers nothing.
    with pytest.raises(RequestTimeoutError) as err:
        _judge(heard_ago=50.0, began_ago=61.0)([0])
    assert "answers heartbeats" not in str(err.value)
    assert "does not answer" in str(err.value) and "50s" in str(err.value)
    # alive: it answered a heartbeat a moment ago, and still not this request
    with pytest.raises(RequestTimeoutError) as err:
        _judge(heard_ago=0.5, began_ago=61.0)([0])
    assert "answers heartbeats" in str(err.value)
    # within its timeout the request is sent again
    assert _judge(heard_ago=0.5, began_ago=20.0)([0]) is True


def test_a_shard_of_another_run_ends_the_wait_at_once() -> None:
    judge = _judge(heard_ago=0.5, began_ago=6.0)
    judge.heartbeat.foreign[0] = WrongRunError("shard 0 at tcp://127.0.0.1:5600",
                                               ErrorCode.WRONG_RUN, f"run {A} vs {B}")
    with pytest.raises(WrongRunError):
        judge([0])
