"""A core's complete state exported and restored (paramserver/core/transfer.py), with
no sockets: the restored core equals the original, and stays equal under the same
inputs, including a sync round half-filled with a part set aside for its turn."""

from __future__ import annotations

import msgspec
import pytest
import torch

from paramserver.core.shard import CoreConfig, ShardCore, SliceSpec
from paramserver.core.transfer import CoreImage, export, quiet, restore
from paramserver.errors import ConfigError
from tests import core_inputs

SLICES = [SliceSpec(f"k{i}", 16 + i, "float32") for i in range(2)]
WORKERS = 4


def config(mode: str, adam: bool = False) -> CoreConfig:
    return core_inputs.core_config(mode, WORKERS, adam)


def make_core(mode: str, adam: bool = False) -> ShardCore:
    return core_inputs.make_core(SLICES, WORKERS, mode, adam)


def gradient(worker: int, step: int) -> dict[str, torch.Tensor]:
    return core_inputs.gradient(SLICES, worker, step)


def push(core: ShardCore, worker: int, step: int, now: float, part: int = 0,
         parts: int = 1) -> object:
    g = gradient(worker, step)
    if parts > 1:
        g = {SLICES[part].key: g[SLICES[part].key]}
    return core.push(worker, step, step, core.version, 8, g, now, part, parts)


def copy_of(core: ShardCore, mode: str) -> ShardCore:
    """``core`` exported, sent through msgpack as the wire sends it, and restored."""
    image, tensors = export(core)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(image), type=CoreImage)
    other = ShardCore(SLICES, config(mode), None)
    restore(other, wire, {k: v.clone() for k, v in tensors.items()})
    return other


def assert_same(a: ShardCore, b: ShardCore) -> None:
    ia, ta = export(a)
    ib, tb = export(b)
    assert msgspec.to_builtins(ia) == msgspec.to_builtins(ib)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


def test_sync_round_half_filled_restores_bit_for_bit() -> None:
    core = make_core("sync")
    for w in range(WORKERS):  # one whole round: momentum state, version 1
        push(core, w, 0, 1.0)
    assert core.version == 1
    push(core, 2, 1, 2.0)  # before its turn: set aside
    push(core, 0, 1, 2.1)  # in the buffer
    assert core.round.waiting and core.round.members == {0, 2}
    other = copy_of(core, "sync")
    assert_same(core, other)
    # the same inputs from here: worker 0's push again (a duplicate), then the rest
    assert push(core, 0, 1, 3.0) == push(other, 0, 1, 3.0)
    for w in (3, 1):
        assert push(core, w, 1, 3.0) == push(other, w, 1, 3.0)
    assert core.version == other.version == 2
    assert_same(core, other)
    for key, p in core.params.items():
        assert torch.equal(p, other.params[key])


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_restore_windows_clocks_and_liveness(mode: str) -> None:
    core = make_core(mode)
    for step in range(3):
        for w in range(WORKERS - 1):
            push(core, w, step, 1.0 + step)
    core.leave(3, 5.0)  # one worker said BYE
    other = copy_of(core, mode)
    assert_same(core, other)
    assert other.workers[1].last_outcome == core.workers[1].last_outcome is not None
    assert push(core, 1, 2, 6.0) == push(other, 1, 2, 6.0)  # a retry: a duplicate
    assert push(core, 1, 3, 6.0) == push(other, 1, 3, 6.0)
    assert_same(core, other)


def test_adam_state_through_the_wire_frames() -> None:
    """Adam keeps a 0-d step tensor: the snapshot's frames carry it as they carry the
    rest, and the restored core steps as the original does."""
    from paramserver.wire import replication as wrepl
    from paramserver.wire.frames import Limits

    core = make_core("async", adam=True)
    for w in range(WORKERS):
        push(core, w, 0, 1.0)
    image, tensors = export(core)
    frames = [bytes(f) for f in wrepl.snapshot_frames(1, 5, 0.0, "tcp://p", b"", image,
                                                      tensors)]
    record, rest = wrepl.decode(frames)
    assert isinstance(record, wrepl.Snapshot) and record.core is not None
    other = ShardCore(SLICES, config("async", adam=True), None)
    restore(other, record.core, wrepl.snapshot_tensors(record, rest, Limits()))
    assert_same(core, other)
    assert push(core, 2, 1, 2.0) == push(other, 2, 1, 2.0)
    assert_same(core, other)


def test_a_push_in_parts_waits_for_the_export() -> None:
    core = make_core("sync")
    push(core, 1, 0, 1.0, part=0, parts=2)
    assert not quiet(core)
    with pytest.raises(RuntimeError):
        export(core)
    push(core, 1, 0, 1.0, part=1, parts=2)
    assert quiet(core)


def test_a_hostile_snapshot_is_refused() -> None:
    core = make_core("sync")
    push(core, 2, 0, 1.0)  # set aside
    image, tensors = export(core)
    bad = {k: (torch.full_like(v, float("nan")) if k.startswith("wait/") else v)
           for k, v in tensors.items()}
    with pytest.raises(ConfigError, match="NaN"):
        restore(ShardCore(SLICES, config("sync"), None), image, bad)
    missing = {k: v for k, v in tensors.items() if not k.startswith("param/")}
    with pytest.raises(ConfigError):
        restore(ShardCore(SLICES, config("sync"), None), image, missing)


# A snapshot crosses hosts: the receiver's monotonic clock counts from another boot,
# far ahead of the sender's or behind it. Its instants are moved by the difference of
# the two `now`s, so every age (and every decision made from one) is the same.
SKEWS = [1e6, -4000.0 + 0.25]


def _aged_core() -> ShardCore:
    """A sync core at (its) time 5000: worker 3 last heard at 4993, the others at
    5000; one part in the open round since 4998."""
    core = make_core("sync")
    for w in range(WORKERS):
        core.heartbeat(w, 4993.0)
    for w in range(3):
        core.heartbeat(w, 5000.0)
    push(core, 0, 0, 4998.0)
    return core


@pytest.mark.parametrize("skew", SKEWS)
def test_a_snapshot_keeps_ages_on_a_receiver_with_another_clock(skew: float) -> None:
    core = _aged_core()
    image, tensors = export(core)
    sent_at = 5000.0
    other = ShardCore(SLICES, config("sync"), None)
    here = sent_at + skew  # the receiver's clock when it restores
    restore(other, image, {k: v.clone() for k, v in tensors.items()}, shift=here - sent_at)
    for w in range(WORKERS):
        age = sent_at - core.workers[w].last_seen
        assert here - other.workers[w].last_seen == pytest.approx(age)
        assert here - other.workers[w].pushed_at == pytest.approx(
            sent_at - core.workers[w].pushed_at)
    assert core.round.opened is not None and other.round.opened is not None
    assert here - other.round.opened == pytest.approx(sent_at - core.round.opened)
    # the heartbeat timeout (10 s) removes worker 3 at the same age on both: not at 9.9
    # s of silence, at 10.1 s
    assert core.expire(sent_at + 2.9) == [] and other.expire(here + 2.9) == []
    assert core.expire(sent_at + 3.1) == [3] and other.expire(here + 3.1) == [3]


@pytest.mark.parametrize("skew", SKEWS)
def test_an_unshifted_snapshot_would_misjudge_liveness(skew: float) -> None:
    """What the shift is for: restored with the sender's instants as they are, a
    receiver whose clock is far ahead declares every worker dead at once (far behind:
    none for hours)."""
    core = _aged_core()
    image, tensors = export(core)
    other = ShardCore(SLICES, config("sync"), None)
    restore(other, image, {k: v.clone() for k, v in tensors.items()})
    dead = other.expire(5000.0 + skew + 3.1)
    assert dead == (list(range(WORKERS)) if skew > 0 else [])


def test_a_snapshot_time_that_is_not_finite_is_refused() -> None:
    image, tensors = export(_aged_core())
    with pytest.raises(ConfigError, match="not finite"):
        restore(ShardCore(SLICES, config("sync"), None), image, tensors,
                shift=float("nan"))
