"""Hostile sparse requests against a real shard process (issue 29, items 6 and 7):
a SPULL cannot make the shard expand repeated ids into rows, nor read as an
observer that never said HELLO; a pretrained table whose seeder leaves or dies is
seeded by the next live worker instead of waiting forever."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.sparse.shard import MAX_REQUEST_ROWS, TableSpec
from paramserver.wire.protocol import Op, decode
from paramserver.workers.admin import report_dead, server_stats
from tests.test_hostile_e2e import Hostile, _cluster, _f32, _rss

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MiB = 1 << 20
ROWS, DIM = 4096, 64


def _plan(init: str = "normal") -> ShardPlan:
    return ShardPlan([ParamSpec("w", (4,), "float32")], 1,
                     sparse=[TableSpec("emb", ROWS, DIM, "float32", init)])


def _ids(ids: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    return ("ids:emb", "int64", [len(ids)], ids.numpy().tobytes())


def _vals(values: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    return ("val:emb", "float32", list(values.shape), values.numpy().tobytes())


def _join(peer: Hostile, worker: int, plan: ShardPlan, seed: bool = True) -> None:
    assert peer.hello(worker, plan) == "ok"
    if seed:  # the dense INIT: the plan's owner seeds, the tables are built
        assert peer.code("init", {"worker": worker}, [("w", "float32", [4], _f32(4))]) == "ok"


def _spull(peer: Hostile, worker: int, ids: torch.Tensor, **fields: Any) -> dict[str, Any]:
    return peer.ask("spull", {"worker": worker, **fields}, [_ids(ids)])


def _code(head: dict[str, Any]) -> str:
    return str(head["f"]["code"]) if head["op"] == "error" else "ok"


def test_spull_ids_are_capped_unique_and_need_a_registered_peer(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        pid = cluster.servers[0].popen.pid
        bad = Hostile(address)
        try:
            _join(bad, 1, _plan())
            ok = _spull(bad, 1, torch.arange(8))
            assert _code(ok) == "ok"  # (the tables are built: rows are answered)
            rss0 = _rss(pid)
            # 2^20 copies of one id (8 MiB) asked 2.6 s and +282 MiB of the shard
            head = _spull(bad, 1, torch.zeros(1 << 20, dtype=torch.int64))
            assert _code(head) == "too_large"
            assert "row ids" in head["f"]["reason"]
            # under the cap, repeats are still refused before any row is read
            head = _spull(bad, 1, torch.zeros(MAX_REQUEST_ROWS, dtype=torch.int64))
            assert _code(head) == "bad_tensor"
            assert "unique" in head["f"]["reason"]
            # an observer that never said HELLO, and a SPUSH claiming to be an observer's
            assert _code(_spull(bad, 0, torch.arange(8), observer=True)) == "not_registered"
            push = {"worker": 77, "push_id": 1, "clock": 0, "read_version": 0,
                    "num_samples": 1, "observer": True}
            assert bad.code("spush", push, [_ids(torch.arange(2)),
                                            _vals(torch.zeros(2, DIM))]) == "not_registered"
            grown = _rss(pid) - rss0
            assert grown < 32 * MiB, f"the shard grew by {grown >> 20} MiB"
            watcher = Hostile(address)  # the same read, once it said HELLO as an observer
            try:
                assert watcher.hello(0, _plan(), role="observer") == "ok"
                assert _code(_spull(watcher, 0, torch.arange(8), observer=True)) == "ok"
            finally:
                watcher.close()
            stats = server_stats([address])[0]
            assert "error_internal" not in stats.counters
        finally:
            bad.close()


def _seed_part(peer: Hostile, worker: int, part: int, parts: int,
               table: torch.Tensor) -> dict[str, Any]:
    ids = torch.arange(ROWS)[part::parts].contiguous()
    return peer.ask("sinit", {"worker": worker, "part": part, "parts": parts},
                    [_ids(ids), _vals(table[ids].contiguous())])


def _orphan_and_reseed(address: str, leave: Any) -> None:
    """Worker 1 seeds half the pretrained table, then ``leave(peer)``s; worker 2 seeds
    the whole table and every SPULL reads worker 2's rows."""
    first, second = Hostile(address), Hostile(address)
    try:
        _join(first, 1, _plan("pretrained"), seed=False)
        _join(second, 2, _plan("pretrained"), seed=False)
        mine = torch.full((ROWS, DIM), 1.0)
        theirs = torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM)
        head = _seed_part(first, 1, 0, 2, mine)
        assert _code(head) == "ok" and head["f"]["initialized"] is False
        leave(first)
        for part in range(2):
            head = _seed_part(second, 2, part, 2, theirs)
            assert _code(head) == "ok"
        assert head["f"]["initialized"] is True
        rows = torch.tensor([0, 1, 2, ROWS - 1])
        second.send("spull", {"worker": 2}, [_ids(rows)])
        assert second.sock.poll(20_000), "the shard did not answer"
        answer = decode(second.sock.recv_multipart(copy=False))
        assert answer.op is Op.REPLY
        assert torch.equal(answer.tensors["val:emb"], theirs[rows])
    finally:
        first.close()
        second.close()


def test_a_seeder_that_says_bye_leaves_the_seeding_to_the_next(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        _orphan_and_reseed(address, lambda peer: peer.code("bye", {"worker": 1}) == "ok")


def test_a_seeder_reported_dead_leaves_the_seeding_to_the_next(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        _orphan_and_reseed(address, lambda peer: report_dead([address], 1))


def test_a_seeder_that_times_out_leaves_the_seeding_to_the_next(tmp_path: Path) -> None:
    with _cluster(tmp_path, heartbeat_timeout=2.0) as cluster:
        (address,) = cluster.start_servers()

        def silent(peer: Hostile) -> None:
            # worker 1 says nothing more; worker 2's heartbeats keep it live meanwhile
            watch = Hostile(address)
            try:
                while True:
                    assert watch.code("heartbeat", {"worker": 2}) == "ok"
                    rows = server_stats([address])[0].workers
                    if not rows["1"].live:
                        break
                    assert watch.sock.poll(200) == 0  # paces the polling; nothing arrives
                # (worker 2 may have timed out too on a busy machine: it says HELLO again)
                assert watch.hello(2, _plan("pretrained")) == "ok"
            finally:
                watch.close()

        _orphan_and_reseed(address, silent)
