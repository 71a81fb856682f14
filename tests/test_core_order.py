"""A sync round is summed by worker id, not in arrival order, with no sockets: the
same pushes give the same weights bit for bit, however they arrive."""

from __future__ import annotations

import itertools

import torch

from paramserver.core.shard import ShardCore, SliceSpec
from tests import core_inputs

SLICES = [SliceSpec(f"k{i}", 64 + i, "float32") for i in range(3)]
WORKERS = 4


def make_core() -> ShardCore:
    return core_inputs.make_core(SLICES, WORKERS)


def gradient(worker: int, step: int) -> dict[str, torch.Tensor]:
    return core_inputs.gradient(SLICES, worker, step)


def parts_of(worker: int, step: int) -> list[dict[str, torch.Tensor]]:
    g = gradient(worker, step)
    return [{k: g[k]} for k in g]  # one slice a part


def run(arrivals: list[tuple[int, int]], steps: int = 3, ordered: bool = True) -> ShardCore:
    """Each round, the parts arrive as (worker, part) in ``arrivals``."""
    core = make_core()
    if not ordered:
        core.round.roster = None
    for step in range(steps):
        read = core.version
        parts = {w: parts_of(w, step) for w in range(WORKERS)}
        for worker, part in arrivals:
            core.push(worker, step + 1, step, read, worker + 1, parts[worker][part], 0.0, part,
                      len(SLICES))
        assert core.version == step + 1
    return core


def interleavings() -> list[list[tuple[int, int]]]:
    whole = [[(w, p) for p in range(len(SLICES))] for w in range(WORKERS)]
    orders = []
    for perm in itertools.permutations(range(WORKERS)):
        orders.append([x for w in perm for x in whole[w]])  # one push after another
        # the parts of all pushes interleaved, in this worker order
        orders.append([(w, p) for p in range(len(SLICES)) for w in perm])
    return orders


def test_the_same_pushes_in_any_arrival_order_give_the_same_weights_bit_for_bit():
    reference = run(interleavings()[0])
    for arrivals in interleavings()[1:]:
        core = run(arrivals)
        for key in reference.params:
            assert torch.equal(core.params[key], reference.params[key]), (arrivals, key)
    # nothing is left set aside once the rounds closed
    assert not reference.round.waiting and not reference.round.adding


def test_the_same_pushes_summed_as_they_arrive_end_apart():
    # the test above can fail: summed in arrival order, these rounds end apart
    outcomes = set()
    for arrivals in interleavings()[:16]:
        core = run(arrivals, ordered=False)
        outcomes.add(b"".join(core.params[k].numpy().tobytes() for k in sorted(core.params)))
    assert len(outcomes) > 1


def test_a_checkpoint_while_a_joined_push_waits_for_its_turn_keeps_it():
    core = make_core()
    for w in (3, 1, 2):  # worker 0 has not pushed: their parts wait for its turn
        for p, part in enumerate(parts_of(w, 0)):
            assert core.push(w, 1, 0, 0, w + 1, part, 0.0, p, len(SLICES)) is None or p == 2
    assert sorted(core.round.waiting) == [1, 2, 3] and core.round.members == {1, 2, 3}
    tensors, meta = core.state_dict()
    assert not meta["round_void"]
    restored = make_core()
    restored.load_state_dict(tensors, meta, now=0.0)
    for p, part in enumerate(parts_of(0, 0)):
        restored.push(0, 1, 0, 0, 1, part, 0.0, p, len(SLICES))
        core.push(0, 1, 0, 0, 1, part, 0.0, p, len(SLICES))
    assert core.version == restored.version == 1
    for key in core.params:  # (the restored round summed worker 0 last)
        assert torch.allclose(core.params[key], restored.params[key], rtol=1e-6, atol=1e-6)


def test_a_worker_declared_dead_lets_the_ones_after_it_in():
    core = make_core()
    for w in (1, 2, 3):
        for p, part in enumerate(parts_of(w, 0)):
            core.push(w, 1, 0, 0, w + 1, part, 0.0, p, len(SLICES))
    assert core.version == 0 and sorted(core.round.waiting) == [1, 2, 3]
    assert core.declare_dead(0)
    assert core.version == 1 and not core.round.waiting


# ---------------------------------------------------------------- sparse rows


class _Roster:
    def __init__(self, live: list[int]) -> None:
        self.live = live

    def pacing_ids(self) -> list[int]:
        return self.live

    def min_clock(self) -> int:
        return 0


def _sparse_round(order: tuple[int, ...]) -> torch.Tensor:
    from paramserver.core.records import ModeSpec as Spec
    from paramserver.core.rows import RowRules
    from paramserver.policies import NoPolicy
    from paramserver.sparse.shard import SparseShard, TableSpec

    live = list(range(WORKERS))
    table = SparseShard([TableSpec("emb", 50, 8, "float32", "normal", 0.5, seed=3)], 1, 0,
                        live=lambda: live, optimizer="sgd", optimizer_args={"lr": 0.5})
    rules = RowRules(Spec("sync"), NoPolicy(), 0, _Roster(live), 1024)
    for worker in order:
        gen = torch.Generator().manual_seed(worker)
        ids = torch.tensor([1, 7, 8, 30, 49])  # the same rows from every worker
        values = torch.randn(5, 8, generator=gen) * 10.0 ** (worker - 1)
        rules.push(table, worker, 1, 0, 0, worker + 1,
                   {"ids:emb": ids, "val:emb": values}, (worker,))
    assert table.version == 1
    return table.tables["emb"].weight.clone()


def test_a_sparse_round_sums_rows_by_worker_id_bit_for_bit():
    reference = _sparse_round(tuple(range(WORKERS)))
    for order in itertools.permutations(range(WORKERS)):
        assert torch.equal(_sparse_round(order), reference), order
