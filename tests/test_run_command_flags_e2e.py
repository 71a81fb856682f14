"""`paramserver run [flags] -- COMMAND` (torchrun, Slurm) treats the launcher's flags as
`launch -- COMMAND` does (issue 31): each acts on the user's script, through its
DistributedOptimizer, or is refused in one line; none is silently ignored. One table
decides for both (cli/launch.py NOT_FOR_COMMANDS, and LaunchOptions for what acts).

The same job's event logs, read by the launcher's observer, show that what the script
gave ``opt.log`` reaches Prometheus and TensorBoard by one path (FigureExporter)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from paramserver.cli import options
from paramserver.cli.launch import NOT_FOR_COMMANDS
from paramserver.cli.main import main
from paramserver.observe.events import read_events
from paramserver.observe.recorder import LauncherObserver
from paramserver.workers.config import LaunchOptions
from paramserver.workers.stragglerspec import StragglerSpec
from tests.ports import free_port
from tests.test_command_flags_e2e import REFUSED

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "tests" / "logging_script.py")]

#: worker options that act on a command's DistributedOptimizer: LaunchOptions' fields (the
#: straggler's as its own flags) and the evaluator (PARAMSERVER_EVALUATOR)
ACTING = ({f.name for f in dataclasses.fields(LaunchOptions)} - {"straggler"}
          | {f.name for f in dataclasses.fields(StragglerSpec)} | {"evaluator"})


@pytest.mark.parametrize("command", ["launch", "run"])
def test_every_worker_option_acts_on_a_command_or_is_refused(command):
    worker = {s.name for s in options.WORKER}
    assert worker <= ACTING | set(NOT_FOR_COMMANDS), worker - ACTING - set(NOT_FOR_COMMANDS)
    assert not ACTING & set(NOT_FOR_COMMANDS)
    assert worker <= {p.name for p in main.commands[command].params}  # both take them all


RUN_REFUSED = [g for g in REFUSED if g[0] != "--no-eval"]  # --no-eval is launch's only


def test_run_has_every_refused_option_but_launchs_eval():
    flags = {opt for p in main.commands["run"].params for opt in p.opts}
    assert {g[0] for g in RUN_REFUSED} <= flags and "--no-eval" not in flags


@pytest.mark.parametrize("given", RUN_REFUSED, ids=lambda g: g[0])
def test_run_refuses_an_option_of_the_built_in_loop_in_one_line(given):
    # refused before the launcher's environment is read: no torchrun needed
    result = CliRunner().invoke(main, ["run", *given, "--", "python", "train.py"])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and f"{given[0]} does not act on a command run" in errors[0]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARAMSERVER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun job, 1 server + 2 workers running tests/logging_script.py, shared by
    the tests below; returns its folder (OUT in run/, what each rank saw in seen/)."""
    tmp = tmp_path_factory.mktemp("run-command")
    out, seen = tmp / "run", tmp / "seen"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
         "3", "--master-port", str(free_port()), "-m", "paramserver.cli", "run",
         "--num-servers", "1", "--mode", "async", "--out", str(out),
         "--slowdown", "2", "--min-step-time", "0.05", "--seed", "3", "--chunk-bytes", "4096",
         "--evaluator", "1", "--", *SCRIPT, str(seen), "--steps", "4"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return tmp


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_run_applies_stragglers_seed_client_options_and_the_evaluator(run_dir):
    out, seen = run_dir / "run", run_dir / "seen"
    ranks = [json.loads((seen / f"seen{r}.json").read_text()) for r in (0, 1)]
    assert all(s["slowdown"] == 2.0 and s["min_step_time"] == 0.05 and s["seed"] == "3"
               and s["chunk_bytes"] == 4096 and s["evaluator"] == "1" for s in ranks)
    assert [s["evaluates"] for s in ranks] == [False, True]
    for rank in (0, 1):
        steps = read_events(out / "events" / f"worker{rank}.jsonl", "step")
        assert len(steps) == 4
        for s in steps:  # step() injected the straggler delay, logged apart
            want = max(s["compute_s"], 0.05) * 2 - s["compute_s"]
            assert s["sleep_s"] == pytest.approx(want, abs=1e-9)
        assert (out / "configs" / f"worker{rank}.json").exists()
    # only the evaluator logged held-out figures
    assert read_events(out / "events" / "worker0.jsonl", "eval") == []
    assert [e["clock"] for e in read_events(out / "events" / "worker1.jsonl", "eval")] == [2, 4]


def _replay(run_dir: Path, tmp_path: Path, **kw: Any) -> LauncherObserver:
    """The launcher's observer (what `launch` runs while workers train) over the job's
    worker event logs, copied: its Prometheus endpoint and TensorBoard writer."""
    events = tmp_path / "replay" / "events"
    events.mkdir(parents=True)
    for rank in (0, 1):
        shutil.copy(run_dir / "run" / "events" / f"worker{rank}.jsonl", events)
    return LauncherObserver(tmp_path / "replay", **kw)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_what_opt_log_records_is_in_the_prometheus_exposition(run_dir, tmp_path):
    steps = {r: read_events(run_dir / "run" / "events" / f"worker{r}.jsonl", "step")
             for r in (0, 1)}
    last_eval = read_events(run_dir / "run" / "events" / "worker1.jsonl", "eval")[-1]
    observer = _replay(run_dir, tmp_path, metrics_port=0)
    port = observer.start()
    try:
        observer.poll()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        observer.close()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    for rank in (0, 1):  # opt.log(loss=..., grad_norm=1.5) after every step
        assert samples[f'paramserver_worker_logged{{name="grad_norm",worker="{rank}"}}'] == 1.5
        assert samples[f'paramserver_worker_loss{{worker="{rank}"}}'] == steps[rank][-1]["loss"]
    # opt.log(eval_loss=..., eval_accuracy=...) on the evaluator
    assert samples['paramserver_worker_eval_loss{worker="1"}'] == last_eval["loss"]
    assert samples['paramserver_worker_eval_accuracy{worker="1"}'] == 0.3
    assert 'paramserver_worker_eval_loss{worker="0"}' not in samples


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_what_opt_log_records_is_in_tensorboard(run_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed "
                        "here (pip install 'paramserver[tensorboard]'): TensorBoard's half "
                        "of the check cannot run")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = read_events(run_dir / "run" / "events" / "worker0.jsonl", "step")
    evals = read_events(run_dir / "run" / "events" / "worker1.jsonl", "eval")
    observer = _replay(run_dir, tmp_path, tensorboard=str(tmp_path / "tb"))
    observer.poll()
    observer.close()
    acc = EventAccumulator(str(tmp_path / "tb" / "launcher"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("grad_norm/worker0")] == \
        [(s["clock"], 1.5) for s in steps]
    assert [e.value for e in acc.Scalars("loss/worker0")] == \
        pytest.approx([s["loss"] for s in steps], rel=1e-6)  # TensorBoard keeps float32
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == \
        [(e["clock"], pytest.approx(e["accuracy"], rel=1e-6)) for e in evals]
