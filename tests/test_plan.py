"""``paramserver plan``: the fit on synthetic logs (pure), the simulator under a fitted
model of time, and one real run fitted and predicted end to end through the CLI."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from paramserver.cli.main import main
from paramserver.errors import ConfigError
from paramserver.server.config import ServerConfig
from paramserver.workers.config import WorkerConfig
from paramserver.workers.experiments.planfit import (
    PER_STEP_MESSAGES,
    Fit,
    LinkFit,
    RunRecord,
    StepRow,
    compute_times,
    family,
    fit_link,
    fit_runs,
    fit_service,
    nonnegative,
    round_extras,
    wire_samples,
)
from paramserver.workers.experiments.planner import (
    Range,
    Target,
    configure,
    estimate_round,
    parse_plan_mode,
)
from paramserver.workers.launch.cluster import ClusterSpec
from paramserver.workers.launch.simtiming import Links, Timing
from paramserver.workers.launch.virtual import Simulator
from paramserver.workers.stragglers import StragglerSpec

# ---------------------------------------------------------------- the fit, on synthetic logs


def rows(compute, wire, *, nbytes=1000, sleep=0.0, wait=0.0, local_steps=1, extra=0.0):
    """Step records of a worker whose steps take ``compute`` (plus ``sleep`` injected and
    ``extra`` besides) off the wire and ``wire`` on it (plus ``wait`` held at a barrier),
    as a real worker logs them."""
    t, out = 0.0, []
    for c, w in zip(compute, wire, strict=True):
        t += c + sleep + extra + w + wait
        out.append(StepRow(t=t, compute_s=c, sleep_s=sleep, pull_s=w + wait, push_s=w + wait,
                           wait_s=wait, bytes=nbytes, local_steps=local_steps))
    return out


def test_compute_and_overhead_are_the_time_off_the_wire_without_injected_sleep():
    got = compute_times(rows([9.0, 0.010, 0.020, 0.030], [0.002] * 4, sleep=0.005, wait=0.1,
                             extra=0.001))
    assert got == [pytest.approx((c, 0.001)) for c in (0.010, 0.020, 0.030)]  # first: out


def test_compute_of_a_local_sgd_push_is_per_gradient():
    got = compute_times(rows([1.0, 0.08, 0.04], [0.001] * 3, local_steps=4))
    assert got == [pytest.approx((0.02, 0.0)), pytest.approx((0.01, 0.0))]


def test_wire_time_leaves_out_the_barrier_wait():
    got = wire_samples(rows([0.01] * 3, [0.002, 0.003, 0.004], nbytes=500, wait=0.05))
    assert got == [(500, pytest.approx(0.003)), (500, pytest.approx(0.004))]
    rated = wire_samples(rows([0.01] * 2, [0.002] * 2, nbytes=500), nominal_per_byte=1e-6)
    assert rated == [(pytest.approx(5e-4), pytest.approx(0.002))]  # x: seconds at the rate


def test_link_fit_recovers_per_step_and_per_byte_costs_from_two_sizes():
    samples = [(n, 0.001 + 2e-8 * n) for n in (1000, 50_000) for _ in range(5)]
    fit = fit_link(samples)
    assert fit.identified and not fit.rated
    assert fit.per_step == pytest.approx(0.001) and fit.per_byte(0.0) == pytest.approx(2e-8)



def test_link_fit_on_emulated_hosts_or_with_one_size_keeps_the_mean_per_step():
    fit = fit_link([(0.002, 0.004), (0.01, 0.006)], rated=True)  # the NICs' own: calibrated
    assert fit.rated and not fit.identified
    assert fit.slope == 1.0 and fit.per_step == pytest.approx(0.005)
    assert fit.per_byte(1e-7) == pytest.approx(1e-7)
    loopback = fit_link([(40_000, 0.004), (40_000, 0.006)])
    assert loopback.per_byte(0.0) == 0.0 and loopback.per_step == pytest.approx(0.005)
    with pytest.raises(ConfigError, match="no wire times"):
        fit_link([])


def test_service_time_is_the_gap_between_back_to_back_decisions():
    rng = random.Random(0)
    t, times = 0.0, []
    for i in range(200):  # idle gaps, and every 4th push queued behind the one before
        t += 0.0005 if i % 4 == 0 else rng.uniform(0.002, 0.01)
        times.append(t)
    assert fit_service(times) == pytest.approx(0.0005)
    assert fit_service(times, per_step=0.0001) == 0.0001
    assert fit_service([1.0]) == 0.0


def test_fit_runs_and_the_timing_it_gives_the_simulator(tmp_path):
    run = RunRecord(tmp_path, {"hosts": "2+1", "link": "80mbit"},  # 1e-7 s per byte
                    {0: rows([1.0] + [0.010] * 4, [0.002] * 5, nbytes=10_000),
                     1: rows([1.0] + [0.030] * 4, [0.002] * 5, nbytes=10_000)},
                    {0: [0.0, 0.0001, 0.0002]})
    fit = fit_runs([run])
    assert fit.compute == {0: [pytest.approx((0.01, 0.0))] * 4,
                           1: [pytest.approx((0.03, 0.0))] * 4}
    # on emulated hosts the bytes pass the NICs' buckets; the mean wire time is per step
    # until calibrated
    assert fit.link.rated and fit.link.per_byte(fit.nominal_per_byte) == pytest.approx(1e-7)
    assert fit.per_step("sync") == fit.per_step("async") == pytest.approx(0.002)
    assert fit.service == pytest.approx(0.0001)
    timing = fit.timing(link_per_byte=4e-7, per_byte_of={3: 8e-7})
    assert timing.per_byte == 4e-7 and timing.per_byte_of == {3: 8e-7}
    assert timing.per_message == pytest.approx((0.002 - 0.0001) / PER_STEP_MESSAGES)
    assert timing.burst_floor > 0 and timing.burst_seconds > 0  # as tc shapes them
    assert fit.timing().per_byte == pytest.approx(1e-7)
    calibrated = replace(fit, calibration={"sync": 0.003})  # a family without: the other's
    assert calibrated.per_step("async") == calibrated.per_step("sync") == pytest.approx(0.005)
    again = fit.resample(random.Random(1))
    assert set(again.compute) == {0, 1} and len(again.wire) == len(fit.wire)
    with pytest.raises(ConfigError, match="at least one run"):
        fit_runs([])
    loopback = RunRecord(tmp_path, {}, run.steps, {})
    with pytest.raises(ConfigError, match="not both"):
        fit_runs([run, loopback])


def mode_spec(mode: str, local: bool = False) -> dict:
    """result.json's spec, as much of it as the fit reads: the mode."""
    return {"server": {"mode": mode},
            "worker": {"local_optimizer": "sgd" if local else None}}


def test_a_local_sgd_round_s_own_cost_is_what_its_pushes_spent_beyond_a_plain_push():
    # plain pushes: 0.5 ms overhead each; a local:4 push: 0.5 ms + 6 ms of its own
    plain = rows([1.0] + [0.010] * 6, [0.002] * 7, extra=0.0005)
    local = rows([1.0] + [0.040] * 6, [0.003] * 7, extra=0.0005 + 0.006, local_steps=4)
    assert round_extras(local, 0.0005) == [pytest.approx(0.006)] * 6
    assert round_extras(local, 0.0075) == [pytest.approx(-0.001)] * 6  # noise: kept
    assert nonnegative([-0.001, 0.003]) == [0.0, pytest.approx(0.002)]  # the mean kept
    assert nonnegative([-0.002, 0.001]) == [0.0, 0.0]
    assert family("sync") == "sync" and family("sync", local=True) == "local"
    assert family("ssp") == "ssp" and family("async") == "async"
    runs = [RunRecord(Path("a"), mode_spec("async"), {0: plain, 1: plain}, {}),
            RunRecord(Path("l"), mode_spec("sync", local=True), {0: local, 1: local}, {})]
    fit = fit_runs(runs)
    assert fit.families == ("async", "local")
    assert fit.round_extra == [pytest.approx(0.006)] * 12
    # compute from the plain steps only: the local run's would hide the round's cost
    assert fit.compute == {0: [pytest.approx((0.01, 0.0005))] * 6,
                           1: [pytest.approx((0.01, 0.0005))] * 6}
    assert fit.timing(family="local").round_extra == fit.round_extra
    assert fit.timing(family="local", round_extra=[0.001]).round_extra == [0.001]
    assert fit.summary()["local_round_ms"]["mean"] == pytest.approx(6.0)
    # a local-SGD run alone: its round's cost is in its steps' overhead, none apart
    alone = fit_runs(runs[1:])
    assert alone.round_extra == [0.0]
    assert alone.compute[0] == [pytest.approx((0.01, 0.0065))] * 6  # per push
    assert fit_runs(runs[:1]).round_extra == []  # none fitted: the planner estimates it


def test_a_family_without_a_fitted_run_takes_the_nearest_calibrated_one():
    fit = Fit(compute={0: [(0.01, 0.0)]}, link=LinkFit(0.001, 0.0, False, 10), service=0.0,
              calibration={"async": 0.001, "sync": 0.004})
    assert [fit.source(f) for f in ("sync", "local", "async", "ssp")] == \
        ["sync", "sync", "async", "async"]
    assert fit.per_step("local") == pytest.approx(0.005)
    assert fit.per_step("ssp") == pytest.approx(0.002)
    ssp = replace(fit, calibration={**fit.calibration, "ssp": 0.003})
    assert ssp.per_step("ssp") == pytest.approx(0.004) and ssp.source("async") == "async"
    assert Fit(compute=fit.compute, link=fit.link, service=0.0).per_step("ssp") == 0.001


def test_a_local_sgd_round_is_timed_in_process_where_no_run_showed_it():
    base = spec(steps=8)
    local = configure(base, parse_plan_mode("local:4"), Target())
    (took,) = estimate_round(local, rounds=3)  # the median of 3
    assert 0 < took < 1.0


def test_a_new_rate_replaces_the_fitted_links():
    fit = Fit(compute={0: [(0.01, 0.0)]}, link=LinkFit(0.0, 1.0, False, 10, rated=True),
              service=0.0, nominal_per_byte=1e-7)
    timing = fit.timing(link_per_byte=5e-7, per_byte_of={2: 1e-6})
    assert timing.per_byte == pytest.approx(5e-7) and timing.per_byte_of == {2: 1e-6}
    assert fit.timing().per_byte == pytest.approx(1e-7)
    loopback = Fit(compute={0: [(0.01, 0.0)]}, link=LinkFit(0.001, 2e-9, True, 10),
                   service=0.0)
    assert loopback.timing().per_byte == 2e-9
    assert loopback.timing(link_per_byte=5e-7).per_byte == 5e-7
    assert loopback.timing().burst_floor == 0.0  # a plain NIC: no bucket


def test_a_nic_sends_one_message_at_a_time_at_the_slower_end_s_rate():
    links = Links(Timing({0: [0.01]}, per_message=0.001, per_byte=1e-6,
                         per_byte_of={1: 2e-6}))
    assert links.arrival(0.0, 0, 2, 1000) == pytest.approx(0.001 + 0.001)
    assert links.arrival(0.0, 0, 2, 1000) == pytest.approx(0.002 + 0.001)  # queued behind
    assert links.arrival(0.0, 1, 3, 1000) == pytest.approx(0.002 + 0.001)  # host 1 is slower


def test_a_shaped_nic_passes_a_burst_at_once_then_its_rate():
    # 1e-6 s per byte (1 MB/s) and a bucket of 1500 bytes, full at the start
    links = Links(Timing({0: [0.01]}, per_byte=1e-6, burst_floor=1500))
    assert links.arrival(0.0, 0, 1, 1000) == 0.0  # within the burst
    assert links.arrival(0.0, 0, 1, 1000) == pytest.approx(0.0005)  # 500 left: 500 to wait
    assert links.arrival(1.0, 0, 1, 1000) == 1.0  # refilled meanwhile
    assert Timing({0: [0.01]}, per_byte=1e-6, burst_seconds=0.004).burst(0) == \
        pytest.approx(4000)
    with pytest.raises(ConfigError, match="at least one measured"):
        Timing({0: []})
    with pytest.raises(ConfigError, match="2 overheads for 1 compute"):
        Timing({0: [0.01]}, overhead={0: [0.0, 0.0]})


def test_parse_plan_mode_and_ranges():
    assert parse_plan_mode("ssp:3").bound == 3
    local, diloco = parse_plan_mode("local:4"), parse_plan_mode("diloco:8")
    assert (local.mode, local.sync_every, local.outer) == ("sync", 4, None)
    assert diloco.sync_every == 8 and diloco.outer is not None
    for bad in ("local:x", "diloco:0", "bogus", "sync:h=4"):
        with pytest.raises(ConfigError):
            parse_plan_mode(bad)
    r = Range.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert r is not None and (r.low, r.mid, r.high) == pytest.approx((1.4, 3.0, 4.6))
    assert Range.of([]) is None


# ---------------------------------------------------------------- the simulator, timed by a fit


def spec(workers=2, mode="async", steps=5, straggler=None):
    server = ServerConfig(mode=mode, optimizer_args={"lr": 0.1}, expected_workers=workers)
    worker = WorkerConfig(servers=[], task="digits-mlp", steps=steps,
                          straggler=straggler or StragglerSpec())
    return ClusterSpec(num_servers=1, num_workers=workers, server=server, worker=worker)


def test_a_fitted_timing_sets_each_worker_s_step_time():
    # rank 1's overhead is not padded by --min-step-time (0.005), its compute is
    timing = Timing({0: [0.03], 1: [0.004]}, overhead={1: [0.005]}, per_message=0.001)
    result = Simulator(spec(straggler=StragglerSpec(min_step_time=0.005)), timing=timing).run()
    ends = {w.worker: w.seconds for w in result.workers}
    # 5 steps of compute + 4 messages each, and the final pull's two messages (rank 0
    # evaluates: its result comes at the end of the run)
    assert ends[1] == pytest.approx(5 * (0.01 + 0.004) + 0.002)
    assert result.seconds == pytest.approx(5 * (0.03 + 0.004) + 0.002)


def test_a_local_sgd_push_costs_its_round_s_own_time_in_the_simulator():
    local = configure(spec(workers=1, steps=8), parse_plan_mode("local:4"), Target())
    bare = Simulator(local, timing=Timing({0: [0.01]})).run().seconds
    rounds = Simulator(local, timing=Timing({0: [0.01]}, round_extra=[0.005])).run().seconds
    assert rounds == pytest.approx(bare + 2 * 0.005)  # 8 steps: 2 pushes of 4
    # the overhead is a push's: once per round, not per inner step
    kept = Simulator(local, timing=Timing({0: [0.01]}, overhead={0: [0.002]})).run().seconds
    assert kept == pytest.approx(bare + 2 * 0.002)
    with pytest.raises(ConfigError, match="round_extra must be >= 0"):
        Timing({0: [0.01]}, round_extra=[-1.0])


def test_bytes_and_a_busy_shard_cost_time_in_the_simulator():
    free = Simulator(spec(workers=1), timing=Timing({0: [0.01]})).run().seconds
    nic = Simulator(spec(workers=1), timing=Timing({0: [0.01]}, per_byte=1e-7)).run().seconds
    nbytes = Simulator(spec(workers=1)).plan.shard_bytes(0)
    assert nic == pytest.approx(free + 5 * 2 * nbytes * 1e-7 + nbytes * 1e-7)
    # in sync, 4 pushes reach the shard at once: the last is decided 4 service times later
    served = Simulator(spec(workers=4, mode="sync"), timing=Timing({0: [0.01]}, service=0.002))
    assert served.run().seconds == pytest.approx(5 * (0.01 + 4 * 0.002))


# ---------------------------------------------------------------- the command, on a real run


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A small real run with held-out evaluations: 2 async workers, one shard."""
    out = tmp_path_factory.mktemp("plan") / "fit"
    subprocess.run([sys.executable, "-m", "paramserver.cli", "launch", "--num-servers", "1",
                    "--num-workers", "2", "--mode", "async", "--steps", "40",
                    "--eval-every", "5", "--out", str(out), "--quiet"],
                   check=True, timeout=300, capture_output=True)
    return out


def plan(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def test_plan_fits_a_real_run_and_predicts_each_mode(real_run):
    got = plan("--from", str(real_run), "--workers", "3", "--mode", "sync,async",
               "--target-loss", "2.0", "--draws", "2", "--json")
    assert got.exit_code == 0, got.output
    out = json.loads(got.output)
    assert set(out["ranking"]) == {"sync", "async"} and out["workers"] == 3
    assert out["ties"] in ([], [out["ranking"]])
    for mode in out["modes"].values():
        t = mode["time_to_target_s"]
        assert mode["reached"] == 2 and 0 < t["low"] <= t["mid"] <= t["high"]
        assert mode["bytes_to_target"]["mid"] > 0
    (check,) = out["fitted_runs"]
    assert check["mode"] == "async" and check["workers"] == 2 and check["measured_s"] > 0
    assert check["error"] == pytest.approx(
        (check["time_to_target_s"]["mid"] - check["measured_s"]) / check["measured_s"])
    assert out["fit"]["compute_ms_pooled"]["n"] == 2 * 39
    assert out["local_round"] == {} and out["fit"]["fitted_families"] == ["async"]
    assert out["fit"]["link"]["per_step_from"] == {"sync": "async", "local": "async",
                                                   "async": "async", "ssp": "async"}
    assert check["measured_wait_ms_per_push"] >= 0 and mode["wait_ms_per_push"] >= 0
    table = plan("--from", str(real_run), "--mode", "async,local:2", "--target-loss", "2.0",
                 "--draws", "1", "--compression", "int8")
    assert table.exit_code == 0, table.output
    assert "in-sample" in table.output and "time to held-out loss 2" in table.output
    said = " ".join(table.output.split())  # (rich wraps long lines at spaces)
    assert "local:2: " in said and "besides its steps (estimated in-process)" in said
    assert "per sync step (async's: no sync run fitted)" in said


def test_plan_says_in_one_line_what_is_wrong(real_run, tmp_path):
    (tmp_path / "empty").mkdir()
    # a run whose result.json names a plug-in task: code to import, not imported untrusted
    named = tmp_path / "named"
    shutil.copytree(real_run, named)
    result = json.loads((named / "result.json").read_text())
    result["spec"]["worker"]["task"] = "tests.plugin_probe:make_task"
    (named / "result.json").write_text(json.dumps(result))
    got = plan("--from", str(named), "--target-loss", "1", "--trust-plugins")
    # a step event whose field has the wrong type; lines that are not JSON objects
    damaged = tmp_path / "damaged"
    shutil.copytree(real_run, damaged)
    log = damaged / "events" / "worker0.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    next(r for r in rows if r["event"] == "step")["compute_s"] = "slow"
    log.write_text("[1, 2]\n" + "\n".join(json.dumps(r) for r in rows) + "\n\xff\n")
    assert "plugin_probe.py was imported" in got.output, got.output  # trusted: imported
    cases = [
        (["--from", str(tmp_path / "empty"), "--target-loss", "1"], "not a finished run"),
        (["--from", str(tmp_path / "none"), "--target-loss", "1"], "no such run directory"),
        (["--from", str(damaged), "--target-loss", "1"],
         "worker0.jsonl has a step event that cannot be read (Expected `float`, got `str` - "
         "at `$.compute_s`)"),
        (["--from", str(named), "--target-loss", "1"],
         "names the task 'tests.plugin_probe:make_task', code to import and run: not "
         "imported (pass --trust-plugins if you trust it)"),
        (["--from", str(real_run)], "Missing option '--target-loss'"),
        (["--from", str(real_run), "--target-loss", "1", "--mode", "local:x"], "local takes H"),
        (["--from", str(real_run), "--target-loss", "1", "--link", "fast"], "rate 'fast'"),
        (["--from", str(real_run), "--target-loss", "1", "--workers", "2", "--straggler",
          "5:slowdown=3"], "names worker 5, but there are 2 workers"),
        (["--from", str(real_run), "--target-loss", "0.0001", "--mode", "async", "--steps",
          "3", "--draws", "1"], "no mode reaches the target loss 0.0001 within 3 steps"),
    ]
    for args, message in cases:
        got = plan(*args)
        assert got.exit_code != 0
        assert message in got.output, (args, got.output)
        if "Missing" in message:
            continue
        # one line; after simulating (the target never reached), under the progress bar
        *before, last = got.output.strip().splitlines()
        assert last.startswith("Error: ") and message in last, got.output
        assert all("simulating" in line for line in before), got.output
        assert before == [] or "no mode reaches" in message, got.output
