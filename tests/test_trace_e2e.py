"""``--trace`` and ``simulate --replay`` (issue 48): a real run's trace, replayed on the
real core, gives the run's final weights bit for bit; another policy gives a different
and deterministic counterfactual. Real processes over loopback (launch); the trace
file's format, bounds and cap need none."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from paramserver.cli.main import main
from paramserver.errors import ConfigError
from paramserver.observe import trace as tr
from paramserver.server.loop import ServerConfig
from paramserver.workers.experiments.paired import interval, t95, welch
from paramserver.workers.launch.cluster import ClusterSpec, run_cluster
from paramserver.workers.launch.replay import Changes, compare, final_weights, replay_dir
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py

PARAMSERVER = [sys.executable, "-m", "paramserver.cli"]
STEPS = 8


ROOT = Path(__file__).resolve().parent.parent


def _doc_commands() -> list[list[str]]:
    """docs/research.md's record-and-replay block (which the docs test does not run:
    these tests run it), one argument list per command, ``runs/traced`` kept as written."""
    text = (ROOT / "docs" / "research.md").read_text(encoding="utf-8")
    block = text.split("runs these three commands) -->", 1)[1].split("\n\n")[1]
    return [shlex.split(line) for line in block.replace("\\\n", " ").strip().splitlines()]


def _as_here(args: list[str], out: Path) -> list[str]:
    """A command of the block with its run folder ``out`` and STEPS steps."""
    args = [str(out) if a == "runs/traced" else a for a in args]
    if "--steps" in args:
        args[args.index("--steps") + 1] = str(STEPS)
    return args


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs/research.md's traced launch: async, 3 workers, worker 2 three times slower,
    DC-ASGD, at STEPS steps."""
    out = tmp_path_factory.mktemp("traced")
    launch = _as_here(_doc_commands()[0], out)
    assert launch[:2] == ["paramserver", "launch"] and "--trace" in launch, launch
    done = subprocess.run([*PARAMSERVER, *launch[1:], "--overwrite"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"paramserver simulate --replay {out}" in done.stdout + done.stderr
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_own_policy_replays_bit_for_bit(traced: Path) -> None:
    real = final_weights(traced)
    own = replay_dir(traced)
    assert own.reproduced and own.pushes == 3 * STEPS, own.to_json()
    for name, w in own.weights.items():
        assert torch.equal(w, real[name]), name
    # another policy on the same schedule: another result, and the same one twice
    other = replay_dir(traced, Changes(policy="inverse"))
    again = replay_dir(traced, Changes(policy="inverse"))
    assert not compare(other.weights, real)[0]
    assert _equal(other.weights, again.weights)
    assert other.decisions_differ > 0 and "not the recorded versions" in other.note


def test_the_trace_is_typed_compact_and_merged(traced: Path) -> None:
    trace = tr.read_trace_dir(traced)
    shard = trace.shards[0]
    assert shard.whole and not shard.capped and shard.header.format == tr.FORMAT
    assert shard.header.config["policy"] == "dc-asgd"
    arrivals = [e for e in shard.events if isinstance(e, tr.Arrival)]
    served = [e for e in shard.events if isinstance(e, tr.Served)]
    assert len(arrivals) == 3 * STEPS and len(served) >= 3 * STEPS
    # the shard's order: versions rise by one per accepted push; the straggler is staler
    assert [a.version for a in arrivals] == list(range(1, 3 * STEPS + 1))
    stale = {w: max(a.staleness for a in arrivals if a.worker == w) for w in range(3)}
    assert stale[2] > min(stale[0], stale[1])
    assert {a.nbytes for a in arrivals} and all(a.nbytes > 0 for a in arrivals)
    # the worker's side: its reads, compute and wire time, bytes
    for rank in range(3):
        steps = trace.workers[rank].steps
        assert [s.clock for s in steps] == list(range(1, STEPS + 1))
        assert all(s.compute_s > 0 and s.push_s > 0 and s.bytes > 0 for s in steps)
    assert (sum(s.sleep_s for s in trace.workers[2].steps)
            > sum(s.sleep_s for s in trace.workers[0].steps))
    # bounded: the documented bytes per push
    size = (traced / "trace" / "shard0.pstrace").stat().st_size
    header = len(tr._ENCODER.encode(shard.header)) + 4
    assert size - header <= 3 * STEPS * tr.PUSH_BYTES + 64


def test_simulate_replay_says_bit_for_bit_and_counterfactual(traced: Path,
                                                            tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["simulate", "--replay", str(traced), "--policy",
                                       "inverse", "--out", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "final weights differ from the run's" in result.output
    assert "recorded timing was followed" in result.output
    own = CliRunner().invoke(main, ["simulate", "--replay", str(traced / "trace")],
                             catch_exceptions=False)
    assert own.exit_code == 0, own.output
    assert "final weights bit for bit the run's" in own.output
    written = json.loads((tmp_path / "replay.json").read_text())
    # the block's two replays, as written: the run again, then two other policies
    again, others = (_as_here(c, traced) for c in _doc_commands()[1:])
    assert again[:2] == others[:2] == ["paramserver", "simulate"]
    said = [CliRunner().invoke(main, c[1:], catch_exceptions=False) for c in (again, others)]
    assert [r.exit_code for r in said] == [0, 0], [r.output for r in said]
    assert "final weights bit for bit the run's" in said[0].output
    assert "reproduced: every read, decision and version as recorded" in said[0].output
    assert said[1].output.count("final weights differ from the run's") == 2, said[1].output
    assert written[0]["changes"].startswith("policy=inverse")
    bad = CliRunner().invoke(main, ["simulate", "--replay", str(traced), "--workers", "4"])
    assert bad.exit_code == 2 and "--replay re-runs a recorded schedule" in bad.output


def test_paired_report_replays_the_baseline_with_each_policy(traced: Path,
                                                            tmp_path: Path) -> None:
    """The report's wiring on the traced run, standing in as every seed's baseline (the
    other policy's "own runs" are copies of it: its loss is the baseline's)."""
    from paramserver.workers.experiments.paired import paired_report
    from paramserver.workers.experiments.spec import ExperimentSpec

    spec = ExperimentSpec.from_dict({"modes": ["async"], "policies": ["dc-asgd", "inverse"],
                                     "workers": [3], "num_servers": 1, "scenarios": ["none"],
                                     "seeds": [0, 1], "steps": STEPS})
    for config in spec.configurations():
        for seed in spec.seeds:
            (tmp_path / "runs" / config.id).mkdir(parents=True, exist_ok=True)
            (tmp_path / "runs" / config.id / f"seed{seed}").symlink_to(traced)
    lines: list[str] = []
    rows = paired_report(spec, tmp_path, lines.append)
    assert len(rows) == 1 and rows[0].policy == "inverse" and rows[0].reproduced == [True] * 2
    counter = replay_dir(traced, Changes(policy="inverse")).eval["loss"]
    own = replay_dir(traced).eval["loss"]
    assert rows[0].paired == [counter - own] * 2 and rows[0].unpaired_mean == 0
    assert len(lines) == 4  # the baseline's replay per seed, the counterfactual per seed
    assert (tmp_path / "images" / "paired.png").stat().st_size > 0
    assert "| inverse |" in (tmp_path / "paired.md").read_text()
    assert json.loads((tmp_path / "paired.json").read_text())[0]["policy"] == "inverse"


def test_sync_compressed_run_with_backups_replays(tmp_path: Path) -> None:
    """Sync with a backup worker (the straggler's push dropped from its round), int8 pushes
    with the workers' encoders, int8 pulls (each worker at its own reconstruction, the
    straggler's moved on only when it pulls), delayed Nesterov on 2 shards: the replay
    is the run."""
    server = ServerConfig(mode="sync", backup_workers=1, optimizer="delayed-nesterov",
                          optimizer_args={"lr": 0.1}, expected_workers=3,
                          pull_compression="int8")
    worker = WorkerConfig(servers=[], task="digits-mlp", steps=6, seed=3, compression="int8")
    spec = ClusterSpec(num_servers=2, num_workers=3, server=server, worker=worker,
                       stragglers={2: StragglerSpec(slowdown=3.0)}, trace=True)
    result = run_cluster(spec, tmp_path)
    assert all(s["counters"].get("pulls_compressed", 0) > 0 for s in result.servers)
    own = replay_dir(tmp_path)
    assert own.reproduced, own.to_json()
    assert compare(own.weights, final_weights(tmp_path)) == (True, 0.0)
    trace = tr.read_trace_dir(tmp_path)
    rounds = [e for e in trace.shards[0].events if isinstance(e, tr.Round)]
    assert [r.version for r in rounds] == list(range(1, len(rounds) + 1))
    # the backup: the straggler's pushes are mostly dropped; every accepted push is in
    # one round (the last ones, once the others left, have the straggler alone)
    assert all(1 <= len(r.members) <= 2 for r in rounds)
    assert sum(len(r.members) for r in rounds) == own.accepted
    # whichever worker is slowest (timing decides, not the test), a round closes on two
    # pushes, so a third one to it is dropped: fewer pushes are in rounds than were sent
    assert own.accepted < 3 * 6


# ---------------------------------------------------------------- the file, no sockets


def _header(cap: int = tr.DEFAULT_CAP) -> tr.Header:
    return tr.Header(tr.FORMAT, "shard", 0, {"num_shards": 1}, 1, cap)


def _arrival(i: int) -> tr.Arrival:
    return tr.Arrival(1e9 + i, 2**31 - 1, 2**62, 2**31, 2**62, 2**31, 2**62, 2**31, True,
                      0.123456789, "stale_rejected", 2**40, 1)


def test_a_push_costs_at_most_the_documented_bytes() -> None:
    served = tr.Served(1e9, 2**31 - 1, 2**31, 2**62)
    worst = len(tr._ENCODER.encode(_arrival(0))) + len(tr._ENCODER.encode(served)) + 8
    assert worst <= tr.PUSH_BYTES
    step = tr.WorkerStep(2**31, [], False, 0.5, 1.5, 2**31, 1.5, 1.5, 1.5, 1.5, 2**40)
    assert len(tr._ENCODER.encode(step)) + 4 <= tr.STEP_BYTES


def test_the_cap_stops_recording_and_the_replay_refuses(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tr.shard_file(tmp_path, 0)
    writer = tr.TraceWriter(path, _header(cap=1000))
    written = [writer.write(_arrival(i)) for i in range(100)]
    writer.close()
    assert written[0] and not written[-1] and writer.capped
    assert "reached its cap" in caplog.text
    _, records = tr.read_trace(path)
    assert isinstance(records[-1], tr.Capped) and records[-1].records == sum(written)
    assert path.stat().st_size <= 1000 + 64
    with pytest.raises(ConfigError, match="reached its cap"):
        replay_dir(tmp_path)


def test_a_damaged_or_foreign_file_is_refused_in_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tr.shard_file(tmp_path, 0)
    writer = tr.TraceWriter(path, _header())
    writer.write(_arrival(0))
    writer.write(_arrival(1))
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # a process killed mid-write: the whole records are read
    _, records = tr.read_trace(path)
    assert records == [_arrival(0), _arrival(1)] and "cut off" in caplog.text
    assert not tr.read_trace_dir(tmp_path).shards[0].whole
    path.write_bytes(b"\xff\xff\xff\xff" + data)
    with pytest.raises(ConfigError, match="not a trace"):
        tr.read_trace(path)
    newer = tr.TraceWriter(path, tr.Header(tr.FORMAT + 1, "shard", 0, {}, 1, 1000))
    newer.close()
    with pytest.raises(ConfigError, match="format"):
        tr.read_trace(path)
    with pytest.raises(ConfigError, match="no shard trace"):
        tr.read_trace_dir(tmp_path / "nothing")


def test_paired_and_unpaired_intervals() -> None:
    assert t95(1) == pytest.approx(12.706) and t95(4.7) == pytest.approx(2.776)
    assert t95(1000) == pytest.approx(1.96)
    mean, half = interval([1.0, 1.2, 0.8, 1.0])
    assert mean == pytest.approx(1.0) and half == pytest.approx(3.182 * 0.1633 / 2, rel=1e-3)
    mean, half = welch([2.0, 2.5, 3.0], [1.0, 1.0, 1.0])
    assert mean == pytest.approx(1.5) and half == pytest.approx(4.303 * 0.5 / 3**0.5,
                                                                 rel=1e-3)


def test_paired_and_trace_refusals(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["experiment", "--paired", "--policy", "none"])
    assert result.exit_code == 2 and "--paired compares policies" in result.output
    spec = tmp_path / "grid.toml"
    spec.write_text('modes = ["async"]\nreplicas = [1]\nworkers = [2]\nsteps = 2\n')
    result = CliRunner().invoke(main, ["experiment", "--trace", "--spec", str(spec), "--out",
                                       str(tmp_path / "out")])
    assert result.exit_code == 2 and "--replicas does not work with --trace" in result.output
    assert not (tmp_path / "out").exists()  # refused before the first run
    result = CliRunner().invoke(main, ["run", "--trace"])
    assert result.exit_code == 2 and "--trace writes DIR/trace: give --out DIR" in result.output
