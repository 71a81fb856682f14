"""The row-sparse core (paramserver/sparse/shard.py) without sockets: placement, seeded
initialization, validation, sync rounds, async staleness, optimizers, checkpoints."""

from __future__ import annotations

import pytest
import torch

from paramserver.core.records import ModeSpec
from paramserver.core.rows import RowRules
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import ConfigError, ProtocolError
from paramserver.policies import Decision, NoPolicy, StalenessPolicy, UpdateInfo
from paramserver.sparse.shard import (
    SparseShard,
    TableSpec,
    full_table,
    init_rows,
    owned_rows,
    shard_of,
)

SPEC = TableSpec("emb", 1000, 4, "float64", "normal", 0.5, seed=3)


class _Roster:
    def __init__(self, live):
        self.live = list(live)

    def pacing_ids(self):
        return self.live

    def min_clock(self):
        return 0


class _Rig(SparseShard):
    """A table of rows and the core's rules for its pushes (core/rows.py), as a shard
    server drives them."""

    def __init__(self, *args, mode, policy, live, **kwargs):
        super().__init__(*args, live=lambda: list(live), **kwargs)
        self.rules = RowRules(ModeSpec(mode), policy, self.shard, _Roster(live), 1024)

    def push(self, *args):
        return self.rules.push(self, *args)

    def take_ready(self):
        return [(token, outcome.row_fields()) for token, outcome in self.rules.ready(self)]


def _shard(mode="sync", optimizer="sgd", args=None, live=(0, 1), shards=1, shard=0,
           policy=None, spec=SPEC):
    return _Rig([spec], shards, shard, mode=mode, optimizer=optimizer,
                optimizer_args=args or {"lr": 0.5}, policy=policy or NoPolicy(), live=live)


def _push(sp, worker, push_id, ids, values, n=1, read=None, token=None):
    out = sp.push(worker, push_id, sp.version if read is None else read, 0, n,
                  {"ids:emb": torch.tensor(ids), "val:emb": values}, token or (worker,))
    return None if out is None else out.row_fields()


def test_hash_placement_covers_every_row_once_and_balances_hot_ids():
    owned = [owned_rows(SPEC.rows, 4, k) for k in range(4)]
    assert torch.equal(torch.sort(torch.cat(owned)).values, torch.arange(SPEC.rows))
    assert max(len(o) for o in owned) - min(len(o) for o in owned) < SPEC.rows * 0.05
    hot = shard_of(torch.arange(16), 4)  # the 16 hottest ids of a Zipfian table
    assert max((hot == k).sum() for k in range(4)) <= 6


def test_initial_rows_do_not_depend_on_the_shard_count():
    whole = full_table(SPEC)
    assert whole.dtype == torch.float64 and whole.std() == pytest.approx(0.5, rel=0.1)
    for shards in (1, 3):
        for k in range(shards):
            ids = owned_rows(SPEC.rows, shards, k)
            assert torch.equal(init_rows(SPEC, ids), whole[ids])
    other = TableSpec("emb", 1000, 4, "float64", "normal", 0.5, seed=4)
    assert not torch.equal(full_table(other), whole)
    assert float(full_table(TableSpec("z", 10, 2, init="zeros")).abs().sum()) == 0


def test_plans_hold_sparse_and_dense_together_and_hash_them():
    dense = [ParamSpec("w", (3, 2), "float32")]
    plan = ShardPlan(dense, 2, sparse=[SPEC])
    again = ShardPlan.from_description(plan.describe())
    assert again == plan and again.hash == plan.hash and again.sparse == (SPEC,)
    assert ShardPlan(dense, 2).hash != plan.hash
    assert "sparse" not in ShardPlan(dense, 2).describe()  # dense plans hash as before
    assert "sparse tables" in ShardPlan(dense, 2).diff(plan.describe())
    with pytest.raises(ConfigError):
        ShardPlan([ParamSpec("emb", (2,), "float32")], 1, sparse=[SPEC])  # name clash
    with pytest.raises(ConfigError):
        TableSpec("bad", 0, 4)


def test_sync_round_is_the_sample_weighted_mean_of_sparse_gradients_stepped_once():
    sp = _shard()
    w0 = sp.tables["emb"].weight.clone()
    ids = sp.tables["emb"].ids
    a = torch.randn(2, 4, dtype=torch.float64)
    b = torch.randn(2, 4, dtype=torch.float64)
    assert _push(sp, 0, 1, [ids[1], ids[5]], a, n=3, token="t0") is None  # parked
    assert sp.version == 0
    out = _push(sp, 1, 1, [ids[5], ids[9]], b, n=1, token="t1")
    assert out is not None and out["accepted"] and sp.version == 1
    assert sorted(t for t, _ in sp.take_ready()) == ["t0", "t1"]
    w = sp.tables["emb"].weight
    want = w0.clone()
    want[1] -= 0.5 * (3 * a[0]) / 4
    want[5] -= 0.5 * (3 * a[1] + b[0]) / 4
    want[9] -= 0.5 * b[1] / 4
    assert torch.allclose(w, want, rtol=0, atol=1e-12)
    untouched = torch.ones(len(ids), dtype=torch.bool)
    untouched[[1, 5, 9]] = False
    assert torch.equal(w[untouched], w0[untouched])  # only touched rows change
    # a push sent again returns its outcome, not applied twice
    assert _push(sp, 1, 1, [ids[5], ids[9]], b, n=1, read=0)["duplicate"]
    assert sp.version == 1


def test_adagrad_on_sparse_rows_matches_torch_and_state_survives_a_checkpoint():
    sp = _shard(optimizer="adagrad", args={"lr": 0.3}, live=(0,))
    ids = sp.tables["emb"].ids
    ref = torch.nn.Parameter(sp.tables["emb"].weight.clone())
    opt = torch.optim.Adagrad([ref], lr=0.3)
    for step in range(3):
        rows = torch.tensor([step, step + 2])
        g = torch.randn(2, 4, dtype=torch.float64)
        _push(sp, 0, step + 1, [int(ids[r]) for r in rows], g, n=2)
        ref.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), g, ref.shape)
        opt.step()
    assert torch.allclose(sp.tables["emb"].weight, ref.detach(), rtol=0, atol=1e-12)
    tensors, meta = sp.state_dict()
    fresh = _shard(optimizer="adagrad", args={"lr": 0.3}, live=(0,))
    fresh.load_state_dict({k: v.clone() for k, v in tensors.items()}, meta)
    again, meta2 = fresh.state_dict()
    assert meta2 == meta and set(again) == set(tensors)
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)
    assert any(k.startswith("sparse_optim/") for k in tensors)  # the per-row sums


def test_sgd_momentum_is_lazy_per_row_and_sparse_adam_steps_touched_rows_only():
    sp = _shard(mode="async", args={"lr": 0.1, "momentum": 0.9})
    ids = sp.tables["emb"].ids
    w0 = sp.tables["emb"].weight.clone()
    g = torch.ones(1, 4, dtype=torch.float64)
    _push(sp, 0, 1, [int(ids[0])], g)
    _push(sp, 0, 2, [int(ids[1])], g)  # row 0's momentum does not decay meanwhile
    _push(sp, 0, 3, [int(ids[0])], g)
    w = sp.tables["emb"].weight
    assert torch.allclose(w[0], w0[0] - 0.1 * (1 + 1.9), atol=1e-12)
    assert torch.allclose(w[1], w0[1] - 0.1, atol=1e-12)
    adam = _shard(mode="async", optimizer="adam", args={"lr": 0.01})
    a0 = adam.tables["emb"].weight.clone()
    _push(adam, 0, 1, [int(ids[2])], g)
    changed = (adam.tables["emb"].weight != a0).any(1)
    assert changed.tolist().count(True) == 1 and bool(changed[2])
    with pytest.raises(ConfigError):
        _shard(optimizer="rmsprop")


class Recorder(StalenessPolicy):
    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[UpdateInfo] = []

    def decide(self, info: UpdateInfo) -> Decision:
        self.seen.append(info)
        return Decision(True, 0.5)


def test_async_pushes_step_each_and_the_policy_sees_shard_and_row_staleness():
    policy = Recorder()
    sp = _shard(mode="async", policy=policy)
    ids = sp.tables["emb"].ids
    g = torch.ones(2, 4, dtype=torch.float64)
    assert _push(sp, 0, 1, [int(ids[0]), int(ids[1])], g, read=0)["accepted"]
    # worker 1 read at version 0; row 1 changed since, row 7 did not
    out = _push(sp, 1, 1, [int(ids[1]), int(ids[7])], g, read=0)
    assert out["staleness"] == 1 and sp.version == 2
    info = policy.seen[-1]
    assert (info.staleness, info.rows, info.stale_rows) == (1, 2, 1)


@pytest.mark.parametrize(("tensors", "code"), [
    ({"ids:emb": torch.tensor([0, 0])}, "bad_tensor"),
    ({"ids:emb": torch.tensor([5000])}, "bad_tensor"),
    ({"ids:emb": torch.tensor([0.5])}, "bad_tensor"),
    ({"ids:other": torch.tensor([0])}, "bad_field"),
    ({"rows": torch.tensor([0])}, "bad_tensor"),
])
def test_bad_sparse_requests_are_refused_with_a_code_and_change_nothing(tensors, code):
    sp = _shard(mode="async", shards=2)
    own = int(sp.tables["emb"].ids[0])
    w0 = sp.tables["emb"].weight.clone()
    fixed = {k: (torch.tensor([own, own]) if v.tolist() == [0, 0] else
                 torch.tensor([own]) if v.tolist() == [0] else v) for k, v in tensors.items()}
    if "ids:emb" in fixed:
        fixed["val:emb"] = torch.ones(len(fixed["ids:emb"]), 4, dtype=torch.float64)
    with pytest.raises(ProtocolError) as err:
        sp.push(0, 1, 0, 0, 1, fixed, None)
    assert err.value.code == code
    foreign = int(owned_rows(SPEC.rows, 2, 1)[0])  # a row of the other shard
    with pytest.raises(ProtocolError, match="another shard"):
        sp.pull({"ids:emb": torch.tensor([foreign])})
    assert torch.equal(sp.tables["emb"].weight, w0) and sp.version == 0


def test_from_module_plans_sharded_embeddings_and_recsys_reaches_10m_rows():
    from paramserver.workers.recsys import interactions
    from paramserver.workers.tasks import resolve_task

    task = resolve_task("recsys")(rank=1, world_size=2, users=10_000_000, items=10_000_000,
                                  samples=4000, eval_samples=500)
    plan = ShardPlan.from_module(task.model, 4)
    assert [(t.name, t.rows) for t in plan.sparse] == [("users", 10_000_000),
                                                       ("items", 10_000_000)]
    assert [p.name for p in plan.params] == ["bias"]
    pairs, labels = next(iter(task.batches))
    assert pairs.dtype == torch.int64 and pairs.shape[1] == 2
    assert set(labels.tolist()) <= {0.0, 1.0}
    ids, y = interactions(20_000, 1000, 1000, zipf=1.2, latent=4, sharpness=3.0, seed=0)
    counts = torch.bincount(ids[:, 0], minlength=1000)
    assert counts[0] > 20 * counts[500:].float().mean()  # Zipfian: id 0 is hot
    assert 0.3 < float(y.mean()) < 0.7
    with pytest.raises(ConfigError):
        resolve_task("recsys")(rank=0, world_size=1, users=10_000_001)


class _LocalRows:
    """Stands in for the shards: rows from a local table (no sockets)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.asked: list[int] = []

    def pull(self, name, ids, dim, dtype, cache=None):
        self.asked.append(len(ids))
        return self.table[ids].clone(), [3, 4]


@pytest.mark.parametrize("bag", [None, "sum", "mean"])
def test_worker_side_gradients_are_torchs_sparse_gradients_coalesced_per_id(bag):
    from paramserver import ShardedEmbedding, ShardedEmbeddingBag

    table = full_table(SPEC)
    ref = torch.nn.Embedding(SPEC.rows, SPEC.dim, sparse=True).double()
    with torch.no_grad():
        ref.weight.copy_(table)
    emb = (ShardedEmbedding(SPEC.rows, SPEC.dim, dtype=torch.float64) if bag is None else
           ShardedEmbeddingBag(SPEC.rows, SPEC.dim, dtype=torch.float64, mode=bag))
    fake = _LocalRows(table)
    emb.attach("emb", fake)
    ids = torch.tensor([[5, 9, 5], [700, 9, 1]])
    pool = (lambda t: t) if bag is None else (lambda t: getattr(t, bag)(1))
    w = torch.randn(2, SPEC.dim, dtype=torch.float64)
    for _ in range(2):  # two forwards before one step: their gradients add up
        got = emb(ids)
        (got.sum(1) if bag is None else got).mul(w).sum().backward()
        out = pool(ref(ids))
        (out.sum(1) if bag is None else out).mul(w).sum().backward()
        assert torch.allclose(got, out, rtol=0, atol=0)
    assert fake.asked == [4, 4]  # only the unique ids are pulled
    unique, grads, versions = emb.take_grads()
    want = ref.weight.grad.coalesce()
    assert torch.equal(unique, want.indices()[0])
    assert torch.allclose(grads, want.values(), rtol=0, atol=1e-12)
    assert versions == [3, 4]
    assert emb.take_grads()[0].numel() == 0  # the rows were dropped


def test_a_pull_with_versions_sends_only_rows_changed_since():
    sp = _shard(mode="async")
    ids = sp.tables["emb"].ids[:3]
    first = sp.pull({"ids:emb": ids, "since:emb": torch.tensor([-1, -1, -1])})
    assert first["sel:emb"].tolist() == [0, 1, 2]
    read = sp.version
    _push(sp, 0, 1, [int(ids[1])], torch.ones(1, 4, dtype=torch.float64))
    again = sp.pull({"ids:emb": ids, "since:emb": torch.full((3,), read)})
    assert again["sel:emb"].tolist() == [1]  # only the row a step changed
    assert torch.equal(again["val:emb"][0], sp.tables["emb"].weight[1])
    now = sp.pull({"ids:emb": ids, "since:emb": torch.full((3,), sp.version)})
    assert now["sel:emb"].numel() == 0
    # copies from a version the shard never reached (it rewound): all sent afresh
    ahead = sp.pull({"ids:emb": ids, "since:emb": torch.full((3,), sp.version + 5)})
    assert ahead["sel:emb"].tolist() == [0, 1, 2]
    with pytest.raises(ProtocolError):
        sp.pull({"ids:emb": ids, "since:emb": torch.tensor([0, 0])})  # wrong length


def test_the_row_cache_is_bounded_and_forgets_the_least_recently_used():
    from paramserver.workers.embedding import RowCache

    cache = RowCache(2)
    cache.store(torch.tensor([1, 2]), torch.zeros(2, 3), 5)
    cache.store(torch.tensor([3]), torch.ones(1, 3), 6)
    assert cache.since(torch.tensor([1, 2, 3])).tolist() == [-1, 5, 6]
    assert torch.equal(cache.rows_of(torch.tensor([3])), torch.ones(1, 3))
