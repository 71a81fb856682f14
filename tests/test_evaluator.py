"""Which worker evaluates (issue 31): the spec's ``evaluator`` key and ``--evaluator``, by
default a rank the scenario does not slow; it reaches the built-in loop (here the
simulator, in virtual time) and a command's script (PARAMSERVER_EVALUATOR,
``DistributedOptimizer.evaluates``); a rank that is no worker is refused in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from paramserver.cli.main import main
from paramserver.errors import ConfigError
from paramserver.observe.events import read_events
from paramserver.workers.config import EVALUATOR_ENV, WorkerConfig
from paramserver.workers.experiments.spec import ExperimentSpec, dump_spec, load_spec
from paramserver.workers.launch.clusterspec import ClusterSpec
from paramserver.workers.optimizer import ClientConfig, DistributedOptimizer

OUT_OF_RANGE = "evaluator must be a worker rank, 0 .. 1 with 2 worker(s); got 2"


def _spec(**kw: object) -> ExperimentSpec:
    base: dict[str, object] = {"modes": ["async"], "seeds": [0], "workers": [3], "servers": 1}
    return ExperimentSpec(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("scenario", "workers", "want"), [
    ("persistent", 3, 1),  # worker 0 is its straggler: the next rank evaluates
    ("persistent", 1, 0),  # the only worker, straggler or not
    ("transient", 3, 0),  # every worker alike: the lowest rank
    ("none", 2, 0),
])
def test_the_default_evaluator_is_not_the_scenarios_straggler(scenario, workers, want):
    spec = _spec(scenarios=[scenario], workers=[workers])
    (config,) = spec.configurations()
    assert spec.evaluator_of(config) == want
    assert spec.cluster_spec(config, 0).worker.evaluator == want


def test_the_spec_chooses_the_evaluator_and_keeps_it_in_its_toml(tmp_path):
    spec = _spec(scenarios=["persistent"], evaluator=0, command=["python", "train.py"])
    (config,) = spec.configurations()
    cluster = spec.cluster_spec(config, 0)
    assert cluster.worker.evaluator == 0
    assert cluster.command_env(2, ["tcp://127.0.0.1:1"], tmp_path)[EVALUATOR_ENV] == "0"
    (tmp_path / "spec.toml").write_text(dump_spec(spec))
    assert load_spec(tmp_path / "spec.toml").evaluator == 0
    assert "evaluator" not in dump_spec(_spec())  # unset: the default rule, not a rank


def test_an_evaluator_that_is_no_worker_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=f"^{re.escape(OUT_OF_RANGE)}$"):
        _spec(workers=[2, 4], evaluator=2)  # the smallest cell has no rank 2
    with pytest.raises(ConfigError, match=re.escape(OUT_OF_RANGE)):
        ClusterSpec(num_workers=2, worker=WorkerConfig(servers=[], evaluator=2))
    with pytest.raises(ConfigError, match="evaluator must be an int >= 0"):
        _spec(evaluator=True)


def test_the_optimizer_refuses_it_before_it_connects(monkeypatch):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match=re.escape(OUT_OF_RANGE)):  # no server there: not reached
        DistributedOptimizer(model, config=ClientConfig(
            servers=["tcp://127.0.0.1:9"], rank=0, world_size=2, evaluator=2))
    monkeypatch.setenv(EVALUATOR_ENV, "2")
    with pytest.raises(ConfigError, match=re.escape(OUT_OF_RANGE)):
        DistributedOptimizer(model, config=ClientConfig.from_env(
            servers=["tcp://127.0.0.1:9"], rank=0, world_size=2))


@pytest.mark.parametrize("args", [
    ["experiment", "--workers", "2", "--evaluator", "2", "--mode", "sync"],
    ["simulate", "--workers", "2", "--evaluator", "2", "--mode", "sync"],
    ["launch", "-n", "2", "--evaluator", "2"],
], ids=lambda a: a[0])
def test_the_cli_refuses_it_in_one_line(tmp_path, args):
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and OUT_OF_RANGE in errors[0], result.output
    assert not (tmp_path / "out").exists()


def test_the_built_in_loop_evaluates_on_the_chosen_worker_only(tmp_path: Path):
    """The simulator runs the built-in loop: under 'persistent' worker 1 evaluates by
    default, every eval_every clocks and at the end; the spec may make it worker 2."""
    from paramserver.workers.experiments.report import summarize
    from paramserver.workers.experiments.runner import simulate_experiment
    from paramserver.workers.launch.virtual import SimSpec

    for evaluator, want in ((None, 1), (2, 2)):
        out = tmp_path / f"e{evaluator}"
        spec = _spec(scenarios=["persistent"], steps=6, eval_every=3, min_step_time=0.01,
                     evaluator=evaluator)
        simulate_experiment(spec, out, SimSpec(compute_time=0.0), report=False)
        run = out / spec.runs()[0].path
        evals = {r: read_events(run / "events" / f"worker{r}.jsonl", "eval") for r in range(3)}
        assert [e["clock"] for e in evals[want]] == [0, 3, 6]
        assert all(not e for r, e in evals.items() if r != want)
        (summary,) = summarize(out)
        assert [r.evaluator for r in summary.runs] == [want]
