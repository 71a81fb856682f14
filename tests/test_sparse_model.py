"""Embeddings as a PyTorch user writes them, without servers: nn.Embedding(sparse=True)
refused in one line naming ShardedEmbedding, sparse tables refused under replicated
servers (by the script's optimizer and by the shard), gradient clipping that covers a
ShardedEmbedding's rows, and torch.save / state_dict of a model that holds one. The
rows come from a stand-in for the servers (:class:`_Rows`), which holds an mmap as the
real client's shared memory does."""

from __future__ import annotations

import io
import mmap
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paramserver import (
    ClientConfig,
    DistributedOptimizer,
    ShardedEmbedding,
    ShardedEmbeddingBag,
)
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.server.loop import ServerConfig, ShardServer
from paramserver.sparse.shard import TableSpec, full_table

ROWS, DIM = 12, 3


class _Rows:
    """What a ShardedEmbedding asks of its servers: rows by id, from a table here."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.segment = mmap.mmap(-1, 4096)  # (the real client's shared memory: unpicklable)

    def pull(self, name, ids, dim, dtype, cache=None):
        return self.table[ids].clone(), [0]


class _Net(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        self.out = nn.Linear(DIM, 1).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).sum(1)).squeeze(1)


def _attached(table: torch.Tensor) -> _Net:
    torch.manual_seed(0)
    model = _Net(ShardedEmbedding(ROWS, DIM, dtype=torch.float64))
    model.emb.attach("emb", _Rows(table))
    return model


@pytest.mark.parametrize("module", [nn.Embedding(ROWS, DIM, sparse=True),
                                    nn.EmbeddingBag(ROWS, DIM, sparse=True)])
def test_a_sparse_gradient_embedding_is_refused_naming_sharded_embedding(module):
    model = nn.Sequential(nn.Linear(2, 2), module)
    kind = type(module).__name__
    with pytest.raises(ConfigError) as err:  # before anything connects: no server here
        DistributedOptimizer(model, config=ClientConfig(servers=["127.0.0.1:9"]))
    message = str(err.value)
    assert "\n" not in message
    assert f"1: nn.{kind}(sparse=True)" in message
    assert f"paramserver.Sharded{kind}({ROWS}, {DIM})" in message


def test_sparse_tables_on_replicated_servers_are_refused_by_the_script():
    model = _Net(ShardedEmbedding(ROWS, DIM, dtype=torch.float64))
    with pytest.raises(ConfigError, match="--replicas does not work with a sparse table"):
        DistributedOptimizer(
            model, config=ClientConfig(servers=["tcp://127.0.0.1:9|tcp://127.0.0.1:10"]))


def test_a_replicated_shard_refuses_a_plan_with_sparse_tables(tmp_path):
    """What a HELLO bringing tables gets from a shard with --replicas (a backup here:
    replica 1 of 2 starts without peers to wait for)."""
    from paramserver.wire.replauth import make_key_file

    key = make_key_file(tmp_path / "replication.key")
    server = ShardServer(ServerConfig(replicas=1, replica=1, replication_key=str(key)))
    server.start()
    try:
        plan = ShardPlan([ParamSpec("w", (4,), "float32")], 1,
                         sparse=[TableSpec("emb", ROWS, DIM)])
        with pytest.raises(ProtocolError) as err:
            server.adopt_plan(plan)
        assert err.value.code == ErrorCode.BAD_FIELD
        assert "--replicas does not work with a sparse table" in err.value.reason
        assert server.core is None
        server.adopt_plan(ShardPlan([ParamSpec("w", (4,), "float32")], 1))  # dense: taken
        assert server.core is not None
    finally:
        assert server.replication is not None
        server.close()


def test_clip_grad_norm_covers_the_tables_rows_as_torch_covers_a_dense_embedding():
    """opt.clip_grad_norm_ clips a ShardedEmbedding's rows with the dense gradients,
    exactly as torch's clips the same model with an nn.Embedding; a row read twice
    counts once, with its summed gradient."""
    table = torch.randn(ROWS, DIM, dtype=torch.float64, generator=torch.Generator()
                        .manual_seed(1))
    model = _attached(table)
    dense = _Net(nn.Embedding(ROWS, DIM, dtype=torch.float64))
    dense.emb.weight.data.copy_(table)
    dense.out.load_state_dict(model.out.state_dict())
    a, b = torch.tensor([[0, 3], [3, 5]]), torch.tensor([[5, 5], [7, 0]])  # rows again
    for net in (model, dense):
        (net(a).pow(2).sum() + net(b).pow(2).sum()).backward()
    opt = SimpleNamespace(params=dict(model.named_parameters()), tables=[("emb", model.emb)])
    total = DistributedOptimizer.clip_grad_norm_(opt, 0.5)  # type: ignore[arg-type]
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
    assert float(want) > 1.0  # (it clips)
    assert torch.equal(total, want)
    ids, rows, _ = model.emb.take_grads()
    assert torch.allclose(rows, dense.emb.weight.grad[ids], rtol=1e-12, atol=0)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[ids] = False
    assert not dense.emb.weight.grad[untouched].any()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, dict(dense.named_parameters())[name].grad), name


def test_torch_save_of_a_model_keeps_the_table_not_the_connection():
    table = torch.randn(ROWS, DIM, dtype=torch.float64)
    model = _attached(table)
    model(torch.tensor([[1, 2]])).sum().backward()  # rows read for a step under way
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    emb = loaded.emb
    assert emb.client is None and emb.take_grads()[0].numel() == 0
    assert torch.equal(emb.pretrained, table)  # a new run's servers are seeded with it
    assert emb.table_spec("emb").init == "pretrained"
    assert torch.equal(loaded.out.weight, model.out.weight)
    assert model.emb.client is not None  # (the saved model itself is unchanged)


def test_state_dict_holds_the_table_and_loads_into_a_model_not_yet_connected():
    table = torch.randn(ROWS, DIM, dtype=torch.float64)
    model = _attached(table)
    state = model.state_dict()
    assert set(state) == {"emb.weight", "out.weight", "out.bias"}
    assert torch.equal(state["emb.weight"], table)
    fresh = _Net(ShardedEmbedding(ROWS, DIM, dtype=torch.float64))
    assert set(fresh.state_dict()) == {"out.weight", "out.bias"}  # (the shards draw it)
    fresh.load_state_dict(state)  # strict
    assert torch.equal(fresh.emb.pretrained, table)
    assert torch.equal(fresh.state_dict()["emb.weight"], table)
    with pytest.raises(RuntimeError, match="lives on the servers already"):
        model.load_state_dict(state)  # connected: the shards hold the table
    bag = ShardedEmbeddingBag(ROWS, DIM)
    with pytest.raises(RuntimeError, match=r"got torch.float64 \(12, 3\)"):
        bag.load_state_dict({"weight": table})  # float32 table


def test_a_pretrained_table_saves_as_it_was_given():
    table = full_table(TableSpec("t", ROWS, DIM, "float64", "normal", 1.0, 3))
    emb = ShardedEmbedding.from_pretrained(table)
    assert torch.equal(emb.state_dict()["weight"], table)
