"""A grid is bounded and its names cannot leave ``--out`` (issue 42, items 9 and 10).

* ``seeds = 1000000`` printed nothing for minutes (the duplicate check was quadratic):
  a grid of more than MAX_RUNS runs is refused in one line before any axis is expanded.
* A custom scenario named ``../../x`` wrote its run folder and plots outside ``--out``,
  and one holding ``/`` ended the report with a traceback: scenario, mode and cell names
  follow one rule (check_name), an experiment.json that breaks it is refused, and every
  run folder and image is checked to resolve inside the experiment's directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from paramserver.errors import ConfigError
from paramserver.workers.experiments.index import ExperimentIndex, check_name, inside
from paramserver.workers.experiments.spec import MAX_RUNS, ExperimentSpec

HOSTILE_NAMES = ["../../x", "a/b", "..", ".", ".hidden", "", "a b", "x\\y", "/abs",
                 "é", "-dash", "x" * 201, "a\nb"]


@pytest.mark.parametrize("seeds", [1_000_000, MAX_RUNS + 1])
def test_a_grid_past_the_limit_is_refused_at_once(seeds: int) -> None:
    t0 = time.monotonic()
    for value in (seeds, list(range(seeds))):
        with pytest.raises(ConfigError, match=r"at most 10,000") as info:
            ExperimentSpec.from_dict({"seeds": value, "modes": ["async"]})
        assert "\n" not in str(info.value)
    assert time.monotonic() - t0 < 5  # (on main: minutes for 1,000,000)


def test_the_limit_counts_every_axis() -> None:
    """Runs are configurations x seeds: 3 modes x 2 worker counts x 1,700 seeds is over."""
    with pytest.raises(ConfigError, match=r"10,200 runs"):
        ExperimentSpec.from_dict({"seeds": 1700, "workers": [2, 4]})
    spec = ExperimentSpec.from_dict({"seeds": 1600, "workers": [2, 4]})
    assert len(spec.runs()) == 9600


def test_duplicates_among_many_seeds_are_named() -> None:
    seeds = [*range(MAX_RUNS - 1), 7]
    with pytest.raises(ConfigError, match=r"^seeds lists 7 more than once$"):
        ExperimentSpec.from_dict({"seeds": seeds, "modes": ["async"]})


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_scenario_name_is_one_safe_path_part(name: str) -> None:
    with pytest.raises(ConfigError, match="is not a name"):
        ExperimentSpec.from_dict({"scenarios": [name], "custom_scenarios": {name: {}},
                                  "seeds": 1})
    with pytest.raises(ConfigError, match="is not a name"):  # defined, not even listed
        ExperimentSpec.from_dict({"custom_scenarios": {name: {}}, "seeds": 1})


def test_good_names_make_run_folders_inside_out(tmp_path: Path) -> None:
    spec = ExperimentSpec.from_dict({"scenarios": ["my_case.v2"], "seeds": 1,
                                     "custom_scenarios": {"my_case.v2": {}},
                                     "steps": 8, "modes": ["async:h=4,outer=delayed-nesterov"]})
    for run in spec.runs():
        check_name(run.config.id, "configuration")
        assert inside(tmp_path, run.path).resolve().is_relative_to(tmp_path.resolve())


@pytest.mark.parametrize("relative", ["../x", "runs/../../x", "/tmp/x", "", "."])
def test_a_path_outside_the_experiment_is_refused(tmp_path: Path, relative: str) -> None:
    with pytest.raises(ConfigError, match="is not a path inside"):
        inside(tmp_path / "out", relative)


def test_an_experiment_json_with_a_traversing_name_is_refused(tmp_path: Path) -> None:
    """The report names image files after the index's scenarios and configurations."""
    good = {"name": "e", "task": "t", "servers": 1, "seeds": [0], "target_loss": 0.5,
            "eval_every": 1, "optimizer": "sgd", "started": 0.0}
    ExperimentIndex.from_json(good)
    config = {"id": "ok-async-none-w2", "scenario": "ok", "label": "async", "mode": "async",
              "workers": 2}
    for bad in ({"scenarios": {"../../x": {}}},
                {"configurations": [{**config, "id": "../../x"}]},
                {"configurations": [{**config, "scenario": "a/b"}]}):
        (tmp_path / "experiment.json").write_text(json.dumps({**good, **bad}))
        with pytest.raises(ConfigError, match="is not a name"):
            ExperimentIndex.read(tmp_path)
