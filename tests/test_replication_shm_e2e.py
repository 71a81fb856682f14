"""Replicated shards with same-host shared memory, over real processes: the primary
forwards what its workers lent it through their segments as frames, so a sync run whose
primary is SIGKILLed mid-run, and then, once the launcher's replacement rejoined as a
backup (taking inputs forwarded while it joined, which no one waits for), the new primary
too, ends bit-identical to the run without replicas or failure; the workers register
their segments again with each new primary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from safetensors.torch import load_file

from paramserver.shm.link import MIN_BYTES
from paramserver.shm.link import enabled as shm_enabled
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.launch.results import ClusterResult
from tests.test_replication_e2e import _failovers, _joined, _run_killing_primary_twice
from tests.test_replication_e2e import _spec as _base_spec

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not shm_enabled(), reason="shared memory is off here")]


def _spec(replicas: int, step_time: float) -> ClusterSpec:
    # one shard of digits-mlp with 512 hidden units: 150 KiB, above shared memory's minimum
    spec = _base_spec("sync", 1, 2, 60, step_time, replicas)
    return dataclasses.replace(spec, worker=dataclasses.replace(
        spec.worker, task_args={"hidden": 512}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, Path, ClusterResult, list[str]]:
    plain = tmp_path_factory.mktemp("shm-plain")
    run_cluster(_spec(0, 0.0), plain)  # unpaced: a sync round's sum has a fixed order
    failed = tmp_path_factory.mktemp("shm-failover")
    # paced, so that both kills land mid-run
    result, killed = _run_killing_primary_twice(_spec(1, 0.06), failed, 15)
    return plain, failed, result, killed


def test_sync_failover_through_shared_memory_ends_bit_identical(runs):
    plain, failed, result, killed = runs
    assert killed == ["server0", "server0r1"], "the run ended before the second kill"
    assert len(_joined(failed, "server0r1")) == 1  # server0's replacement joined
    (second,) = _failovers(failed, "server0")  # and took over from server0r1
    assert second["epoch"] == 2
    assert result.restarts == () and result.updates_applied == (60,)
    first = load_file(plain / "final_model.safetensors")
    second = load_file(failed / "final_model.safetensors")
    assert sum(t.numel() * t.element_size() for t in first.values()) >= MIN_BYTES
    assert first.keys() == second.keys()
    for key in first:
        assert first[key].equal(second[key]), key


def test_workers_pushed_through_shared_memory_before_and_after_the_failover(runs):
    _, failed, _, _ = runs
    # a worker whose pushes lay in its segment is told the new primary does not know it
    # yet, says HELLO again and proves it (the run above then ended bit-identical)
    for rank in (0, 1):
        log = (failed / "logs" / f"worker{rank}.log").read_text()
        assert "no shared-memory segment for this connection" in log, rank
