"""Experiment specs: parsing, validation, grid expansion, TOML round trips. No processes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from paramserver.cli.experiment import build_spec, experiment
from paramserver.errors import ConfigError, RegistryError
from paramserver.workers.experiments.spec import (
    ExperimentSpec,
    ModeChoice,
    PolicyChoice,
    Scenario,
    builtin_scenario,
    dump_spec,
    load_spec,
    preset,
)
from paramserver.workers.stragglers import StragglerSpec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("text", "mode", "bound", "label"), [
    ("sync", "sync", 0, "sync"),
    ("async", "async", 0, "async"),
    ("ssp:3", "ssp", 3, "ssp s=3"),
    ("SSP:s=1", "ssp", 1, "ssp s=1"),
    (" ssp:0 ", "ssp", 0, "ssp s=0"),
])
def test_modes_parse(text, mode, bound, label):
    choice = ModeChoice.parse(text)
    assert (choice.mode, choice.bound, choice.label) == (mode, bound, label)
    assert ModeChoice.parse(str(choice)) == choice


@pytest.mark.parametrize(("text", "message"), [
    ("ssp", "staleness bound"),
    ("ssp:x", "staleness bound"),
    ("ssp:-1", "staleness bound"),
    ("sync:2", "only ssp"),
    ("bsp", "sync, async or ssp"),
])
def test_bad_modes_say_what_is_allowed(text, message):
    with pytest.raises(ConfigError, match=message):
        ModeChoice.parse(text)


def test_modes_order_by_allowed_staleness():
    modes = [ModeChoice.parse(m) for m in ("async", "ssp:3", "sync", "ssp:1")]
    assert [str(m) for m in sorted(modes, key=lambda m: m.rank)] == [
        "sync", "ssp:1", "ssp:3", "async"]


def test_policies_parse_names_arguments_and_plugins():
    assert PolicyChoice.parse("none") == PolicyChoice("none")
    reject = PolicyChoice.parse("reject:max_staleness=4")
    assert reject.name == "reject" and dict(reject.args) == {"max_staleness": "4"}
    assert reject.label == "reject(max_staleness=4)" and str(reject) == "reject:max_staleness=4"
    plugin = PolicyChoice.parse("tests.policies_fixture:OnlyWorker:worker=1")
    assert plugin.name == "tests.policies_fixture:OnlyWorker"
    assert dict(plugin.args) == {"worker": "1"}
    assert PolicyChoice.parse("tests.policies_fixture:Halve").args == ()
    table = PolicyChoice.parse({"name": "exponential", "args": {"decay": 0.5}})
    assert dict(table.args) == {"decay": 0.5}


def test_bad_policies_are_refused_when_the_spec_is_built():
    with pytest.raises(RegistryError, match="unknown staleness policy 'nope'"):
        PolicyChoice.parse("nope")
    with pytest.raises(ConfigError, match="no parameter 'bound'"):
        PolicyChoice.parse("reject:bound=3")
    with pytest.raises(ConfigError, match="name and args"):
        PolicyChoice.parse({"args": {}})


def test_defaults_are_the_demo_and_the_grid_is_seed_major():
    spec = preset("demo")
    assert [str(m) for m in spec.modes] == ["sync", "async", "ssp:3"]
    assert (spec.workers, spec.servers, spec.task, spec.scenarios, spec.seeds) == (
        [4], 2, "digits-mlp", ["transient"], [0, 1, 2])
    configs = spec.configurations()
    assert [c.label for c in configs] == ["sync", "async", "ssp s=3"]
    assert [c.id for c in configs] == ["transient-sync-none-w4", "transient-async-none-w4",
                                       "transient-ssp3-none-w4"]
    runs = spec.runs()
    assert len(runs) == 9
    assert [r.seed for r in runs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert runs[4].path == "runs/transient-async-none-w4/seed1"


def test_labels_name_only_the_axes_that_vary():
    spec = ExperimentSpec(modes=["async"], policies=["none", "reject:max_staleness=2"],
                          workers=[2, 4], scenarios=["none", "persistent"], seeds=1)
    labels = [c.label for c in spec.configurations()]
    assert len(labels) == 8 and len(set(zip(labels, [c.scenario for c in
                                                    spec.configurations()], strict=True))) == 8
    assert "async + reject(max_staleness=2), 4 workers" in labels
    assert len({c.id for c in spec.configurations()}) == 8


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"modes": []}, "modes must be a non-empty list"),
    ({"modes": ["sync", "sync"]}, "more than once"),
    ({"workers": [0]}, "workers must be an int >= 1"),
    ({"seeds": 0}, "seeds"),
    ({"seeds": [1, 1]}, "more than once"),
    ({"steps": 0}, "steps must be an int >= 1"),
    ({"scenarios": ["stormy"]}, "unknown scenario 'stormy'; built-in: none, persistent"),
    ({"target_loss": 0}, "target_loss"),
    ({"task": "no-such-task"}, "no-such-task"),
    ({"task_args": {"depth": 3}}, "has no argument"),
    ({"optimizer": "sgd", "optimizer_args": {"momentun": 0.9}}, "momentun"),
    ({"min_step_time": -1}, "min_step_time"),
])
def test_invalid_specs_are_refused_with_a_reason(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ExperimentSpec(**kwargs)


def test_unknown_keys_are_listed():
    with pytest.raises(ConfigError, match=r"unknown experiment key\(s\) \['mode'\]; allowed"):
        ExperimentSpec.from_dict({"mode": ["sync"]})


def test_builtin_scenarios():
    transient = builtin_scenario("transient", 0.02)
    assert transient.all == StragglerSpec(min_step_time=0.02, slow_prob=0.1, slow_factor=5.0)
    assert transient.stragglers(4) == {}
    persistent = builtin_scenario("persistent", 0.02)
    assert persistent.stragglers(4) == {0: StragglerSpec(min_step_time=0.02, slowdown=4.0)}
    heavy = builtin_scenario("heavy-tail", 0.02)
    kind, params = StragglerSpec.parse_delay(heavy.all.delay)
    assert kind == "pareto" and params[0] == 1.5
    assert builtin_scenario("none", 0.0).all == StragglerSpec()


def test_custom_scenarios_merge_ranks_over_all(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text("""
scenarios = ["slow-pair"]
min_step_time = 0.01
[custom_scenarios.slow-pair]
description = "two slow workers"
all = { slow_prob = 0.05, slow_factor = 3 }
ranks = { "0" = { slowdown = 2.0 }, "1" = { slowdown = 3.0, slow_prob = 0.0 } }
""")
    spec = load_spec(path)
    scenario = spec.scenario("slow-pair")
    assert scenario.all == StragglerSpec(min_step_time=0.01, slow_prob=0.05, slow_factor=3)
    stragglers = scenario.stragglers(2)
    assert stragglers[0] == StragglerSpec(min_step_time=0.01, slow_prob=0.05, slow_factor=3,
                                          slowdown=2.0)
    assert stragglers[1].slow_prob == 0.0 and stragglers[1].slowdown == 3.0
    assert scenario.stragglers(1) == {0: stragglers[0]}
    with pytest.raises(ConfigError, match="unknown straggler field"):
        Scenario.from_table("x", {"all": {"slowness": 2}}, 0.0)


def test_cluster_specs_are_fair_across_configurations():
    spec = ExperimentSpec(modes=["sync", "ssp:2", "async"], scenarios=["persistent"],
                          policies=["reject:max_staleness=5"], seeds=[7], steps=50,
                          eval_every=10, optimizer_args={"lr": 0.05})
    clusters = [spec.cluster_spec(c, 7) for c in spec.configurations()]
    assert [(c.server.mode, c.server.staleness_bound) for c in clusters] == [
        ("sync", 0), ("ssp", 2), ("async", 0)]
    for c in clusters:
        assert c.server.policy == "reject" and c.server.policy_args == {"max_staleness": "5"}
        assert c.server.optimizer_args == {"lr": 0.05}
        assert (c.num_servers, c.num_workers) == (2, 4)
        # identical workers, data, seeds and stragglers: only the server's mode differs
        assert c.worker == clusters[0].worker and c.stragglers == clusters[0].stragglers
        assert (c.worker.steps, c.worker.seed, c.worker.eval_every) == (50, 7, 10)
        assert c.stragglers[0].slowdown == 4.0


def test_spec_toml_round_trips(tmp_path):
    spec = ExperimentSpec(
        name="round trip", modes=["sync", "ssp:2"], seeds=[3, 5], workers=[2, 3],
        policies=["none", "tests.policies_fixture:OnlyWorker:worker=1",
                  {"name": "exponential", "args": {"decay": 0.25}}],
        scenarios=["transient", "mine"], task_args={"hidden": 16}, batch_size=8,
        custom_scenarios={"mine": {"description": 'a "quoted" one', "all": {"delay": "exp:0.01"},
                                   "ranks": {"1": {"slowdown": 2.5}}}},
        target_loss=0.8, run_timeout=None,
    )
    path = tmp_path / "spec.toml"
    path.write_text(dump_spec(spec))
    again = load_spec(path)
    assert again == spec
    assert dataclasses.asdict(again) == dataclasses.asdict(spec)


def _docs_toml() -> str:
    text = (ROOT / "docs" / "experiments.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/experiments.md has no ```toml example"
    return str(blocks[0])


def test_the_documented_spec_example_is_valid(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "custom"))
    path = tmp_path / "spec.toml"
    path.write_text(_docs_toml())
    spec = load_spec(path)
    assert len(spec.configurations()) >= 4
    assert load_spec(ROOT / "examples" / "custom" / "experiment.toml").task == (
        "mypkg.tasks:make_task")


def test_flags_override_the_spec_file(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text('modes = ["sync"]\nsteps = 20\nworkers = [2]\n')
    spec = build_spec(spec_file=str(path), preset_name=None,
                      overrides={"modes": ["async", "ssp:1"], "steps": None, "workers": []})
    assert [str(m) for m in spec.modes] == ["async", "ssp:1"]
    assert spec.steps == 20 and spec.workers == [2]
    lit = build_spec(spec_file=None, preset_name="literature", overrides={"seeds": 2})
    assert lit.scenarios == ["none", "transient"] and lit.seeds == [0, 1]
    with pytest.raises(ConfigError, match="not both"):
        build_spec(spec_file=str(path), preset_name="demo", overrides={})


def test_cli_refuses_bad_flags_before_starting_anything(tmp_path):
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(experiment, ["--mode", "ssp", "--out", str(out)])
    assert result.exit_code == 2
    assert "ssp needs its staleness bound" in result.output
    result = runner.invoke(experiment, ["--policy", "nope", "--out", str(out)])
    assert result.exit_code == 2 and "unknown staleness policy" in result.output
    result = runner.invoke(experiment, ["--seeds", "a,b", "--out", str(out)])
    assert result.exit_code == 2 and "--seeds" in result.output
    assert not out.exists()


def test_an_unrelated_directory_is_not_overwritten(tmp_path):
    from paramserver.workers.experiments.runner import run_experiment

    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="does not hold an earlier experiment"):
        run_experiment(ExperimentSpec(seeds=1), tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize(("text", "fields", "label"), [
    ("sync:lr=linear,warmup=20", {"lr_scaling": "linear", "warmup": 20},
     "sync (lr linear, warmup 20)"),
    ("sync:b=1,lr=sqrt", {"backups": 1, "lr_scaling": "sqrt"}, "sync b=1 (lr sqrt)"),
    ("ssp:3,target=0.9", {"bound": 3, "momentum_target": 0.9}, "ssp s=3 (target momentum 0.9)"),
    ("async:momentum=0", {"momentum": 0.0}, "async (momentum 0)"),
])
def test_modes_carry_their_own_step_size_settings(text, fields, label):
    choice = ModeChoice.parse(text)
    assert {k: getattr(choice, k) for k in fields} == fields
    assert choice.label == label
    assert ModeChoice.parse(str(choice)) == choice


def test_step_settings_of_a_mode_override_the_specs(tmp_path):
    from paramserver.workers.experiments.spec import ExperimentSpec
    spec = ExperimentSpec(modes=["sync:lr=linear,warmup=5", "async:target=0.9", "ssp:2"],
                          lr_scaling="sqrt", optimizer_args={"lr": 0.1, "momentum": 0.9},
                          scenarios=["none"], seeds=[0])
    by_mode = {str(c.mode): spec.cluster_spec(c, 0).server for c in spec.configurations()}
    sync, asyn, ssp = (by_mode[k] for k in ("sync:lr=linear,warmup=5", "async:target=0.9",
                                            "ssp:2"))
    assert (sync.lr_scaling, sync.warmup_steps, sync.momentum_target) == ("linear", 5, None)
    assert (asyn.lr_scaling, asyn.momentum_target) == ("sqrt", 0.9)
    assert (ssp.lr_scaling, ssp.warmup_steps) == ("sqrt", 0)
    assert asyn.optimizer_args["momentum"] == 0.9
    assert load_spec_roundtrip(spec, tmp_path).modes == spec.modes


def load_spec_roundtrip(spec, tmp_path):
    from paramserver.workers.experiments.spec import dump_spec, load_spec
    path = tmp_path / "spec.toml"
    path.write_text(dump_spec(spec))
    back = load_spec(path)
    assert (back.lr_scaling, back.warmup_steps, back.momentum_target) == (
        spec.lr_scaling, spec.warmup_steps, spec.momentum_target)
    return back


@pytest.mark.parametrize("text", ["sync:lr=cubic", "async:momentum=1.5", "sync:warmup=x"])
def test_bad_step_size_settings_are_refused(text):
    with pytest.raises(ConfigError):
        ModeChoice.parse(text)


def test_replicas_is_a_setting_and_an_axis():
    one = ExperimentSpec(replicas=1, modes=["async"], workers=[2], scenarios=["none"])
    (config,) = one.configurations()
    assert config.label == "async, 1 replica" and config.id == "none-async-none-w2-r1"
    assert one.cluster_spec(config, 0).server.replicas == 1
    axis = ExperimentSpec(replicas=[0, 1], modes=["sync", "async"], workers=[2],
                          scenarios=["none"])
    assert [(c.label, c.replicas) for c in axis.configurations()] == [
        ("sync, 0 replicas", 0), ("sync, 1 replica", 1),
        ("async, 0 replicas", 0), ("async, 1 replica", 1)]
    assert ExperimentSpec.from_dict(axis.to_toml_dict()).replicas == [0, 1]
    with pytest.raises(ConfigError, match=r"replicas = 1 with mode async, policy gap-aware: "
                                          r"--replicas does not work with --policy gap-aware"):
        ExperimentSpec(replicas=[0, 1], modes=["async"], policies=["gap-aware"], workers=[3])
    with pytest.raises(ConfigError, match="replicas lists 1 more than once"):
        ExperimentSpec(replicas=[1, 1])
    with pytest.raises(ConfigError, match="at most 4 backups per shard"):
        ExperimentSpec(replicas=5)
