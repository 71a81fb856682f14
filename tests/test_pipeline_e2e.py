"""Sync rounds of several workers pipelined per part (issue 45, item 2), over real
shard processes: with early weights a slice whose sum over every worker is final
goes back while later parts still travel, and the training ends bit-identical to
the whole-round path (each round summed by worker id either way)."""

from __future__ import annotations

import threading

import pytest
import torch

from paramserver.core.sharding import ShardPlan
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from tests.agent_shards import sync_shards

LR = 0.1
WORKERS = 3
ROUNDS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 32),
                               torch.nn.Linear(32, 8))


def _worker(addresses: list[str], rank: int, early: bool, model: torch.nn.Module,
            out: dict[int, dict[str, torch.Tensor] | BaseException]) -> None:
    try:
        params = dict(model.named_parameters())
        plan = ShardPlan.from_module(model, len(addresses), chunk_bytes=1 << 12)
        # parts of at most 4 KiB: several per shard each round
        with PSClient(addresses, plan, rank, timeout=60, shm=False, part_bytes=1 << 12,
                      early_parts=early) as client:
            clock = client.connect()
            if rank == 0:
                client.initialize(params)
            versions = client.pull(params, clock, wait_init=True).versions
            for step in range(ROUNDS):
                gen = torch.Generator().manual_seed(100 * rank + step)
                grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
                pushed, pulled = client.push_pull(grads, versions, rank + 1, clock + step,
                                                  params)
                assert pushed.accepted, pushed.reasons
                versions = pulled.versions
            assert versions == tuple([ROUNDS] * len(addresses))
            client.bye()
        out[rank] = {n: p.detach().clone() for n, p in params.items()}
    except BaseException as exc:  # reported by the test's thread
        out[rank] = exc


def _train(early: bool) -> tuple[dict[int, dict[str, torch.Tensor]], list[dict[str, int]]]:
    with sync_shards(1, LR, "pipe", workers=WORKERS) as addresses:
        out: dict[int, dict[str, torch.Tensor] | BaseException] = {}
        # the models are made here: torch's global seed is not the threads' own
        threads = [threading.Thread(target=_worker, args=(addresses, r, early, _model(), out))
                   for r in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = server_stats(addresses)
    for rank in range(WORKERS):
        got = out.get(rank)
        if isinstance(got, BaseException):
            raise got
        assert got is not None, f"worker {rank} did not finish"
    return out, [s.counters for s in stats]  # type: ignore[return-value]


@pytest.mark.integration
def test_pipelined_parts_end_bit_identical_to_whole_rounds() -> None:
    whole, counters = _train(early=False)
    assert all(c.get("early_parts", 0) == 0 for c in counters), counters
    piped, counters = _train(early=True)
    # slices went back before their rounds closed, and answers were made of them
    assert sum(c.get("early_parts", 0) for c in counters) > 0, counters
    assert sum(c.get("early_answers", 0) for c in counters) > 0, counters
    for rank in range(WORKERS):
        for name, p in whole[0].items():
            assert torch.equal(piped[rank][name], p), (rank, name)
            assert torch.equal(whole[rank][name], p), (rank, name)
