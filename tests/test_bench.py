"""The benchmark harness (smoke, tiny payloads) and the paths it measures: push + pull in
one round trip, pushes sent in buckets with a prefetched pull, 16-bit gradients,
the worker's overlap option, and gpu_check's code path on the CPU.

Everything distributed runs in real processes over loopback: shard servers are
benchmark agents (``python -m paramserver.benchmarks.agent``) running a ShardServer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from paramserver.benchmarks.common import (
    Agent,
    Stats,
    close_all,
    format_size,
    parse_size,
    split_range,
    text,
)
from paramserver.benchmarks.extras import run_async, run_async_raw, run_memory, run_overlap
from paramserver.benchmarks.ps import flat_plan
from paramserver.benchmarks.records import BenchResult, SweepRow
from paramserver.benchmarks.report import evaluate_goals, markdown, print_report
from paramserver.benchmarks.suite import Cell, PSVariant, SweepConfig, run_sweep
from paramserver.errors import ConfigError
from paramserver.workers.admin import shutdown_servers
from paramserver.workers.client import PSClient
from paramserver.workers.overlap import BucketPusher, make_buckets
from paramserver.workers.worker import WorkerConfig, run_worker
from tests.agent_shards import sync_shards

LR = 0.05


@pytest.fixture
def servers(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Sync shard servers in agent processes: ``@pytest.mark.parametrize`` the count."""
    with sync_shards(getattr(request, "param", 1), LR, "shard") as addrs:
        yield addrs


@pytest.fixture(scope="module")
def one_shard() -> Iterator[list[str]]:
    """One sync shard for the module's tests of one plan (``flat_plan(5000, 1)``): the
    first INIT seeds it; each test reads the weights it starts from with a pull."""
    with sync_shards(1, LR, "shard") as addrs:
        yield addrs


# ------------------------------------------------------------------ units


def test_stats_sizes_and_ranges() -> None:
    s = Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.lo, s.hi, s.n) == (2.5, 1.0, 10.0, 4)
    assert s.q1 <= s.median <= s.q3
    assert Stats.of([5.0]).spread == 0.0
    with pytest.raises(ValueError):
        Stats.of([])
    assert parse_size("1KiB") == 1024 and parse_size("100MiB") == 100 << 20
    assert parse_size("4 kb") == 4096 and parse_size(4096) == 4096
    with pytest.raises(ConfigError, match="not understood"):
        parse_size("lots")
    with pytest.raises(ConfigError, match="at least one float32"):
        parse_size("2B")
    assert format_size(100 << 20) == "100MiB" and format_size(1536) == "1.5KiB"
    assert split_range(10, 3) == [(0, 4), (4, 7), (7, 10)]


def test_buckets_follow_backward_order_and_size() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 2))
    named = list(model.named_parameters())
    buckets = make_buckets(named, bucket_bytes=64 * 64 * 4)
    # reverse registration order, closing a bucket once it holds >= bucket_bytes
    assert buckets == [["2.bias", "2.weight", "1.bias", "1.weight"], ["0.bias", "0.weight"]]
    assert make_buckets(named, 1) == [[n] for n, _ in reversed(named)]
    with pytest.raises(ConfigError):
        make_buckets(named, 0)


# ------------------------------------------------------------------ correctness


@pytest.mark.integration
@pytest.mark.parametrize("servers", [2], indirect=True)
def test_push_pull_and_stream_are_exact(servers: list[str]) -> None:
    """push_pull and a bucketed PushStream with prefetch each apply exactly one SGD
    step of the pushed gradient, and bring those weights back."""
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 5))
    params = dict(model.named_parameters())
    # 64 KiB chunks: the 240 KB weight is split over both shards
    from paramserver.core.sharding import ShardPlan

    plan = ShardPlan.from_module(model, 2, chunk_bytes=64 << 10)
    assert len(plan.slices) > len(params)
    torch.manual_seed(0)
    w0 = {n: p.detach().clone() for n, p in params.items()}
    g1 = {n: torch.randn_like(p) for n, p in params.items()}
    g2 = {n: torch.randn_like(p) for n, p in params.items()}
    with PSClient(servers, plan, 0, timeout=60) as client:
        clock = client.connect()
        client.initialize(params)
        versions = client.pull(params, clock).versions
        pushed, pulled = client.push_pull(g1, versions, 1, clock, params)
        assert pushed.accepted and all(o.applied for o in pushed.outcomes)
        assert pulled.versions == (1, 1)
        with torch.no_grad():
            for n, p in params.items():
                torch.testing.assert_close(p, w0[n].add(g1[n], alpha=-LR), rtol=0, atol=0)
        w1 = {n: p.detach().clone() for n, p in params.items()}
        buckets = make_buckets(list(params.items()), bucket_bytes=1)  # one per tensor
        stream = client.push_stream(buckets, pulled.versions, 1, clock + 1, prefetch=True)
        for bucket in buckets:
            stream.send({n: g2[n] for n in bucket})
        pushed, pulled2 = stream.finish(params)
        assert pulled2 is not None and pulled2.versions == (2, 2)
        assert pushed.accepted and max(stream.parts) > 1  # really sent in parts
        with torch.no_grad():
            for n, p in params.items():
                torch.testing.assert_close(p, w1[n].add(g2[n], alpha=-LR), rtol=0, atol=0)
        client.bye()


@pytest.mark.integration
@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_16bit_gradients_are_widened_exactly(one_shard: list[str], wire: str) -> None:
    servers = one_shard
    plan = flat_plan(5000, 1)
    torch.manual_seed(2)
    g = torch.randn(5000)
    params = {"w": torch.randn(5000)}
    with PSClient(servers, plan, 0, timeout=60, wire_dtype=wire) as client:
        clock = client.connect()
        client.initialize(params)  # seeds the shard in the module's first test only
        versions = client.pull(params, clock).versions
        w = params["w"].clone()  # the shard's weights
        pushed, _ = client.push_pull({"w": g}, versions, 1, clock, params)
        assert pushed.nbytes == 5000 * 2  # half the bytes of float32 on the wire
        client.bye()
    narrowed = g.to(getattr(torch, wire)).float()
    torch.testing.assert_close(params["w"], w.add(narrowed, alpha=-LR), rtol=0, atol=0)
    assert not torch.equal(narrowed, g)  # the check above would not see a lost narrowing
    with pytest.raises(ConfigError, match="wire_dtype"):
        PSClient(servers, plan, 0, wire_dtype="int8")


def _final_weights(tmp: Path, overlap: bool) -> dict[str, torch.Tensor]:
    agents = [Agent(f"shard{i}") for i in range(1)]
    try:
        for i, a in enumerate(agents):
            a.send("ps_serve", config={"shard": i, "num_shards": 1, "mode": "sync",
                                       "expected_workers": 1, "optimizer": "sgd",
                                       "optimizer_args": {"lr": LR}, "heartbeat_timeout": 60})
        addrs = [text(a.read(60), "address") for a in agents]
        cfg = WorkerConfig(servers=addrs, task="synthetic-mlp", steps=3, push_every=2,
                           task_args={"width": 48, "depth": 2, "samples": 256},
                           batch_size=16, device="cpu", overlap=overlap, bucket_bytes=4096,
                           heartbeat_interval=0, event_log=str(tmp / f"w{overlap}.jsonl"))
        result = run_worker(cfg)
        assert result.steps == 3 and result.rejected == 0
        model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(),
                                    torch.nn.Linear(48, 48), torch.nn.ReLU(),
                                    torch.nn.Linear(48, 1))
        from paramserver.core.sharding import ShardPlan

        params = dict(model.named_parameters())
        with PSClient(addrs, ShardPlan.from_module(model, 1), 0, role="observer",
                      heartbeat_interval=0) as obs:
            obs.connect()
            obs.pull(params)
        shutdown_servers(addrs)
        for a in agents:
            a.read(60)
        return {n: p.detach().clone() for n, p in params.items()}
    finally:
        close_all(agents)


@pytest.mark.integration
def test_worker_overlap_option_trains_like_the_plain_loop(tmp_path: Path) -> None:
    plain = _final_weights(tmp_path, overlap=False)
    overlapped = _final_weights(tmp_path, overlap=True)
    for name, p in plain.items():
        # the same batches and steps; only float rounding of the loss scaling differs
        torch.testing.assert_close(overlapped[name], p, rtol=1e-4, atol=1e-6)
    steps = [json.loads(line) for line in (tmp_path / "wTrue.jsonl").read_text().splitlines()]
    assert sum(1 for e in steps if e["event"] == "step") == 3


def test_bucket_pusher_rejects_misuse() -> None:
    model = torch.nn.Linear(4, 2)
    pusher = BucketPusher(model, 1 << 20)
    with pytest.raises(ConfigError, match="without arm"):
        pusher.flush()
    pusher.close()
    with pytest.raises(ConfigError, match="bucket_bytes"):
        WorkerConfig(servers=["tcp://127.0.0.1:1"], overlap=True, bucket_bytes=0)


# ------------------------------------------------------------------ the harness


@pytest.mark.integration
def test_sweep_smoke_pairs_every_system_with_the_limit() -> None:
    cfg = SweepConfig(cells=[Cell(2, 1, 4096)], systems=("raw", "ps", "gloo"),
                      variants=[PSVariant("ps-lean", server={"watchdog": {"enabled": False}})],
                      repeats=2, repeat_seconds=0.02)
    rows = run_sweep(cfg)
    by = {r.system: r for r in rows}
    assert set(by) == {"raw", "ps-lean", "gloo"}
    for name, r in by.items():
        assert r.workers == 2 and r.bytes == 4096 and r.round_s.n == 2
        assert r.gbps.median > 0 and r.cpu_s is not None and r.cpu_s.median >= 0
        assert (name == "raw") == ("ratio_to_limit" not in r.to_json())
        assert SweepRow.from_json(json.loads(json.dumps(r.to_json()))) == r
    assert by["gloo"].shards is None and by["ps-lean"].shards == 1
    result = BenchResult(sweep=tuple(rows))
    text = markdown(result)
    assert "| 2 | 1 | 4KiB | ps-lean |" in text
    goals = evaluate_goals(result)
    assert {g.status for g in goals} == {"n/a"}  # none of the goal cells was measured
    print_report(result)


@pytest.mark.integration
@pytest.mark.slow
def test_rpc_session_smoke() -> None:
    rows = run_sweep(SweepConfig(cells=[Cell(1, 1, 4096)], systems=("raw", "rpc"),
                                 repeats=2, repeat_seconds=0.02))
    assert [r.system for r in rows] == ["raw", "rpc"]
    ratio = rows[1].ratio_to_limit
    assert ratio is not None and ratio.median > 0


@pytest.mark.integration
@pytest.mark.slow
def test_async_memory_and_overlap_smoke() -> None:
    asy = run_async(workers=2, shards=(2,), nbytes=4096, pieces=4, seconds=0.3)
    assert asy[0].model_updates_per_s > 0 and asy[0].shards == 2
    shard_cpu = asy[0].shard_cpu_s_per_model_update
    assert shard_cpu is not None and 0 < shard_cpu < asy[0].cpu_s_per_model_update
    assert asy[0].shard_busy is not None and asy[0].shard_busy > 0
    raw = run_async_raw(workers=2, seconds=0.3)  # the limit, a step per push
    assert raw.system == "raw" and len(raw.worker_pushes_per_s) == 2
    assert min(raw.worker_pushes_per_s) > 0 and raw.cpu_s_per_model_update > 0
    mem = run_memory(workers=(1,), nbytes=1 << 20, rounds=2)
    # SGD with momentum: one buffer of state, plus one aggregation buffer
    assert mem[0].expected_bytes == 3 * (1 << 20)
    assert mem[0].peak_rss >= mem[0].rss_base
    ov = run_overlap(width=64, depth=2, batch=8, steps=1, repeats=2, bucket_bytes=8192)
    assert ov.buckets > 1 and not ov.tcp and "overlap_late" not in ov.to_json()
    for stats in (ov.compute, ov.comm, ov.sequential, ov.overlap):
        assert stats.median > 0
    tcp = run_overlap(width=64, depth=2, batch=8, steps=1, repeats=2, bucket_bytes=8192,
                      tcp=True)
    assert tcp.tcp and tcp.overlap_late is not None and tcp.overlap_late.median > 0
    assert tcp.early_gain is not None and tcp.early_gain > 0
    # each round took its early weights, or none came: never more answers than rounds
    assert 0 <= tcp.early_answers <= tcp.rounds_ahead
    result = BenchResult(async_rows=(*asy, raw), memory=tuple(mem), overlap=ov,
                         overlap_tcp=tcp)
    assert BenchResult.from_json(json.loads(json.dumps(result.to_json()))) == result


@pytest.mark.integration
def test_bench_command_writes_json(tmp_path: Path) -> None:
    from paramserver.cli.bench import bench

    out = tmp_path / "bench"
    res = CliRunner().invoke(bench, [
        "--out", str(out), "--quick", "--part", "sweep", "--system", "ps", "--size", "1KiB",
        "--workers", "1", "--shards", "1", "--repeats", "2", "--wire-dtype", "none",
    ])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "result.json").read_text())
    assert [r["system"] for r in data["sweep"]] == ["raw", "ps"]
    assert any(g["goal"].startswith("1 KiB") and g["status"] != "n/a" for g in data["goals"])
    bad = CliRunner().invoke(bench, ["--quick", "--full"])
    assert bad.exit_code != 0 and "exclude" in bad.output


@pytest.mark.integration
def test_gpu_check_code_path_on_cpu(tmp_path: Path) -> None:
    from paramserver.benchmarks.gpu_check import main

    out = tmp_path / "gpu.json"
    assert main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["wire_dtype"] for r in data["round_trip"]] == ["float32", "bfloat16"]
    assert all(r["ok"] for r in data["round_trip"])
    assert data["copy"]["pageable_gbps"] > 0 and "pinned_gbps" not in data["copy"]
    assert data["overlap"]["buckets"] >= 1


def test_hotpath_times_applied_pushes_warm_and_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    from paramserver.benchmarks import hotpath

    monkeypatch.setenv("PARAMSERVER_SHM", "0")
    for case in hotpath.CASES:
        r = hotpath.measure(case, pushes=20, repeats=2, thrash_mib=1)
        assert r.case == case and r.pushes == 20
        for t in (r.warm, r.cold):
            assert 0 < t.min_us <= t.median_us <= t.max_us


def test_hotpath_refuses_to_time_refused_pushes(monkeypatch: pytest.MonkeyPatch) -> None:
    from paramserver.benchmarks import hotpath

    monkeypatch.setenv("PARAMSERVER_SHM", "0")
    monkeypatch.setattr(hotpath, "_requests", lambda server, session, count: [
        [b"\x00not msgpack"] for _ in range(count)])
    with pytest.raises(RuntimeError, match="refused"):
        hotpath.measure("sync-1", pushes=5, repeats=1, thrash_mib=1)


def test_breakdown_parts_add_up_to_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from paramserver.benchmarks import breakdown

    monkeypatch.setenv("PARAMSERVER_SHM", "0")
    for b in (breakdown.measure_shard(pushes=20, repeats=1, thrash_mib=1),
              breakdown.measure_worker(rounds=20, repeats=1, thrash_mib=1)):
        names = [p.name for p in b.parts]
        # the worker's whole rounds, timed before any part is wrapped
        assert (b.unwrapped is None) == (b.side == "shard")
        assert b.unwrapped is None or b.unwrapped > 0
        for figures in (b.warm, b.cold):
            assert sorted(figures) == sorted(names)
            # each part is its own time, the parts inside it taken out: none below zero
            assert all(v >= 0 for v in figures.values()), figures
            assert all(figures[n] > 0 for n in ("decode", "step" if b.side == "shard"
                                                 else "land"))
