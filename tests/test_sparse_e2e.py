"""Row-sparse tables over real shard processes: sync training equals single-process
torch with sparse gradients; hostile sparse messages are refused; checkpoints keep rows
and per-row optimizer state."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

from paramserver import (
    ClientConfig,
    ClusterSpec,
    DistributedOptimizer,
    ServerConfig,
    ShardedEmbedding,
    ShardPlan,
    WorkerConfig,
    run_cluster,
)
from paramserver.cli.checkpoint import checkpoint as checkpoint_cli
from paramserver.persist.checkpoint import load_shard
from paramserver.sparse.shard import MAX_REQUEST_ROWS, full_table, owned_rows
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op, decode, encode
from paramserver.workers.admin import server_stats, shutdown_servers
from paramserver.workers.client import PART_BYTES, PSClient
from paramserver.workers.embedding import pull_tables
from paramserver.workers.launch.cluster import LocalCluster
from tests import sparse_script as S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8


def _run(tmp_path: Path, optimizer: str, args: dict, *extra: str, workers: int = 3,
         mode: str = "sync"):
    spec = ClusterSpec(
        num_servers=2, num_workers=workers,
        server=ServerConfig(mode=mode, optimizer=optimizer, optimizer_args=args),
        worker=WorkerConfig(servers=[]),
        command=[sys.executable, str(ROOT / "tests" / "sparse_script.py"),
                 str(tmp_path / "ranks"), "--steps", str(STEPS), *extra],
    )
    return run_cluster(spec, tmp_path / "run")


def _reference(workers: int, cls, args: dict, steps: int = STEPS) -> dict[str, torch.Tensor]:
    emb = nn.Embedding(S.ROWS, S.DIM, sparse=True).double()
    with torch.no_grad():
        emb.weight.copy_(full_table(S.spec()))
    model = S.Net(emb, seed=0)  # rank 0 seeds the dense weights
    opt = cls(model.parameters(), **args)
    for k in range(steps):
        parts = [S.batch(r, k) for r in range(workers)]
        ids = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        nn.functional.mse_loss(model(ids), y).backward()
        assert model.emb.weight.grad.is_sparse
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_sync_sparse_with_a_row_cache_equals_single_process_torch(tmp_path):
    # `paramserver launch -- python tests/sparse_script.py`: each worker caches 20 of the
    # 60 rows, so pulls honour the rows' versions (never stale)
    _run(tmp_path, "sgd", {"lr": 0.3}, "--cache", "20")
    want = _reference(3, torch.optim.SGD, {"lr": 0.3})
    start = full_table(S.spec())
    assert not torch.allclose(want["emb.weight"], start)  # training moved the rows
    for rank in range(3):
        got = load_file(str(tmp_path / "ranks" / f"rank{rank}.safetensors"))
        assert set(got) == set(want)
        assert got["emb.weight"].dtype == torch.float64
        for key in want:
            assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), (rank, key)
    # the launcher's final model holds the table too: it loads into nn.Embedding's model
    final = load_file(str(tmp_path / "run" / "final_model.safetensors"))
    model = S.Net(nn.Embedding(S.ROWS, S.DIM).double())
    model.load_state_dict(final)  # strict: every key, table included
    for key in want:
        assert torch.allclose(final[key], want[key], rtol=0, atol=1e-9), key


def _cluster(tmp_path: Path, servers: int, **server) -> LocalCluster:
    spec = ClusterSpec(num_servers=servers, num_workers=1, server=ServerConfig(**server),
                       worker=WorkerConfig(), evaluate=False)
    return LocalCluster(spec, tmp_path)


def _train(addresses: list[str], steps: range) -> dict[str, torch.Tensor]:
    model = S.Net(ShardedEmbedding(S.ROWS, S.DIM, dtype=torch.float64, std=S.STD,
                                   seed=S.SEED))
    opt = DistributedOptimizer(model, config=ClientConfig(
        servers=addresses, heartbeat_interval=0.2, timeout=20))
    try:
        for k in steps:
            ids, y = S.batch(0, k)
            opt.zero_grad()
            nn.functional.mse_loss(model(ids), y).backward()
            opt.step(num_samples=len(y))
        with torch.no_grad():
            table = model.emb(torch.arange(S.ROWS))
        return {"emb.weight": table, **{k: v.detach().clone()
                                        for k, v in model.state_dict().items()}}
    finally:
        opt.close()


def test_checkpoint_and_resume_of_sparse_shards_loses_nothing(tmp_path):
    # async Adagrad, one worker: 3 steps, both shards stop (checkpointing) and resume,
    # 3 more steps; equal to 6 uninterrupted steps only if every row and every per-row
    # Adagrad sum came back, and if the hostile messages between changed nothing
    ckpt = tmp_path / "ckpt"
    with _cluster(tmp_path, 2, mode="async", optimizer="adagrad",
                  optimizer_args={"lr": 0.2}, checkpoint_dir=str(ckpt)) as cluster:
        addresses = cluster.start_servers()
        before = _train(addresses, range(3))
        assert shutdown_servers(addresses) == []
        for shard in range(2):
            assert cluster.servers[shard].popen.wait(timeout=30) == 0
        saved = [load_shard(str(ckpt), s)[0] for s in range(2)]
        # `paramserver checkpoint export` puts the table, whole, under nn.Embedding's name
        out = tmp_path / "exported.safetensors"
        cli = CliRunner().invoke(checkpoint_cli, ["export", str(ckpt), str(out)])
        assert cli.exit_code == 0, cli.output
        model = S.Net(nn.Embedding(S.ROWS, S.DIM).double())
        model.load_state_dict(load_file(str(out)))  # strict: every key, table included
        assert torch.equal(model.emb.weight.detach(), before["emb.weight"])
        for shard in range(2):
            cluster._restart_server(shard)
        resumed = _train(addresses, range(0))  # only reads the rows back
        assert torch.equal(resumed["emb.weight"], before["emb.weight"])
        _hostile(addresses[0], 2)
        assert cluster.servers[0].popen.poll() is None
        after = _train(addresses, range(3, 6))
        # the whole table read as an observer, 3 rows per shard per request
        plan = _plan(2)
        with PSClient(addresses, plan, worker=0, role="observer", heartbeat_interval=0,
                      timeout=20) as client:
            client.connect()
            table = pull_tables(client, plan.sparse, part_bytes=3 * S.DIM * 8)
        assert torch.equal(table["emb.weight"], after["emb.weight"])
    for tensors in saved:  # per-row optimizer state went with the rows, in one file
        assert any(k.startswith("sparse_optim/") for k in tensors)
        assert any(k.startswith("sparse/emb/weight") for k in tensors)
    want = _reference(1, torch.optim.Adagrad, {"lr": 0.2}, steps=6)
    for key in want:
        assert torch.allclose(after[key], want[key], rtol=0, atol=1e-9), key


class Raw:
    """A raw DEALER speaking the wire format, for messages no client would send."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def code(self, op: Op, fields: dict, tensors: dict[str, torch.Tensor]) -> str:
        self.sock.send_multipart(encode(Message(op, 1, fields, tensors)))
        assert self.sock.poll(20_000), "the shard did not answer"
        reply = decode(self.sock.recv_multipart())
        return str(reply["code"]) if reply.op is Op.ERROR else "ok"

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _hostile(address: str, num_shards: int) -> None:
    """Messages no client would send, to shard 0: each refused with its code."""
    raw = Raw(address)
    try:
        plan = _plan(num_shards)
        hello = {"worker": 5, "role": "worker", "protocol": PROTOCOL_VERSION,
                 "plan_hash": plan.hash, "plan": plan.describe(), "incarnation": "x"}
        assert raw.code(Op.HELLO, hello, {}) == "ok"
        push = {"worker": 5, "push_id": 1, "clock": 0, "read_version": 0, "num_samples": 2}
        ids = owned_rows(S.ROWS, num_shards, 0)[:2]  # rows of shard 0
        other = owned_rows(S.ROWS, num_shards, 1)[:2]
        val = torch.ones(2, S.DIM, dtype=torch.float64)
        cases = [
            ({"ids:emb": ids[[0, 0]], "val:emb": val}, "bad_tensor"),  # repeated
            ({"ids:emb": torch.tensor([int(ids[0]), S.ROWS]), "val:emb": val}, "bad_tensor"),
            ({"ids:emb": torch.tensor([-1, int(ids[0])]), "val:emb": val}, "bad_tensor"),
            ({"ids:emb": other, "val:emb": val}, "bad_tensor"),  # another shard's rows
            ({"ids:emb": ids.int(), "val:emb": val}, "bad_tensor"),  # int32 ids
            ({"ids:emb": ids, "val:emb": val.float()}, "bad_tensor"),  # wrong dtype
            ({"ids:emb": ids, "val:emb": torch.ones(2, S.DIM + 1).double()}, "bad_tensor"),
            ({"ids:emb": ids, "val:emb": val * float("nan")}, "nonfinite"),
            ({"ids:nope": ids, "val:nope": val}, "bad_field"),  # no such table
            ({"val:emb": val}, "bad_tensor"),  # values without ids
            ({"ids:emb": ids.reshape(1, 2), "val:emb": val}, "bad_tensor"),
        ]
        for tensors, code in cases:
            assert raw.code(Op.SPUSH, push, tensors) == code, tensors.keys()
        assert raw.code(Op.SPUSH, {**push, "read_version": 10**6},
                        {"ids:emb": ids, "val:emb": val}) == "future_version"
        assert raw.code(Op.SPULL, {"worker": 5}, {"ids:emb": torch.tensor([S.ROWS])}
                        ) == "bad_tensor"
        assert raw.code(Op.SPULL, {"worker": 77}, {"ids:emb": ids}) == "not_registered"
        # a late SINIT of an initialized table changes nothing
        assert raw.code(Op.SINIT, {"worker": 5}, {"ids:emb": ids, "val:emb": val}) == "ok"
        assert raw.code(Op.BYE, {"worker": 5}, {}) == "ok"
    finally:
        raw.close()
    assert "error_internal" not in server_stats([address])[0].counters


def _plan(num_shards: int) -> ShardPlan:
    return ShardPlan.from_module(S.Net(ShardedEmbedding(
        S.ROWS, S.DIM, dtype=torch.float64, std=S.STD, seed=S.SEED)), num_shards)


def test_sync_sparse_waits_at_its_round_past_the_timeout_and_equals_torch(tmp_path, caplog):
    # three worker threads (real shard processes), sync Adagrad, the table streamed in by
    # rank 0 (from_pretrained, float64 kept), client timeout 2 s. Rank 2 starts its first
    # step only when this test says so (an event), after worker 0 reported its SPUSH held
    # in the round twice (> 4 s): it waits instead of giving up, and the run still
    # equals single-process torch on the union batches
    caplog.set_level(logging.WARNING, logger="paramserver.workers.liveness")
    go, errors = threading.Event(), []
    results: dict[int, dict[str, torch.Tensor]] = {}
    models = [S.Net(ShardedEmbedding.from_pretrained(full_table(S.spec())), seed=rank)
              for rank in range(3)]  # built here: fork_rng is not for threads

    def worker(rank: int, addresses: list[str]) -> None:
        model = models[rank]
        try:
            opt = DistributedOptimizer(model, config=ClientConfig(
                servers=addresses, rank=rank, world_size=3, heartbeat_interval=0.2,
                timeout=2, request_timeout=0.5))
        except BaseException as e:  # reported by the test thread
            errors.append(e)
            return
        try:
            for k in range(STEPS):
                if rank == 2 and k == 0:
                    go.wait(60)
                ids, y = S.batch(rank, k)
                opt.zero_grad()
                nn.functional.mse_loss(model(ids), y).backward()
                opt.step(num_samples=len(y))
            with torch.no_grad():
                table = model.emb(torch.arange(S.ROWS))
            results[rank] = {"emb.weight": table, **{k: v.detach().clone()
                                                     for k, v in model.state_dict().items()}}
        except BaseException as e:
            errors.append(e)
        finally:
            opt.close()

    def holding() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if "holding your pull for worker 0" in r.getMessage()
                and "sparse sync round: waiting for the pushes of workers [2]" in r.getMessage()]

    spec = ClusterSpec(num_servers=2, num_workers=3,
                       server=ServerConfig(mode="sync", optimizer="adagrad",
                                           optimizer_args={"lr": 0.2}),
                       worker=WorkerConfig(), evaluate=False)
    with LocalCluster(spec, tmp_path) as cluster:
        addresses = cluster.start_servers()
        threads = [threading.Thread(target=worker, args=(r, addresses)) for r in range(3)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 60
            while len(holding()) < 2 and not errors:  # poll for the state
                assert time.monotonic() < deadline, "worker 0 never reported holding"
                time.sleep(0.1)
            assert not errors, errors
            assert not results  # all still in step 0, past their timeout of 2 s
        finally:
            go.set()
            for t in threads:
                t.join(120)
        assert not errors, errors
        assert server_stats(addresses)[0].sparse.rounds == STEPS
    assert "(clock 0)" in holding()[0]
    want = _reference(3, torch.optim.Adagrad, {"lr": 0.2})
    for rank in range(3):
        assert results[rank]["emb.weight"].dtype == torch.float64
        for key in want:
            assert torch.allclose(results[rank][key], want[key], rtol=0, atol=1e-9), (rank, key)


def test_ssp_bounds_sparse_pushes_by_the_gate(tmp_path):
    # SSP s=1, two worker threads; worker 1 does not step until this test says so. Worker
    # 0 pushes steps 0 and 1; the pull that ends step 1 (clock 2, s + 1 ahead of worker 1)
    # is held at the gate, so its step 2, sparse rows included, never starts: the shard
    # has applied exactly those two sparse pushes
    go, errors, done = threading.Event(), [], [0, 0]
    models = [S.Net(ShardedEmbedding(S.ROWS, S.DIM, dtype=torch.float64, std=S.STD,
                                     seed=S.SEED), seed=rank) for rank in range(2)]

    def worker(rank: int, addresses: list[str]) -> None:
        try:
            opt = DistributedOptimizer(models[rank], config=ClientConfig(
                servers=addresses, rank=rank, world_size=2, heartbeat_interval=0.2,
                timeout=2, request_timeout=0.5))
        except BaseException as e:  # reported by the test thread
            errors.append(e)
            return
        try:
            if rank == 1:
                go.wait(60)
            for k in range(4):
                ids, y = S.batch(rank, k)
                opt.zero_grad()
                nn.functional.mse_loss(models[rank](ids), y).backward()
                opt.step(num_samples=len(y))
                done[rank] += 1
        except BaseException as e:
            errors.append(e)
        finally:
            opt.close()

    def gated() -> bool:  # worker 0 is past step 0 and the shard holds its pull (or, were
        # the gate open, worker 0 finished); worker 1 sends none meanwhile
        return done[0] == 4 or (done[0] >= 1 and server_stats(addresses)[0].core.pending_pulls > 0)

    spec = ClusterSpec(num_servers=1, num_workers=2,
                       server=ServerConfig(mode="ssp", staleness_bound=1, optimizer="sgd",
                                           optimizer_args={"lr": 0.1}),
                       worker=WorkerConfig(), evaluate=False)
    with LocalCluster(spec, tmp_path) as cluster:
        addresses = cluster.start_servers()
        threads = [threading.Thread(target=worker, args=(r, addresses)) for r in range(2)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 60
            while not gated() and not errors:  # poll for the state
                assert time.monotonic() < deadline, "worker 0 was never held at the gate"
                time.sleep(0.1)
            assert not errors, errors
            assert done == [1, 0]  # step 1 pushed, its pull held
            assert server_stats(addresses)[0].sparse.version == 2
        finally:
            go.set()
            for t in threads:
                t.join(60)
        assert not errors, errors
        assert done == [4, 4]
        assert server_stats(addresses)[0].sparse.version == 8  # every push applied


def test_a_table_of_more_rows_than_one_request_may_name_is_seeded_and_read_whole(tmp_path):
    """A dim-1 table holds more rows per default part (PART_BYTES) than a shard takes
    ids in one request (MAX_REQUEST_ROWS): the pretrained rows go in as several SINITs
    and an observer reads them back in several SPULLs, none refused as too large."""
    rows = MAX_REQUEST_ROWS + MAX_REQUEST_ROWS // 2
    assert PART_BYTES // 4 > MAX_REQUEST_ROWS  # the defaults would have made one request
    table = torch.arange(rows, dtype=torch.float32).unsqueeze(1)
    model = nn.Sequential(ShardedEmbedding.from_pretrained(table), nn.Linear(1, 1))
    with _cluster(tmp_path, 1, mode="async") as cluster:
        addresses = cluster.start_servers()
        opt = DistributedOptimizer(model, config=ClientConfig(
            servers=addresses, heartbeat_interval=0.2, timeout=20))
        try:
            opt.seed()
            plan = ShardPlan.from_module(model, 1)
            with PSClient(addresses, plan, worker=0, role="observer", heartbeat_interval=0,
                          timeout=20) as client:
                client.connect()
                pulled = pull_tables(client, plan.sparse)
        finally:
            opt.close()
    assert torch.equal(pulled["0.weight"], table)
