"""The pure shard core: each mode's rules and the policy calls, with no sockets."""

from __future__ import annotations

import pytest
import torch

from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.policies import RejectPolicy

KEYS = [SliceSpec("w", 4, "float64"), SliceSpec("b", 2, "float64")]


def make_core(mode="async", workers=2, s=0, b=0, policy=None, lr=1.0, timeout=10.0):
    cfg = CoreConfig(mode=ModeSpec(mode, s, b), optimizer="sgd", optimizer_args={"lr": lr},
                     expected_workers=workers, heartbeat_timeout=timeout)
    core = ShardCore(KEYS, cfg, policy)
    for w in range(workers):
        core.register(w, f"inc{w}", now=0.0)
    core.initialize({"w": torch.zeros(4, dtype=torch.float64),
                     "b": torch.zeros(2, dtype=torch.float64)})
    return core


def grad(value, dtype=torch.float64):
    return {"w": torch.full((4,), float(value), dtype=dtype),
            "b": torch.full((2,), float(value), dtype=dtype)}


def answered(core, now=0.0):
    return sorted(r.worker for r in core.ready_pulls(now))


class Pusher:
    """Keeps per-worker push ids, as a client does."""

    def __init__(self, core):
        self.core, self.ids = core, {}

    def __call__(self, worker, read_version, value=1.0, clock=0, n=1, now=0.0):
        self.ids[worker] = self.ids.get(worker, 0) + 1
        return self.core.push(worker, self.ids[worker], clock, read_version, n, grad(value), now)


# ---------------------------------------------------------------- sync


def test_sync_steps_once_per_round_with_sample_weighted_mean():
    core = make_core("sync", workers=3)
    push = Pusher(core)
    assert not push(0, 0, value=1.0, n=1).applied
    assert not push(1, 0, value=2.0, n=2).applied
    assert core.version == 0
    out = push(2, 0, value=4.0, n=5)
    assert out.applied and core.version == 1
    mean = (1 * 1 + 2 * 2 + 4 * 5) / 8
    assert torch.allclose(core.params["w"], torch.full((4,), -mean, dtype=torch.float64))


def test_sync_pull_of_a_contributor_waits_for_the_round():
    core = make_core("sync", workers=2)
    push = Pusher(core)
    push(0, 0)
    core.request_pull(0, 1, "t0", now=0.0)
    assert answered(core) == []
    push(1, 0)
    replies = core.ready_pulls(1.0)
    assert [(r.worker, r.version) for r in replies] == [(0, 1)]
    assert replies[0].waited == pytest.approx(1.0)


def test_sync_late_and_duplicate_pushes_are_dropped():
    core = make_core("sync", workers=2)
    push = Pusher(core)
    push(0, 0)
    assert push(0, 0).reason == "duplicate_in_round"
    push(1, 0)
    late = push(0, 0)
    assert not late.accepted and late.reason == "late" and late.staleness == 1
    assert core.workers[0].rejected == {"duplicate_in_round": 1, "late": 1}


def test_sync_backup_workers_close_round_early():
    core = make_core("sync", workers=4, b=1)
    push = Pusher(core)
    for w in range(3):
        push(w, 0)
    assert core.version == 1  # the 4th (slowest) is not waited for
    assert push(3, 0).reason == "late"


def test_sync_dead_worker_no_longer_blocks():
    core = make_core("sync", workers=2, timeout=5.0)
    push = Pusher(core)
    core.heartbeat(0, 4.0)
    push(0, 0, now=4.0)
    assert core.version == 0
    assert core.expire(6.0) == [1]  # worker 1 silent since t=0
    assert core.version == 1


def test_worker_declared_dead_closes_the_round_at_once_and_can_rejoin():
    core = make_core("sync", workers=2, timeout=5.0)
    push = Pusher(core)
    push(0, 0)
    assert core.declare_dead(1) and core.version == 1  # no timeout waited out
    assert not core.declare_dead(1) and not core.declare_dead(7)  # already dead, unknown
    assert core.workers[1].deaths == 1
    core.register(1, "inc1-restarted", now=0.1)  # its old registration is not in the way
    assert core.workers[1].live


def test_heartbeat_in_flight_from_a_dead_process_does_not_revive_it():
    # the supervisor reports the death; a heartbeat the process sent just before it was
    # killed arrives after that report, then its restarted successor says HELLO
    core = make_core("ssp", workers=2, timeout=5.0)
    assert core.declare_dead(1)
    core.heartbeat(1, now=0.2)
    assert not core.workers[1].live  # not back, not holding the SSP gate
    core.register(1, "inc1-restarted", now=0.3)  # not refused as a duplicate
    assert core.workers[1].live
    core.heartbeat(1, now=0.4)
    assert core.workers[1].last_seen == 0.4  # the new incarnation's heartbeats count


def test_start_barrier_holds_pulls_until_expected_workers_registered():
    cfg = CoreConfig(mode=ModeSpec("async"), expected_workers=2)
    core = ShardCore(KEYS, cfg)
    core.register(0, "a", 0.0)
    core.initialize(grad(0.0))
    core.request_pull(0, 0, "t", 0.0)
    assert answered(core) == []
    core.register(1, "b", 0.0)
    assert answered(core) == [0]


# ---------------------------------------------------------------- async / ssp


def test_async_each_push_is_a_step_and_staleness_is_measured():
    core = make_core("async", workers=2)
    push = Pusher(core)
    assert push(0, 0).applied and core.version == 1
    out = push(1, 0)
    assert out.staleness == 1 and core.version == 2
    assert core.workers[1].staleness == {1: 1}


@pytest.mark.parametrize(("s", "clocks", "expect_answered"), [
    (0, {0: 1, 1: 0}, [1]),       # worker 0 ahead by 1 > s=0 must wait
    (1, {0: 1, 1: 0}, [0, 1]),
    (2, {0: 3, 1: 0}, [1]),
    (2, {0: 2, 1: 0}, [0, 1]),
])
def test_ssp_gate(s, clocks, expect_answered):
    core = make_core("ssp", workers=2, s=s)
    for w, c in clocks.items():
        core.request_pull(w, c, f"t{w}", 0.0)
    assert answered(core) == expect_answered


def test_ssp_waiting_pull_released_when_slowest_advances():
    core = make_core("ssp", workers=2, s=1)
    push = Pusher(core)
    core.request_pull(0, 2, "fast", 0.0)
    assert answered(core) == []
    push(1, core.version, clock=0)  # worker 1 completes iteration 0: clock 1
    assert answered(core, 2.0) == [0]
    assert core.max_answered_gap <= 1
    assert core.workers[0].deferred_pulls == 1


def test_ssp_finished_worker_leaves_the_minimum():
    core = make_core("ssp", workers=2, s=0)
    core.request_pull(0, 5, "t", 0.0)
    assert answered(core) == []
    core.leave(1, 0.0)
    assert answered(core) == [0]


# ---------------------------------------------------------------- policies and validation


def test_policy_rejection_is_counted_and_weights_untouched():
    core = make_core("async", workers=2, policy=RejectPolicy(max_staleness=0))
    push = Pusher(core)
    push(0, 0)
    before = core.params["w"].clone()
    out = push(1, 0)
    assert not out.accepted and "staleness 1 > 0" in out.reason
    assert torch.equal(core.params["w"], before)
    assert sum(core.workers[1].rejected.values()) == 1


def test_weight_scales_the_learning_rate():
    from paramserver.policies import InversePolicy

    core = make_core("async", workers=2, policy=InversePolicy(), lr=1.0)
    push = Pusher(core)
    push(0, 0, value=1.0)
    push(0, 1, value=1.0)
    w_before = core.params["w"].clone()
    out = push(1, 0, value=1.0)  # staleness 2: weight 1/2
    assert out.weight == 0.5
    assert torch.allclose(core.params["w"], w_before - 0.5)
    assert core.lr == 1.0  # restored after the step


def test_retried_push_is_applied_once():
    core = make_core("async", workers=1)
    first = core.push(0, 7, 0, 0, 1, grad(1.0), 0.0)
    again = core.push(0, 7, 0, 0, 1, grad(1.0), 0.1)
    assert first.applied and again.duplicate and core.version == 1


@pytest.mark.parametrize(("kwargs", "code"), [
    ({"read_version": 5}, ErrorCode.FUTURE_VERSION),
    ({"grads": {"w": torch.zeros(4, dtype=torch.float64)}}, ErrorCode.BAD_TENSOR),
    ({"grads": {**grad(0.0), "x": torch.zeros(1, dtype=torch.float64)}}, ErrorCode.UNKNOWN_KEY),
    ({"grads": grad(0.0, torch.float32)}, ErrorCode.BAD_TENSOR),
    ({"grads": {"w": torch.tensor([1.0, float("nan"), 0, 0], dtype=torch.float64),
                "b": torch.zeros(2, dtype=torch.float64)}}, ErrorCode.NONFINITE),
    ({"worker": 9}, ErrorCode.NOT_REGISTERED),
    ({"num_samples": 0}, ErrorCode.BAD_FIELD),
])
def test_invalid_pushes_change_nothing(kwargs, code):
    core = make_core("async", workers=1)
    args = {"worker": 0, "push_id": 1, "clock": 0, "read_version": 0, "num_samples": 1,
            "grads": grad(1.0), "now": 0.0}
    args.update(kwargs)
    before = {k: v.clone() for k, v in core.params.items()}
    with pytest.raises(ProtocolError) as err:
        core.push(**args)
    assert err.value.code == code
    assert core.version == 0
    assert all(torch.equal(before[k], core.params[k]) for k in before)


def test_duplicate_registration_refused_while_alive_then_taken_over():
    core = make_core("async", workers=1, timeout=5.0)
    with pytest.raises(ProtocolError) as err:
        core.register(0, "impostor", now=1.0)
    assert err.value.code == ErrorCode.DUPLICATE_WORKER
    state = core.register(0, "restarted", now=10.0)  # old incarnation silent > timeout
    assert state.incarnation == "restarted" and state.live


def test_rejoining_worker_resumes_at_minimum_live_clock():
    core = make_core("async", workers=3, timeout=5.0)
    push = Pusher(core)
    for c in range(4):
        push(1, core.version, clock=c, now=9.0)
        push(2, core.version, clock=c + 2, now=9.0)
    core.expire(9.0)  # worker 0 silent since t=0
    assert not core.workers[0].live
    state = core.register(0, "new", now=9.5)
    assert state.clock == core.workers[1].clock == 4


def test_copy_on_write_leaves_old_storage_intact():
    core = make_core("async", workers=1)
    view = core.params["w"]
    old = view.data
    core.copy_on_write()
    Pusher(core)(0, 0, value=1.0)
    assert torch.equal(old, torch.zeros(4, dtype=torch.float64))
    assert torch.equal(core.params["w"], torch.full((4,), -1.0, dtype=torch.float64))


def test_empty_shard_keeps_clocks():
    core = ShardCore([], CoreConfig(mode=ModeSpec("sync"), expected_workers=1))
    core.register(0, "a", 0.0)
    core.initialize({})
    out = core.push(0, 1, 0, 0, 1, {}, 0.0)
    assert out.accepted and core.workers[0].clock == 1


def test_mode_validation():
    with pytest.raises(ConfigError, match="mode must be one of"):
        ModeSpec("bsp")
    with pytest.raises(ConfigError, match="backup workers only apply"):
        ModeSpec("async", backup_workers=1)
    with pytest.raises(ConfigError, match="fewer than"):
        CoreConfig(mode=ModeSpec("sync", backup_workers=2), expected_workers=2)
