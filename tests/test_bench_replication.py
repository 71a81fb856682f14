"""The bench's replication part, quick: real shard processes (a primary and its backup),
paired round trips with and without ``--replicas 1``, and one failover from a SIGKILL."""

from __future__ import annotations

import json
import statistics

import pytest

from paramserver.benchmarks.records import BenchResult
from paramserver.benchmarks.replication import ReplicationResult, run_replication
from paramserver.benchmarks.report import evaluate_goals, print_report
from paramserver.shm.link import enabled as shm_enabled

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def measured() -> ReplicationResult:
    return run_replication((1024, 64 << 10), repeats=2, repeat_seconds=0.02, kills=1,
                           failover_timeout=0.5)


def test_costs_are_paired_ratios_of_real_round_trips(measured: ReplicationResult) -> None:
    row, large = measured.costs
    assert (row.bytes, large.bytes) == (1024, 64 << 10) and measured.repeats == 2
    without, tcp, with_replica = row.repeats
    assert len(without) == len(tcp) == len(with_replica) == 2
    assert all(0 < t < 1.0 for t in (*without, *tcp, *with_replica))
    assert row.with_replica.median == statistics.median(with_replica)
    # each ratio pairs the repeats that ran back to back, not the medians
    assert row.ratio.median == pytest.approx(
        statistics.median(a / b for a, b in zip(with_replica, without, strict=True)))
    assert row.ratio_tcp.median == pytest.approx(
        statistics.median(a / b for a, b in zip(with_replica, tcp, strict=True)))
    assert not row.shm_used  # 1 KiB is below the size that takes shared memory
    assert not row.replica_shm_used
    # 64 KiB takes it, with a backup too: the primary forwards what it read there
    assert large.shm_used == large.replica_shm_used == shm_enabled()


def test_failover_is_timed_from_the_kill_to_the_next_acknowledged_step(
        measured: ReplicationResult) -> None:
    fo = measured.failover
    assert fo is not None and len(fo.seconds) == 1 and fo.moves == 1
    assert fo.failover_timeout == 0.5
    # (run_replication checked that the new primary's weights were bit-identical)
    assert fo.shm_used == shm_enabled()
    # the backup waits out the timeout after the primary's last word (sent just
    # before the kill): a figure below it would not be a failover
    assert 0.4 < fo.seconds[0] < 10.0 and fo.median == fo.max == fo.seconds[0]


def test_the_part_round_trips_through_result_json_and_checks_its_goals(
        measured: ReplicationResult) -> None:
    result = BenchResult(replication=measured)
    back = BenchResult.from_json(json.loads(json.dumps(result.to_json())))
    assert back == result
    goals = {g.goal: g for g in evaluate_goals(result)}
    cost = goals["100 MiB push+pull with --replicas 1 vs without"]
    assert cost.status == "n/a"  # 100 MiB was not measured
    fo = goals["failover: primary SIGKILLed to the first step its backup acknowledged"]
    assert fo.status != "n/a" and fo.measured == measured.failover.max  # type: ignore[union-attr]
    print_report(result)
