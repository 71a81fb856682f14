"""`paramserver launch [flags] -- COMMAND`: every option of launch acts on the user's
script (through DistributedOptimizer) or is refused with one line (issue 31, items 2-3);
the script reports through opt.log, and --no-eval still saves the final model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from paramserver import ClusterSpec, ServerConfig, WorkerConfig, run_cluster
from paramserver.cli.launch import NOT_FOR_COMMANDS
from paramserver.cli.main import main
from paramserver.observe.events import read_events
from paramserver.workers.experiments.spec import builtin_scenario
from paramserver.workers.optimizer import OPTIONS_ENV, LaunchOptions
from paramserver.workers.stragglers import StragglerSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "tests" / "logging_script.py")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PARAMSERVER_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "paramserver.cli", "launch", *args],
                          cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


#: each option of the built-in loop that a command run refuses, as a user gives it
REFUSED = [("--task", "digits-mlp"), ("--task-arg", "hidden=8"), ("--batch-size", "4"),
           ("--device", "cpu"), ("--steps", "7"), ("--epochs", "1"),
           ("--budget-seconds", "5"), ("--push-every", "2"), ("--eval-every", "2"),
           ("--no-eval",), ("--overlap",), ("--bucket-bytes", "1024"),
           ("--local-optimizer", "sgd"), ("--local-arg", "lr=0.1"), ("--sync-every", "2")]


def test_every_refused_option_is_listed():
    names = {args[0].lstrip("-").replace("-", "_") for args in REFUSED}
    assert names - {"no_eval", "task_arg", "local_arg"} | {"eval", "task_args", "local_args"} \
        == set(NOT_FOR_COMMANDS)


@pytest.mark.parametrize("given", REFUSED, ids=lambda g: g[0])
def test_an_option_of_the_built_in_loop_is_refused_on_a_command_run(tmp_path, given,
                                                                     clean_env):
    # in this process (the refusal comes before anything starts): an interpreter each
    # cost the suite a second or more; the config file's case below runs the real command
    result = CliRunner().invoke(main, ["launch", "--quiet", "--out", str(tmp_path / "run"),
                                       *given, "--", *SCRIPT, str(tmp_path)])
    assert result.exit_code == 2, result.output
    error = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1 and f"{given[0]} does not act on a command run" in error[0]
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_a_refused_option_in_the_config_file_is_refused_too(tmp_path):
    (tmp_path / "run.toml").write_text("steps = 7\n")
    proc = _launch("--config", str(tmp_path / "run.toml"), "--", *SCRIPT, str(tmp_path),
                   timeout=60)
    assert proc.returncode == 2
    assert "--steps (in --config) does not act on a command run" in proc.stderr


def test_stragglers_seed_and_client_options_act_and_opt_log_reports(tmp_path):
    out = tmp_path / "run"
    proc = _launch("-s", "1", "-n", "2", "--mode", "async", "--quiet", "--out", str(out),
                   "--straggler", "1:slowdown=4", "--min-step-time", "0.05", "--seed", "3",
                   "--chunk-bytes", "4096", "--early-parts", "--", *SCRIPT, str(tmp_path / "seen"),
                   "--steps", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads((tmp_path / "seen" / f"seen{r}.json").read_text()) for r in (0, 1)]
    assert [s["slowdown"] for s in seen] == [1.0, 4.0]  # only rank 1 is the straggler
    assert all(s["min_step_time"] == 0.05 and s["seed"] == "3" and s["chunk_bytes"] == 4096
               and s["early_parts"] and s["early_log_refused"] for s in seen)
    for rank, slowdown in ((0, 1), (1, 4)):
        steps = read_events(out / "events" / f"worker{rank}.jsonl", "step")
        assert len(steps) == 4
        for s in steps:  # the injected delay is logged apart from the compute
            want = max(s["compute_s"], 0.05) * slowdown - s["compute_s"]
            assert s["sleep_s"] == pytest.approx(want, abs=1e-9)
            assert s["grad_norm"] == 1.5 and isinstance(s["loss"], float)  # opt.log's
            assert s["worker"] == rank and isinstance(s["clock"], int) and "junk" not in s
    # the straggler's every step lasts >= 4 x 0.05 s, >= 0.15 s of it injected
    assert all(s["sleep_s"] >= 0.15 for s in read_events(out / "events" / "worker1.jsonl",
                                                           "step"))
    evals = read_events(out / "events" / "worker0.jsonl", "eval")
    assert [e["clock"] for e in evals] == [2, 4] and evals[-1]["accuracy"] == 0.3
    result = json.loads((out / "result.json").read_text())
    # result.json's eval: the last one the evaluating rank logged
    assert result["eval"] == {"loss": evals[-1]["loss"], "accuracy": 0.3}
    assert result["workers"][0]["eval"] == result["eval"]
    assert "held-out loss" in proc.stdout  # the summary line shows it too


@pytest.mark.parametrize("name", ["persistent", "transient", "heavy-tail"])
def test_an_experiment_scenario_reaches_each_ranks_optimizer(tmp_path, monkeypatch, name):
    scenario = builtin_scenario(name, 0.02)
    spec = ClusterSpec(num_workers=3, worker=WorkerConfig(servers=[], straggler=scenario.all,
                                                          seed=5),
                       stragglers=scenario.stragglers(3), command=["python", "train.py"])
    for rank in range(3):
        path = spec.options_file(rank, tmp_path)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(spec.launch_options(rank).to_json()))
        monkeypatch.setenv(OPTIONS_ENV, spec.command_env(rank, [], tmp_path)[OPTIONS_ENV])
        got = LaunchOptions.from_env()
        assert got.seed == 5
        assert got.straggler == dict(scenario.ranks).get(rank, scenario.all)
        assert got.straggler.active


def test_no_eval_skips_the_evaluation_but_saves_the_final_model(tmp_path):
    # the built-in loop, with its straggler injected by DistributedOptimizer.step()
    spec = ClusterSpec(num_servers=1, num_workers=1, server=ServerConfig(mode="async"),
                       worker=WorkerConfig(servers=[], steps=3), evaluate=False,
                       stragglers={0: StragglerSpec(min_step_time=0.03)})
    result = run_cluster(spec, tmp_path / "run")
    assert result.eval == {}
    weights = load_file(str(tmp_path / "run" / "final_model.safetensors"))
    assert weights and all(t.numel() for t in weights.values())
    steps = read_events(tmp_path / "run" / "events" / "worker0.jsonl", "step")
    assert len(steps) == 3
    assert all(s["sleep_s"] == pytest.approx(max(0.0, 0.03 - s["compute_s"]), abs=1e-9)
               for s in steps)
