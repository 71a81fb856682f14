"""Sync rounds with several workers pipelined per part (issue 45, item 2), with no
sockets: a key's step is taken ahead once every worker's part of it is in, and what
it made is handed out while later parts arrive. The round's version and weights are
the whole-round path's, bit for bit, however the parts arrive."""

from __future__ import annotations

import itertools

import pytest
import torch

from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec

SLICES = [SliceSpec(f"k{i}", 50 + i, "float32") for i in range(4)]
WORKERS = 3


def make_core(pipelined: bool, lr_scaling: str = "none", momentum: float = 0.0,
              workers: int = WORKERS) -> ShardCore:
    cfg = CoreConfig(mode=ModeSpec("sync", 0, 0), optimizer="sgd",
                     optimizer_args={"lr": 0.1, "momentum": momentum},
                     expected_workers=workers, heartbeat_timeout=10.0,
                     lr_scaling=lr_scaling)
    core = ShardCore(SLICES, cfg)
    for w in range(workers):
        core.register(w, f"inc{w}", now=0.0)
    gen = torch.Generator().manual_seed(0)
    core.initialize({s.key: torch.randn(s.numel, generator=gen) for s in SLICES})
    if not pipelined:
        core.ahead.busy = lambda: True  # never steps ahead: the step at the close
    return core


def part(worker: int, step: int, key: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * worker + 10 * step + key)
    s = SLICES[key]
    return {s.key: torch.randn(s.numel, generator=gen) * 3}


def run(core: ShardCore, arrivals: list[tuple[int, int]], steps: int = 2,
        early: list[dict[str, torch.Tensor]] | None = None) -> None:
    """Each round the parts arrive as (worker, part); ``early`` collects what the
    core hands out before each round closes."""
    for step in range(steps):
        read = core.version
        for i, (worker, k) in enumerate(arrivals):
            out = core.push(worker, step + 1, step, read, worker + 2, part(worker, step, k),
                            0.0, k, len(SLICES))
            last = i == len(arrivals) - 1
            assert (out is not None and out.applied) if last else core.version == read
            if early is not None and not last:
                got = core.ahead.released(())
                if got:
                    early[-1].update(got)
        assert core.version == step + 1
        if early is not None and step < steps - 1:
            early.append({})


def orders() -> list[list[tuple[int, int]]]:
    parts = range(len(SLICES))
    out = []
    for perm in itertools.permutations(range(WORKERS)):
        out.append([(w, k) for k in parts for w in perm])  # parts in lockstep
        out.append([(w, k) for w in perm for k in parts])  # one push after another
    out.append([(2, 3), (1, 0), (0, 1), (2, 0), (1, 3), (0, 0), (2, 1), (0, 3), (1, 1),
                (2, 2), (0, 2), (1, 2)])  # parts out of order too
    return out


@pytest.mark.parametrize("lr_scaling", ["none", "linear"])
def test_parts_pipelined_give_the_whole_round_weights_bit_for_bit(lr_scaling: str) -> None:
    reference = make_core(pipelined=False, lr_scaling=lr_scaling)
    run(reference, orders()[0])
    assert reference.ahead.committed == 0
    for arrivals in orders():
        core = make_core(pipelined=True, lr_scaling=lr_scaling)
        early: list[dict[str, torch.Tensor]] = [{}]
        run(core, arrivals, early=early)
        assert core.version == reference.version
        for key, p in reference.params.items():
            assert torch.equal(core.params[key], p), (arrivals, key)
        if {k for _, k in arrivals[:WORKERS]} == {0}:  # final before the last part: early
            assert core.ahead.committed == 2 and all(early), arrivals
        assert core.stats() is not None


def test_early_weights_are_the_rounds_and_go_out_before_it_closes() -> None:
    """In lockstep every key but the last parts' goes out before the round closes,
    and each is the weights the round then makes."""
    core = make_core(pipelined=True)
    reference = make_core(pipelined=False)
    arrivals = [(w, k) for k in range(len(SLICES)) for w in range(WORKERS)]
    early: list[dict[str, torch.Tensor]] = [{}]
    run(core, arrivals, steps=1, early=early)
    run(reference, arrivals, steps=1)
    assert set(early[0]) == {s.key for s in SLICES[:-1]}  # the last with the close
    for key, p in early[0].items():
        assert torch.equal(p, core.params[key]) and torch.equal(p, reference.params[key])
    assert core.ahead.last_commit == core.version == 1


def test_a_key_stepped_ahead_is_not_released_before_every_worker_has_it() -> None:
    core = make_core(pipelined=True)
    core.push(0, 1, 0, 0, 2, part(0, 0, 0), 0.0, 0, len(SLICES))
    core.push(1, 1, 0, 0, 3, part(1, 0, 0), 0.0, 0, len(SLICES))
    assert core.ahead.released(()) is None  # worker 2's part of k0 has not come
    core.push(2, 1, 0, 0, 4, part(2, 0, 1), 0.0, 1, len(SLICES))
    assert core.ahead.released(()) is None  # (a part of another key)
    core.push(2, 1, 0, 0, 4, part(2, 0, 0), 0.0, 0, len(SLICES))
    got = core.ahead.released(())
    assert got is not None and set(got) == {"k0"}
    assert core.ahead.released({"k0"}) is None  # handed out once per asker


def test_a_non_sgd_step_and_backup_workers_take_the_whole_round_path() -> None:
    for core in (make_core(pipelined=True, momentum=0.9), _with_backups()):
        for k in range(len(SLICES)):
            for w in range(WORKERS):
                core.push(w, 1, 0, 0, 2, part(w, 0, k), 0.0, k, len(SLICES))
                if core.version == 0:
                    assert core.ahead.released(()) is None
        assert core.version == 1 and core.ahead.committed == 0


def _with_backups() -> ShardCore:
    cfg = CoreConfig(mode=ModeSpec("sync", 0, 1), optimizer="sgd",
                     optimizer_args={"lr": 0.1}, expected_workers=WORKERS + 1,
                     heartbeat_timeout=10.0)
    core = ShardCore(SLICES, cfg)
    for w in range(WORKERS + 1):
        core.register(w, f"inc{w}", now=0.0)
    core.initialize({s.key: torch.zeros(s.numel) for s in SLICES})
    return core


def test_a_worker_back_in_the_round_after_keys_were_stepped_drops_them() -> None:
    """A key stepped ahead that is written again (a left-out worker pushes after all)
    drops what was made: the round steps at the close from its sums."""
    core = make_core(pipelined=True)
    reference = make_core(pipelined=False)
    for c in (core, reference):
        c.members.left_out.add(2)
    for c in (core, reference):
        for k in range(len(SLICES) - 1):
            for w in (0, 1):
                c.push(w, 1, 0, 0, 2, part(w, 0, k), 0.0, k, len(SLICES))
    assert core.ahead.released(()) is not None
    for c in (core, reference):
        for k in range(len(SLICES)):
            c.push(2, 1, 0, 0, 5, part(2, 0, k), 0.0, k, len(SLICES))
        for w in (0, 1):
            c.push(w, 1, 0, 0, 2, part(w, 0, 3), 0.0, 3, len(SLICES))
        assert c.version == 1
    assert core.ahead.committed == 0
    for key, p in reference.params.items():
        assert torch.equal(core.params[key], p)
