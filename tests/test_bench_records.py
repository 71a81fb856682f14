"""result.json's records (benchmarks/records.py): written and read back with the file's
keys, in the processes' absence (tests/test_bench.py runs the parts themselves)."""

from __future__ import annotations

import json

import pytest

from paramserver.benchmarks.common import Stats
from paramserver.benchmarks.records import (
    AsyncRow,
    BenchResult,
    Environment,
    Goal,
    HostsResult,
    Link,
    MemoryRow,
    OverlapResult,
    ShmPath,
    SweepRow,
)
from paramserver.benchmarks.report import evaluate_goals, four_shard_share, markdown

_S = Stats.of([0.1, 0.2, 0.3])
_MIB100 = 100 << 20


def _row(system: str, shards: int | None, ratio: Stats | None,
         shm: ShmPath | None = None) -> SweepRow:
    return SweepRow(1, shards, _MIB100, system, _S, _S, (0.1, 0.2, 0.3), _S, shm, ratio)


def _result() -> BenchResult:
    sweep = (_row("raw", 1, None), _row("ps", 1, Stats.of([0.95]), ShmPath(0, 0, 1)),
             _row("rpc", None, Stats.of([0.5])))
    overlap = OverlapResult("cpu", 4, 1, 2, 3, 4, _S, _S, _S, _S, True, 1, 0, 2, 1, 3,
                            1.1, 1.5, 1.4, _S, 1.2)
    return BenchResult(
        sweep=sweep,
        hosts=HostsResult(None, Link("a", "10.0.0.1", "b", "10.0.0.2", "tcp"), sweep[:2], ()),
        async_rows=(AsyncRow(4, 1, 4096, 8, "ps", 6000.0, 6000.0, 1e-4, (1500.0,) * 4, 3.0,
                             5e-5, 0.5),
                    AsyncRow(4, None, 4096, 8, "ray", 900.0, 900.0, 1e-3, (225.0,) * 4, 3.0)),
        memory=(MemoryRow(1, 64 << 20, 0.9, 1, 1, 1, 3, 10, 12, 2, 0.67, 0, 0, None),),
        overlap=overlap, overlap_tcp=None, command="paramserver bench", preset="quick",
        malloc="tuned", started=1.0, seconds=2.0,
        environment=Environment("3.11", "2.13", "26", "4.3", "2.0", 2, "x86_64",
                                (0.1, 0.2, 0.3), (0.2, 0.2, 0.2)))


def test_result_json_round_trips_with_the_files_keys() -> None:
    result = _result()
    doc = json.loads(json.dumps(result.to_json()))
    assert list(doc) == ["command", "preset", "malloc", "started", "environment", "sweep",
                         "hosts", "async", "memory", "overlap", "seconds", "goals"]
    assert list(doc["sweep"][1]) == ["workers", "shards", "bytes", "system", "round_s",
                                     "gbps", "repeats_round_s", "cpu_s", "shm_peers",
                                     "shm_used", "shm_offered", "ratio_to_limit"]
    assert "ratio_to_limit" not in doc["sweep"][0] and "shm_peers" not in doc["sweep"][0]
    assert "shard_busy" not in doc["async"][1] and doc["async"][1]["shards"] is None
    assert doc["hosts"]["link"]["kind"] == "veth" and doc["overlap"]["early_gain"] == 1.2
    assert BenchResult.from_json(doc) == result


def test_goals_from_records_and_back() -> None:
    result = _result()
    goals = evaluate_goals(result)
    by = {g.goal: g for g in goals}
    ps_raw = by["100 MiB, 1 worker, 1 shard: push+pull vs raw pyzmq"]
    assert (ps_raw.measured, ps_raw.status) == (0.95, "met")
    assert by["100 MiB, 1 worker, 1 shard: push+pull vs torch RPC"].measured == \
        pytest.approx(1.9)
    across = by["across hosts (two namespaces, veth): 100 MiB push+pull vs raw pyzmq"]
    assert (across.status, across.detail) == ("met", "over TCP")
    doc = json.loads(json.dumps([g.to_json() for g in goals]))
    assert [Goal.from_json(g) for g in doc] == goals
    text = markdown(result)
    assert "| 1 | 1 | 100MiB | ps |" in text and "Across hosts" in text


def test_a_skipped_part_and_a_missing_one() -> None:
    doc = BenchResult(hosts=HostsResult(skipped="needs root")).to_json()
    assert doc["hosts"] == {"skipped": "needs root"} and "sweep" not in doc
    back = BenchResult.from_json(json.loads(json.dumps(doc)))
    assert back.sweep is None and back.hosts == HostsResult(skipped="needs root")
    with pytest.raises(ValueError, match="workers"):
        SweepRow.from_json({"system": "ps"})


def _async(shards: int, rate: float, cpu_us: float, shard_us: float) -> AsyncRow:
    return AsyncRow(4, shards, 4096, 8, "ps", rate, rate * shards, cpu_us * 1e-6,
                    (rate / 4,) * 4, 3.0, shard_us * 1e-6, 1.0)


def test_the_four_shard_goal_names_what_the_cores_allow() -> None:
    # main's figures on 2 cores: C_s 268 us, C_s + C_w 477 us per model update
    one, four = _async(1, 3817.0, 477.0, 268.0), _async(4, 957.0, 2017.0, 1404.0)
    share, bound = four_shard_share(one, four, 2)
    assert share == pytest.approx(957 / 3817)
    assert bound == pytest.approx(2 * 268 / (4 * 477))  # 0.28: below 0.5 whatever the costs
    assert four_shard_share(one, four, 16)[1] == 1.0  # a core each: no bound below 1
    assert four_shard_share(one, four, None) == (share, None)
    assert four_shard_share(None, four, 2) == (None, None)
    result = BenchResult(async_rows=(one, four), environment=Environment(
        "3.11", "2.13", "26", "4.3", "2.0", 2, "x86_64", (0.1,)))
    goal = {g.goal: g for g in evaluate_goals(result)}[
        "async, 4 shards vs 1 shard (4 workers, 4 KiB)"]
    assert goal.status == "missed" and goal.detail.startswith("at most 0.28x")
    met = evaluate_goals(BenchResult(async_rows=(one, _async(4, 2500.0, 2017.0, 1404.0))))
    assert {g.goal: g.status for g in met}["async, 4 shards vs 1 shard (4 workers, 4 KiB)"] \
        == "met"
