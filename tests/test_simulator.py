"""The virtual-time simulator: its run directory, its rules (the real shard core's), the
published claims it reproduces, and its agreement with real runs of the same configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics

import pytest
import torch
from click.testing import CliRunner

from paramserver.observe.events import read_events
from paramserver.server.loop import ServerConfig
from paramserver.workers.launch.cluster import ClusterResult, ClusterSpec, Progress, run_cluster
from paramserver.workers.launch.virtual import SimSpec, Simulator, run_simulation
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig

# a step's virtual time: 10 ms of compute plus an exponential delay of mean 5 ms (a shifted
# exponential), so that workers drift apart as real ones do
JITTER = StragglerSpec(delay="exp:0.005")


def make_spec(workers=4, mode="async", steps=20, policy="none", policy_args=None, servers=1,
              s=0, b=0, lr=0.1, straggler=JITTER, stragglers=None, seed=0, eval_every=0,
              batch_size=None):
    server = ServerConfig(mode=mode, staleness_bound=s, backup_workers=b, policy=policy,
                          policy_args=dict(policy_args or {}), optimizer_args={"lr": lr},
                          expected_workers=workers)
    worker = WorkerConfig(servers=[], task="digits-mlp", steps=steps, seed=seed,
                          eval_every=eval_every, batch_size=batch_size, straggler=straggler)
    return ClusterSpec(num_servers=servers, num_workers=workers, server=server, worker=worker,
                       stragglers=dict(stragglers or {}))


def steps_of(run_dir, rank):
    return read_events(run_dir / "events" / f"worker{rank}.jsonl", "step")


# ---------------------------------------------------------------- the run directory


def test_run_directory_has_the_layout_and_events_of_a_real_run(tmp_path):
    result = run_simulation(make_spec(workers=3, servers=2, steps=6, eval_every=3), tmp_path)
    for name in ("result.json", "final_model.safetensors", "configs/simulation.json",
                 "events/server0.jsonl", "events/server1.jsonl", "results/worker2.json"):
        assert (tmp_path / name).exists(), name
    written = json.loads((tmp_path / "result.json").read_text())
    assert written == json.loads(json.dumps(result.to_json()))
    assert ClusterResult.from_json(written).to_json() == written  # read back, the same
    assert result.updates_applied == (18, 18) and result.simulated is True
    assert {w.worker: w.steps for w in result.workers} == {0: 6, 1: 6, 2: 6}
    kinds = [e["event"] for e in read_events(tmp_path / "events" / "worker0.jsonl")]
    assert kinds[0] == "worker_start" and kinds[-1] == "worker_end"
    assert kinds.count("step") == 6 and kinds.count("eval") == 3  # clocks 0, 3 and the end
    pushes = read_events(tmp_path / "events" / "server1.jsonl", "push")
    assert len(pushes) == 18 and all(p["accepted"] for p in pushes)
    times = [p["t"] for p in pushes]
    assert times == sorted(times) and 0 < times[-1] == pytest.approx(result.seconds)


def test_a_seed_fixes_the_whole_run(tmp_path):
    spec = make_spec(workers=5, steps=8, straggler=StragglerSpec(slow_prob=0.3, slow_factor=4))
    run_simulation(spec, tmp_path / "a")
    run_simulation(spec, tmp_path / "b")
    for name in ("worker0", "worker4", "server0"):
        a, b = (read_events(tmp_path / run / "events" / f"{name}.jsonl") for run in "ab")
        assert len(a) > 8
        assert [e for e in a if e["event"] != "server_start"] == \
            [e for e in b if e["event"] != "server_start"]  # that one names the directory
    other = dataclasses.replace(spec, worker=dataclasses.replace(spec.worker, seed=1))
    run_simulation(other, tmp_path / "c")
    assert steps_of(tmp_path / "a", 0) != steps_of(tmp_path / "c", 0)


def test_update_counts_follow_the_policy(tmp_path):
    result = run_simulation(make_spec(workers=4, steps=10, policy="reject",
                                      policy_args={"max_staleness": 1}), tmp_path)
    pushes = read_events(tmp_path / "events" / "server0.jsonl", "push")
    accepted = sum(p["accepted"] for p in pushes)
    assert 0 < accepted < 40 and result.updates_applied == (accepted,)
    assert all(p["staleness"] > 1 for p in pushes if not p["accepted"])
    assert sum(w.rejected for w in result.workers) == 40 - accepted


def test_progress_is_reported_in_virtual_time():
    seen: list[Progress] = []
    Simulator(make_spec(workers=4, steps=10), SimSpec(progress_every=10)).run(seen.append)
    assert [p.done_steps for p in seen] == [10, 20, 30, 40]
    assert seen[-1].total_steps == 40 and 0 < seen[0].elapsed < seen[-1].elapsed < 1.0


def test_latency_adds_four_message_times_per_step():
    fixed = StragglerSpec()  # every step takes exactly compute_time
    base = Simulator(make_spec(workers=1, steps=5, straggler=fixed), SimSpec(0.01)).run()
    slow = Simulator(make_spec(workers=1, steps=5, straggler=fixed),
                     SimSpec(0.01, latency=0.002)).run()
    assert base.seconds == pytest.approx(0.05)
    # pull + reply, push + reply per step; the final pull and its reply
    assert slow.seconds == pytest.approx(0.05 + 5 * 4 * 0.002 + 2 * 0.002)


# ---------------------------------------------------------------- the core's rules, simulated


def test_ssp_gap_never_exceeds_the_bound_and_fast_workers_wait(tmp_path):
    spec = make_spec(workers=4, mode="ssp", s=2, steps=15,
                     stragglers={3: StragglerSpec(slowdown=4.0, delay="exp:0.005")})
    result = run_simulation(spec, tmp_path)
    assert result.servers[0]["max_answered_gap"] == 2  # binding, never beyond
    waits = {w.worker: w.wait_seconds for w in result.workers}
    assert min(waits[r] for r in (0, 1, 2)) > 0.1 and waits[3] < 0.05


def test_backup_workers_drop_late_gradients_and_late_workers_move_on(tmp_path):
    spec = make_spec(workers=4, mode="sync", b=1, steps=12,
                     stragglers={3: StragglerSpec(slowdown=3.0, delay="exp:0.005")})
    result = run_simulation(spec, tmp_path)
    slow = steps_of(tmp_path, 3)
    late = [s for s in slow if not s["accepted"]]
    assert len(slow) == 12 and len(late) >= 6  # counted as steps, told "late"
    assert all(s["reasons"] == ["late"] and s["staleness"] >= 1 for s in late)
    reads = [s["read_versions"][0] for s in slow]
    assert reads == sorted(set(reads))  # each step starts from a newer version: it moves on
    server = result.servers[0]["workers"]["3"]
    assert server["rejected"] == {"late": len(late)}
    assert result.updates_applied[0] >= 12  # a round never waits for the straggler
    assert all(w.clock == 12 for w in result.workers)


def test_dc_asgd_with_lambda_zero_is_plain_async_in_the_simulator():
    runs = []
    for policy, args in [("none", {}), ("dc-asgd", {"lam": 0.0}), ("dc-asgd", {"lam": 2.0})]:
        sim = Simulator(make_spec(workers=6, steps=10, servers=2, policy=policy,
                                  policy_args=args))
        result = sim.run()
        runs.append(([core.params[k].clone() for core in sim.cores for k in core.params],
                     result.eval["loss"]))
    (plain, plain_loss), (zero, zero_loss), (dc, _) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, zero, strict=True))
    assert plain_loss == zero_loss
    assert not all(torch.equal(a, b) for a, b in zip(plain, dc, strict=True))


def test_adaptive_bound_loosens_under_transient_stragglers_within_its_range():
    transient = StragglerSpec(min_step_time=0.015, slow_prob=0.1, slow_factor=5.0)
    rates = {}
    for name, policy, args in [("s=1", "none", {}),
                               ("adaptive", "ssp-adaptive", {"s_min": 1, "s_max": 4})]:
        sim = Simulator(make_spec(workers=12, mode="ssp", s=1, steps=40, policy=policy,
                                  policy_args=args, straggler=transient), SimSpec(0.0))
        result = sim.run()
        stats = result.servers[0]
        rates[name] = stats["version"] / result.seconds
        if policy == "ssp-adaptive":
            assert 1 < stats["staleness_bound_max"] <= 4
            assert stats["max_answered_gap"] <= 4
            moves = [(w.before, w.after) for w in sim.cores[0].policy.rule.history]
            assert any(after > before for before, after in moves)
    assert rates["adaptive"] > 1.1 * rates["s=1"]


# ---------------------------------------------------------------- published claims
# Each is checked on two or three seeds; the runs are shared between tests. Total updates
# are held fixed across worker counts (960 = 1 x 960 = 8 x 120 = 32 x 30 = 64 x 15), the
# learning rate is fixed (SGD 0.1), and steps take a shifted-exponential virtual time.

CLAIM_UPDATES = 960


@functools.cache
def final_loss(workers: int, policy: str, seed: int) -> float:
    spec = make_spec(workers=workers, steps=CLAIM_UPDATES // workers, policy=policy, seed=seed)
    return float(Simulator(spec).run().eval["loss"])


@pytest.mark.parametrize("seed", [0, 1])
def test_plain_async_holds_its_loss_to_8_workers_and_degrades_at_32_to_64(seed):
    """Dean et al. 2012; Zhang et al. 2016: with a fixed learning rate, asynchronous SGD
    keeps its loss at a few workers, but staleness ~ workers ruins it at 32-64."""
    one = final_loss(1, "none", seed)
    assert final_loss(8, "none", seed) <= 1.25 * one
    for workers in (32, 64):
        assert final_loss(workers, "none", seed) >= 3 * one


@pytest.mark.parametrize("seed", [0, 1])
def test_gap_aware_beats_staleness_aware_beats_plain_async_at_32_workers(seed):
    """Barkai et al. 2019: at 32+ workers, Gap-Aware < staleness-aware (1/tau) < ASGD."""
    gap, inverse, plain = (final_loss(32, p, seed) for p in ("gap-aware", "inverse", "none"))
    assert gap < inverse < plain
    assert gap < 0.5 * inverse  # by a clear margin, not noise


def test_one_backup_worker_of_8_cuts_time_per_step_by_a_quarter_with_heavy_tails():
    """Chen et al. 2016: with heavy-tailed step times, dropping the slowest of N gradients
    per step shortens the step by far more than it costs."""
    heavy = StragglerSpec(delay="pareto:1.5,0.01")  # infinite variance; mean 30 ms
    ratios = []
    for seed in (0, 1, 2):
        per_step = []
        for b in (0, 1):
            result = Simulator(make_spec(workers=8, mode="sync", b=b, steps=60, seed=seed,
                                         straggler=heavy)).run()
            per_step.append(result.seconds / result.updates_applied[0])
        ratios.append(per_step[1] / per_step[0])
    assert statistics.median(ratios) <= 0.75 and max(ratios) <= 0.8, ratios


# ---------------------------------------------------------------- the command and the report


def test_simulate_command_writes_the_experiment_report(tmp_path):
    from paramserver.cli.simulate import simulate

    out = tmp_path / "exp"
    result = CliRunner().invoke(simulate, [
        "--mode", "async", "--mode", "ssp:1", "--policy", "gap-aware", "--workers", "6",
        "--num-servers", "1", "--steps", "12", "--seeds", "2", "--scenario", "transient",
        "--eval-every", "4", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "report:" in result.output
    exp = json.loads((out / "experiment.json").read_text())
    assert exp["simulated"]["compute_time"] == 0.01
    assert len(exp["runs"]) == 4 and all(r["ok"] for r in exp["runs"])
    report = (out / "report.md").read_text()
    assert "ssp s=1 + gap-aware" in report and (out / "images" / "transient-loss.png").exists()
    for run in exp["runs"]:
        assert (out / run["path"] / "steps.jsonl").exists()
    bad = CliRunner().invoke(simulate, ["--policy", "no-such-policy", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown staleness policy" in bad.output


def test_backup_workers_are_a_mode_of_the_experiment_grid():
    from paramserver.errors import ConfigError
    from paramserver.workers.experiments.spec import ExperimentSpec, ModeChoice

    spec = ExperimentSpec(modes=["sync", "sync:b=1"], workers=[8], scenarios=["none"])
    configs = spec.configurations()
    assert [c.label for c in configs] == ["sync", "sync b=1"]
    assert spec.entry(configs[1]).backups == 1 and configs[1].id == "none-sync-b1-none-w8"
    cluster = spec.cluster_spec(configs[1], seed=0)
    assert cluster.server.mode == "sync" and cluster.server.backup_workers == 1
    assert ModeChoice.parse(str(configs[1].mode)) == configs[1].mode  # spec.toml round trip
    for bad, message in [("async:b=1", "only ssp:S and sync:b=B"), ("sync:b=x", "a count")]:
        with pytest.raises(ConfigError, match=message):
            ModeChoice.parse(bad)
    with pytest.raises(ConfigError, match="fewer than the workers"):
        ExperimentSpec(modes=["sync:b=2"], workers=[2])


# ---------------------------------------------------------------- agreement with real runs
# The simulator's stated tolerance (docs/research.md): in sync mode a simulated run equals
# the real one up to floating-point summation order (relative 1e-5); in async mode, where
# the real interleaving depends on the machine, update counts are equal and held-out loss
# curves agree within 10% at every evaluation; with backup workers, update counts within 15%.


def _compare_events(real_dir, sim_dir):
    """Every event kind both runs wrote has the same fields in both (``server_start``
    describes the process: its address, its metrics endpoint; not compared)."""
    for name in ("worker0", "server0"):
        real = read_events(real_dir / "events" / f"{name}.jsonl")
        sim = read_events(sim_dir / "events" / f"{name}.jsonl")
        real_keys = {e["event"]: set(e) for e in real if e["event"] != "server_start"}
        sim_keys = {e["event"]: set(e) for e in sim if e["event"] != "server_start"}
        assert set(sim_keys) <= set(real_keys), name
        assert {"step", "eval", "push"} & set(sim_keys), name
        for kind, keys in sim_keys.items():
            assert keys == real_keys[kind], (name, kind, keys ^ real_keys[kind])


def _evals(run_dir):
    return [(e["clock"], e["loss"]) for e in read_events(run_dir / "events" / "worker0.jsonl",
                                                          "eval")]


@pytest.mark.integration
def test_sync_real_and_simulated_runs_agree_exactly(tmp_path):
    spec = make_spec(workers=2, servers=2, mode="sync", steps=15, eval_every=5,
                     straggler=StragglerSpec(min_step_time=0.01))
    real = run_cluster(spec, tmp_path / "real")
    sim = run_simulation(spec, tmp_path / "sim", SimSpec(compute_time=0.0))
    assert real.updates_applied == sim.updates_applied == (15, 15)
    assert [c for c, _ in _evals(tmp_path / "real")] == [c for c, _ in _evals(tmp_path / "sim")]
    for (_, a), (_, b) in zip(_evals(tmp_path / "real"), _evals(tmp_path / "sim"), strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    for rank in (0, 1):
        losses = [s["loss"] for s in steps_of(tmp_path / "sim", rank)]
        assert losses == pytest.approx([s["loss"] for s in steps_of(tmp_path / "real", rank)],
                                       rel=1e-5)
    assert sim.eval["loss"] == pytest.approx(real.eval["loss"], rel=1e-5)
    _compare_events(tmp_path / "real", tmp_path / "sim")


@pytest.mark.integration
def test_async_real_and_simulated_runs_agree_within_tolerance(tmp_path):
    # with gap-aware, which also checks that a real shard hands the policy the weights
    # each worker read, as the simulated one does
    spec = make_spec(workers=2, servers=1, mode="async", steps=30, eval_every=10,
                     policy="gap-aware", straggler=StragglerSpec(min_step_time=0.01))
    real = run_cluster(spec, tmp_path / "real")
    sim = run_simulation(spec, tmp_path / "sim", SimSpec(compute_time=0.0))
    assert real.updates_applied == sim.updates_applied == (60,)
    real_evals, sim_evals = _evals(tmp_path / "real"), _evals(tmp_path / "sim")
    assert [c for c, _ in real_evals] == [c for c, _ in sim_evals]
    for (_, a), (_, b) in zip(real_evals, sim_evals, strict=True):
        assert abs(b - a) <= 0.10 * a
    assert abs(sim.eval["loss"] - real.eval["loss"]) <= 0.10 * real.eval["loss"]
    _compare_events(tmp_path / "real", tmp_path / "sim")


@pytest.mark.integration
def test_backup_workers_real_and_simulated_runs_agree(tmp_path):
    spec = make_spec(workers=3, servers=1, mode="sync", b=1, steps=20,
                     straggler=StragglerSpec(min_step_time=0.05),
                     stragglers={2: StragglerSpec(min_step_time=0.05, slowdown=4.0)})
    real = run_cluster(spec, tmp_path / "real")
    sim = run_simulation(spec, tmp_path / "sim", SimSpec(compute_time=0.0))
    versions = real.updates_applied[0], sim.updates_applied[0]
    assert abs(versions[0] - versions[1]) <= 0.15 * versions[1], versions
    for run in ("real", "sim"):
        slow = steps_of(tmp_path / run, 2)
        late = [s for s in slow if s["reasons"] == ["late"]]
        assert len(slow) == 20 and len(late) >= 3, run
        reads = [s["read_versions"][0] for s in slow]
        assert reads == sorted(set(reads)), run  # the late worker moves on every time
        assert all(math.isfinite(w["final_train_loss"]) for w in
                   json.loads((tmp_path / run / "result.json").read_text())["workers"])


def _momentum_loss(workers: int, momentum: float, target: float | None) -> float:
    server = ServerConfig(mode="async", optimizer_args={"lr": 0.05, "momentum": momentum},
                          expected_workers=workers, momentum_target=target)
    worker = WorkerConfig(servers=[], task="digits-mlp", steps=960 // workers, seed=0,
                          eval_every=0, straggler=JITTER)
    spec = ClusterSpec(num_servers=1, num_workers=workers, server=server, worker=worker)
    return float(Simulator(spec).run().eval["loss"])


def test_compensated_momentum_matches_no_momentum_where_plain_momentum_diverges():
    """Mitliagkas et al. 2016: asynchrony adds implicit momentum; lowering the explicit
    momentum to keep the total at 0.9 keeps async training at 8 and 32 workers."""
    for workers in (8, 32):
        none = _momentum_loss(workers, 0.0, None)
        assert _momentum_loss(workers, 0.9, 0.9) <= 1.25 * none
    assert _momentum_loss(32, 0.9, None) >= 0.8 * math.log(10)  # chance: ln 10


def test_a_task_with_sparse_tables_is_refused_before_any_run(tmp_path):
    """The simulator's shards are dense: recsys (ShardedEmbedding) is named and refused
    with exit 2 before a folder is written, and a library call refuses it too."""
    from paramserver.cli.simulate import simulate
    from paramserver.errors import ConfigError

    out = tmp_path / "sim"
    result = CliRunner().invoke(simulate, ["--task", "recsys", "--steps", "2",
                                           "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "row-sparse tables" in result.output and "paramserver experiment" in result.output
    assert not out.exists()
    spec = ClusterSpec(num_servers=1, num_workers=2,
                       worker=WorkerConfig(task="recsys", steps=2))
    with pytest.raises(ConfigError, match="row-sparse"):
        run_simulation(spec, sim=SimSpec())
