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
