"""Membership rules of the pure core (issue 29, items 3, 12, 15); no sockets, time is an
argument: a full worker table, a silent member of a sync round or an SSP gate, and
two processes with one worker id."""

from __future__ import annotations

import pytest
import torch

from paramserver.core.membership import IN_USE_BEATS, ROUND_TIMEOUT_BEATS, ROUND_TIMEOUT_STEPS
from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.errors import ConfigError, ErrorCode, ProtocolError

SLICES = [SliceSpec("w", 8, "float32")]
G = {"w": torch.ones(8)}


def _core(mode: str = "async", bound: int = 0, **cfg: object) -> ShardCore:
    spec = ModeSpec(mode, staleness_bound=bound)
    return ShardCore(SLICES, CoreConfig(mode=spec, **cfg))  # type: ignore[arg-type]


def _code(exc: pytest.ExceptionInfo[ProtocolError]) -> str:
    return exc.value.code


# ---------------------------------------------------------------- item 3: the table


@pytest.mark.parametrize("sign", ["init", "heartbeat"])
def test_a_worker_that_spoke_after_hello_is_never_evicted_by_a_flood(sign: str) -> None:
    core = _core(max_workers=4, heartbeat_timeout=10.0)
    core.register(0, "real", 0.0)
    if sign == "init":
        core.initialize_part(0, G)  # INIT, not pulled yet: the window of the defect
    else:
        core.heartbeat(0, 0.5)
        core.initialize({"w": torch.zeros(8)})
    for i in range(1, 5000):
        core.register(i, f"f{i}", 1.0 + i * 1e-3)  # bare HELLOs: these evict each other
    assert 0 in core.workers and len(core.workers) == 4
    assert core.workers_evicted == 4999 - 3
    core.request_pull(0, 0, "t", 6.0)  # not refused not_registered
    assert [r.worker for r in core.ready_pulls(6.0)] == [0]


def test_a_table_of_live_workers_refuses_newcomers_too_many_workers() -> None:
    core = _core(max_workers=2, heartbeat_timeout=10.0)
    for w in (0, 1):
        core.register(w, f"i{w}", 0.0)
        core.heartbeat(w, 0.1)
    with pytest.raises(ProtocolError) as exc:
        core.register(2, "new", 1.0)
    assert _code(exc) == ErrorCode.TOO_MANY_WORKERS
    assert "2 of 2" in exc.value.reason and set(core.workers) == {0, 1}
    # one that went quiet past the heartbeat timeout is dead: it makes room
    core.heartbeat(0, 11.0)
    assert core.expire(11.5) == [1]
    core.register(2, "new", 22.0)
    assert set(core.workers) == {0, 2}


# ---------------------------------------------------------------- item 12: deadlines


def test_round_timeout_is_validated() -> None:
    with pytest.raises(ConfigError, match="round timeout"):
        CoreConfig(round_timeout=-1.0)


def test_a_silent_member_is_left_out_of_a_sync_round_at_the_deadline_and_rejoins() -> None:
    core = _core("sync", expected_workers=2, round_timeout=5.0, heartbeat_timeout=100.0)
    core.register(0, "a", 0.0)
    core.register(1, "silent", 0.0)
    core.initialize_part(0, G)
    core.request_pull(1, 0, "s", 0.0)  # the silent one pulls once ...
    core.ready_pulls(0.0)
    out = core.push(0, 1, 0, 0, 1, G, 1.0)
    assert out is not None and not out.applied  # the round waits for worker 1
    for t in (2.0, 4.0, 5.9):
        core.heartbeat(1, t)  # ... and then only heartbeats
        assert core.leave_out(t) == []
    core.request_pull(0, 1, "p", 5.5)
    assert core.ready_pulls(5.5) == []  # worker 0's pull is held by the open round
    assert core.leave_out(6.5) == [1]  # 5.5 s past the round's first push
    assert core.version == 1 and core.left_out == {1}
    assert [r.worker for r in core.ready_pulls(6.5)] == [0]
    assert core.workers[1].live  # left out, not dead
    # the next round does not wait for it either
    out = core.push(0, 2, 1, 1, 1, G, 7.0)
    assert out is not None and out.applied and core.version == 2
    # its late push (read at version 0) is judged as any late push: dropped; it is back
    late = core.push(1, 1, 0, 0, 1, G, 8.0)
    assert late is not None and not late.accepted and late.reason == "late"
    assert core.left_out == set()
    core.push(0, 3, 2, 2, 1, G, 9.0)
    assert core.version == 2  # the round waits for worker 1 again
    out = core.push(1, 2, 2, 2, 1, G, 9.5)
    assert out is not None and out.applied and core.version == 3


def test_a_member_whose_push_is_arriving_in_parts_is_not_left_out() -> None:
    core = ShardCore([SliceSpec("a", 4, "float32"), SliceSpec("b", 4, "float32")],
                     CoreConfig(mode=ModeSpec("sync"), expected_workers=2, round_timeout=1.0))
    core.register(0, "a", 0.0)
    core.register(1, "b", 0.0)
    core.initialize({"a": torch.zeros(4), "b": torch.zeros(4)})
    whole = {"a": torch.ones(4), "b": torch.ones(4)}
    assert core.push(0, 1, 0, 0, 1, whole, 0.0) is not None
    assert core.push(1, 1, 0, 0, 1, {"a": torch.ones(4)}, 0.5, part=0, parts=2) is None
    assert core.leave_out(5.0) == []  # sending, not silent
    assert core.push(1, 1, 0, 0, 1, {"b": torch.ones(4)}, 5.0, part=1, parts=2) is not None
    assert core.version == 1


def test_an_ssp_gate_stops_waiting_for_a_silent_member_at_the_deadline() -> None:
    core = _core("ssp", bound=1, expected_workers=2, round_timeout=5.0,
                 heartbeat_timeout=100.0)
    core.register(0, "a", 0.0)
    core.register(1, "silent", 0.0)
    core.initialize_part(0, G)
    core.request_pull(1, 0, "s", 0.0)
    core.ready_pulls(0.0)
    for clock in (0, 1):
        core.request_pull(0, clock, f"p{clock}", 0.5)
        assert len(core.ready_pulls(0.5)) == 1
        core.push(0, clock + 1, clock, core.version, 1, G, 1.0)
    core.request_pull(0, 2, "p2", 1.0)
    assert core.ready_pulls(1.0) == []  # clock 2 - min clock 0 > bound 1
    core.heartbeat(1, 5.9)
    assert core.leave_out(5.9) == []  # the pull waited 4.9 s
    assert core.leave_out(6.1) == [1]
    assert core.min_clock() == 2
    assert [r.worker for r in core.ready_pulls(6.1)] == [0]
    # it pushes again: judged by the usual rules, and back at the others' minimum clock
    out = core.push(1, 1, 0, 0, 1, G, 7.0)
    assert out is not None and out.staleness == 2
    assert core.left_out == set() and core.workers[1].clock == 2  # worker 0's clock
    assert core.min_clock() == 2


def test_the_default_deadline_is_heartbeats_or_usual_steps_and_zero_waits_forever() -> None:
    core = _core("sync", heartbeat_timeout=2.0)
    assert core.round_deadline() == ROUND_TIMEOUT_BEATS * 2.0
    core.register(0, "a", 0.0)
    core.initialize_part(0, G)
    for i in range(6):  # one push every 3 s: the usual step
        core.push(0, i + 1, i, i, 1, G, 3.0 * i)
    assert core.round_deadline() == ROUND_TIMEOUT_STEPS * 3.0
    forever = _core("sync", expected_workers=2, round_timeout=0.0)
    forever.register(0, "a", 0.0)
    forever.register(1, "b", 0.0)
    forever.initialize_part(0, G)
    forever.push(0, 1, 0, 0, 1, G, 0.0)
    assert forever.leave_out(1e6) == [] and forever.version == 0


# ---------------------------------------------------------------- item 15: one rank, two


def test_a_second_live_process_with_a_rank_is_refused_for_good() -> None:
    core = _core(heartbeat_timeout=10.0)
    core.register(0, "first", 0.0, origin="pid 11 on hostA")
    with pytest.raises(ProtocolError) as exc:
        core.register(0, "second", 1.0, origin="pid 22 on hostB")
    assert _code(exc) == ErrorCode.DUPLICATE_WORKER  # it may be a restart: retry
    t = 1.0
    while t < 1.0 + IN_USE_BEATS * 10.0:
        core.heartbeat(0, t)  # the first one lives on
        with pytest.raises(ProtocolError) as exc:
            core.register(0, "second", t)
        assert _code(exc) == ErrorCode.DUPLICATE_WORKER
        t += 2.0
    core.heartbeat(0, t)
    with pytest.raises(ProtocolError) as exc:
        core.register(0, "second", t + 0.5)
    assert _code(exc) == ErrorCode.WORKER_IN_USE
    assert "rank 0 is already in use by a live worker (pid 11 on hostA)" in exc.value.reason
    assert core.workers[0].incarnation == "first"


def test_a_second_process_that_waits_the_first_out_is_refused() -> None:
    core = _core(heartbeat_timeout=10.0)
    core.register(0, "first", 0.0)
    with pytest.raises(ProtocolError):
        core.register(0, "second", 1.0)
    core.leave(0, 3.0)  # the first finished its work while the second waited
    with pytest.raises(ProtocolError) as exc:
        core.register(0, "second", 4.0)
    assert _code(exc) == ErrorCode.WORKER_IN_USE
    # a process that did not contend with it may take the finished rank over
    assert core.register(0, "third", 5.0).incarnation == "third"


@pytest.mark.parametrize("how", ["timeout", "reported"])
def test_a_restarted_worker_takes_over_from_its_dead_predecessor(how: str) -> None:
    core = _core(heartbeat_timeout=10.0)
    core.register(0, "old", 0.0)
    core.heartbeat(0, 5.0)  # its last sign of life: then it crashes
    if how == "reported":
        core.declare_dead(0)  # the launcher saw it exit
        assert core.register(0, "new", 6.0).incarnation == "new"
        return
    t = 6.0
    while True:  # the new one retries until the old one is quiet past the timeout
        try:
            state = core.register(0, "new", t)
            break
        except ProtocolError as exc:
            assert exc.code == ErrorCode.DUPLICATE_WORKER, exc
        t += 2.0
    assert state.incarnation == "new" and 15.0 < t <= 17.0


# ---------------------------------------------------------------- issue 43: final pulls


@pytest.mark.parametrize(("mode", "bound"), [("sync", 0), ("async", 0), ("ssp", 1)])
def test_a_final_pull_is_answered_once_every_expected_worker_is_done(mode: str,
                                                                      bound: int) -> None:
    """opt.final(): an observer's final pull waits for every expected worker to say BYE
    or be judged dead (Membership.holding), in every mode; an ordinary observer's pull
    is never gated, and the heartbeats of the worker that asked are told who is awaited."""
    core = _core(mode, bound, expected_workers=3, heartbeat_timeout=10.0)
    for w in (0, 1):
        core.register(w, f"i{w}", 0.0)
    core.initialize({"w": torch.zeros(8)})
    core.leave(0, 1.0)  # the evaluator is done: it says BYE, then asks for the final weights
    core.request_pull(0, 0, "final", 1.0, observer=True, final=True)
    core.request_pull(5, 0, "plain", 1.0, observer=True)
    assert [r.token for r in core.ready_pulls(1.0)] == ["plain"]
    held = core.pulls.held(0)
    assert held is not None and held.final  # what worker 0's heartbeats are told of
    assert core.holding(3) == [1, 2]  # 1 trains on, 2 never said HELLO
    core.register(2, "i2", 2.0)
    core.leave(1, 3.0)
    assert core.ready_pulls(3.0) == []  # worker 2 still trains
    assert core.expire(20.0) == [2]  # judged dead by the usual rule: no one is awaited
    assert [r.token for r in core.ready_pulls(20.0)] == ["final"]
    assert core.pulls.held(0) is None


def test_a_final_pull_is_an_observers() -> None:
    from paramserver.wire.protocol import Message, Op

    with pytest.raises(ProtocolError) as exc:
        Message(Op.PULL, 0, {"worker": 0, "clock": 0, "final": True}).body  # noqa: B018
    assert _code(exc) == ErrorCode.BAD_FIELD and "observer" in exc.value.reason
