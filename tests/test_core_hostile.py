"""The core's rules against messages that decode cleanly but lie (issue 12); no sockets."""

from __future__ import annotations

import math

import pytest
import torch

from paramserver.core.shard import STATS_WORKERS, CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.core.sharding import ParamSpec, PlanLimits, ShardPlan
from paramserver.errors import ConfigError, ErrorCode, ProtocolError

SLICES = [SliceSpec("w", 128, "float32")]


def _core(mode: str = "async", **cfg: object) -> ShardCore:
    expected = int(cfg.pop("expected_workers", 1))  # type: ignore[call-overload]
    core = ShardCore(SLICES, CoreConfig(mode=ModeSpec(mode), expected_workers=expected,
                                        **cfg))  # type: ignore[arg-type]
    return core


def _code(exc: pytest.ExceptionInfo[ProtocolError]) -> str:
    return exc.value.code


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_gradient_of_the_right_size_and_wrong_shape_changes_nothing(mode: str) -> None:
    core = _core(mode)
    core.register(0, "a", 0.0)
    with pytest.raises(ProtocolError) as exc:
        core.initialize_part(0, {"w": torch.ones(1, 128)})  # INIT too
    assert _code(exc) == ErrorCode.BAD_TENSOR and not core.initialized
    core.initialize_part(0, {"w": torch.ones(128)})
    with pytest.raises(ProtocolError) as exc:
        core.push(0, 1, 0, 0, 1, {"w": torch.ones(16, 8)}, 0.0)
    assert _code(exc) == ErrorCode.BAD_TENSOR
    assert core.workers[0].pushes == 0 and core.version == 0
    out = core.push(0, 1, 0, 0, 1, {"w": torch.ones(128)}, 0.0)
    assert out is not None and out.applied and core.version == 1


def test_init_only_from_a_registered_worker() -> None:
    core = ShardCore([SliceSpec("a", 4, "float32"), SliceSpec("b", 4, "float32")])
    with pytest.raises(ProtocolError) as exc:
        core.initialize_part(7, {"a": torch.ones(4)}, 0, 2)
    assert _code(exc) == ErrorCode.NOT_REGISTERED
    core.register(0, "x", 0.0)
    assert core.initialize_part(0, {"a": torch.ones(4)}, 0, 2) is None
    assert core.initialize_part(0, {"b": torch.ones(4)}, 1, 2) is True


def test_push_ids_only_within_a_window() -> None:
    core = _core(push_id_window=10)
    core.register(0, "a", 0.0)
    core.initialize({"w": torch.zeros(128)})
    g = {"w": torch.ones(128)}
    assert core.push(0, 5, 0, 0, 1, g, 0.0) is not None  # the first id anchors
    with pytest.raises(ProtocolError) as exc:
        core.push(0, (1 << 62) - 1, 1, 1, 1, g, 0.0)
    assert _code(exc) == ErrorCode.BAD_FIELD
    out = core.push(0, 15, 1, 1, 1, g, 0.0)
    assert out is not None and out.applied and not out.duplicate
    with pytest.raises(ProtocolError):
        core.check_push_id(0, 26)
    core.check_push_id(0, 25)


def test_the_worker_table_is_bounded_and_evicts_idle_entries() -> None:
    core = _core(max_workers=4, heartbeat_timeout=1.0)
    core.register(0, "real", 0.0)
    core.initialize({"w": torch.zeros(128)})
    core.request_pull(0, 0, "t", 0.0)  # active now
    for i in range(1, 1000):
        core.register(i, f"f{i}", float(i))
    assert len(core.workers) == 4 and 0 in core.workers
    assert core.workers_evicted == 996
    # a table of active, live workers refuses a newcomer
    for w in list(core.workers):
        core.workers[w].pulls = 1
        core.workers[w].last_seen = 2000.0
    with pytest.raises(ProtocolError) as exc:
        core.register(5000, "new", 2000.0)
    assert _code(exc) == ErrorCode.TOO_MANY_WORKERS
    # one that died long ago makes room
    victim = next(w for w in core.workers if w != 0)
    core.declare_dead(victim)
    core.register(5000, "new", 2010.0)
    assert victim not in core.workers and 5000 in core.workers


def test_stats_stay_bounded() -> None:
    core = _core(max_workers=STATS_WORKERS * 2)
    for i in range(STATS_WORKERS * 2):
        core.register(i, "x", float(i))
    stats = core.stats()
    assert len(stats.workers) == STATS_WORKERS
    assert stats.workers_known == STATS_WORKERS * 2
    assert str(STATS_WORKERS * 2 - 1) in stats.workers  # the most recently seen


def test_a_round_that_cannot_step_is_dropped_not_retried() -> None:
    core = _core("sync", expected_workers=2)
    core.register(0, "a", 0.0)
    core.register(1, "b", 0.0)
    core.initialize({"w": torch.zeros(128)})
    assert core.push(0, 1, 0, 0, 1, {"w": torch.ones(128)}, 0.0) is not None

    def boom() -> None:
        raise RuntimeError("step failed")

    core.before_step = boom
    with pytest.raises(RuntimeError):
        core.expire(100.0)  # worker 1 (and 0) time out: the round closes and fails
    core.before_step = None
    assert not core.round.members and core.rounds_dropped == 1
    core.register(0, "a", 100.0)
    out = core.push(0, 2, 1, 0, 1, {"w": torch.ones(128)}, 100.0)
    assert out is not None and out.applied


def test_resume_refuses_nonfinite_weights_and_negative_versions() -> None:
    core = _core()
    core.register(0, "a", 0.0)
    core.initialize({"w": torch.ones(128)})
    tensors, meta = core.state_dict()
    fresh = _core()
    with pytest.raises(ConfigError):
        fresh.load_state_dict({**tensors, "param/w": torch.full((128,), math.nan)}, meta, 0.0)
    with pytest.raises(ConfigError):
        fresh.load_state_dict(tensors, {**meta, "version": -1}, 0.0)
    with pytest.raises(ConfigError):
        fresh.load_state_dict(tensors, {**meta, "version": True}, 0.0)
    assert not fresh.initialized and fresh.version == 0
    fresh.load_state_dict(tensors, meta, 0.0)
    assert fresh.initialized


def test_plan_limits_are_checked_by_arithmetic() -> None:
    limits = PlanLimits(max_model_bytes=1 << 20, max_chunks=100, min_chunk_bytes=64)
    bomb = {"params": [{"name": "x", "shape": [10 ** 12], "dtype": "float32"}],
            "num_shards": 1, "chunk_bytes": 1 << 20, "split": True}
    with pytest.raises(ConfigError, match="max-model-bytes"):
        ShardPlan.checked(bomb, limits)
    chunks = {**bomb, "params": [{"name": "x", "shape": [1 << 16], "dtype": "float32"}],
              "chunk_bytes": 64}
    with pytest.raises(ConfigError, match="chunks"):
        ShardPlan.checked(chunks, limits)
    with pytest.raises(ConfigError, match="minimum"):
        ShardPlan.checked({**chunks, "chunk_bytes": 1}, limits)
    for bad in ([], {"params": "x"}, {**bomb, "split": 1}, {**bomb, "num_shards": True},
                {**bomb, "params": [{"name": "x", "shape": [1.5], "dtype": "float32"}]}):
        with pytest.raises(ConfigError):
            ShardPlan.checked(bad, limits)
    plan = ShardPlan([ParamSpec("x", (3, 4), "float32")], 2, 64)
    specs, shards, chunk, split = ShardPlan.checked(plan.describe(), limits)
    assert ShardPlan.description_hash(specs, shards, chunk, split) == plan.hash
    # diff() of a bomb never builds it
    assert "shape mismatch" in plan.diff({**bomb, "params": [
        {"name": "x", "shape": [10 ** 9], "dtype": "float32"}], "num_shards": 2})
