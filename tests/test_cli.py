"""The command line through click's CliRunner: help, options, errors, configuration.

No processes are started here (see test_cli_e2e.py for that).
"""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import tomllib
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from paramserver.cli.main import main, register_commands
from paramserver.cli.options import option_names
from tests.ports import free_port

OURS = ["server", "worker", "launch", "status", "policies", "tasks", "run"]


pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def config(*args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """The resolved configuration of a command, as printed by --print-config."""
    result = invoke(*args, "--print-config", env=env)
    assert result.exit_code == 0, result.output
    return tomllib.loads(result.stdout)


def sources(*args: str, env: dict[str, str] | None = None) -> dict[str, str]:
    result = invoke(*args, "--print-config", env=env)
    out = {}
    for line in result.stdout.splitlines():
        if line.startswith("#") or "=" not in line:
            continue
        key, _, rest = line.partition(" = ")
        out[key] = rest.rsplit("# ", 1)[1]
    return out



# --------------------------------------------------------------------------- help


def test_main_help_lists_every_command_and_where_to_start():
    result = invoke("--help")
    assert result.exit_code == 0
    for name in OURS:
        assert f"  {name} " in result.output
    assert "Start here" in result.output and "PARAMSERVER_<OPTION>" in result.output


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and "paramserver" in result.output


@pytest.mark.parametrize("command", OURS)
def test_help_of_every_command_has_examples(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert f"Usage: paramserver {command}" in result.output
    assert "Examples" in result.output or "torchrun" in result.output
    assert "paramserver " + command in result.output.split("Options:")[-1]


@pytest.mark.parametrize("command", ["server", "worker", "launch", "run"])
def test_every_option_names_its_environment_variable(command):
    text = invoke(command, "--help").output
    for name in option_names(command):
        assert f"PARAMSERVER_{name.upper().replace('-', '_')}" in text.replace("\n", "")\
            .replace(" ", ""), name


def test_optional_command_modules_register_with_one_line(tmp_path, monkeypatch):
    (tmp_path / "ps_extra_cmds.py").write_text(textwrap.dedent("""
        import click
        __all__ = ["hello", "helper"]

        @click.command("hello")
        def hello():
            click.echo("hi")

        def helper():  # not a command: not registered
            pass
    """))
    (tmp_path / "ps_broken_cmds.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    group = click.Group("g")
    register_commands(group, ["cli.not_written_yet", "ps_extra_cmds"])
    assert list(group.commands) == ["hello"]
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        register_commands(group, ["ps_broken_cmds"])  # a real error is never hidden


# --------------------------------------------------------------------------- option errors


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "foo"], "'foo' is not one of 'sync', 'async', 'ssp'"),
    (["--policy", "nope"], "unknown staleness policy 'nope'; known: "),
    (["--policy", "reject", "--policy-arg", "foo=1"], "has no parameter 'foo'; accepted: "
                                                      "max_staleness"),
    (["--policy-arg", "max_staleness"], "must look like key=value"),
    (["--optimizer", "adamx"], "unknown optimizer 'adamx'; known: adadelta"),
    (["--optimizer-arg", "foo=1"], "accepted: lr, momentum"),
    (["--scheduler", "step"], "StepLR needs step_size"),
    (["--delay", "gamma:1"], "uniform:LOW,HIGH"),
    (["--device", "tpu"], "device must be auto, cpu or cuda:N"),
    (["--steps", "0"], "0 is not in the range x>=1"),
    (["--task", "nope"], "unknown task 'nope'; known: digits-mlp"),
    (["--steps", "5", "--epochs", "1"], "give --steps or --epochs, not both"),
    (["--straggler", "7:slowdown=2"], "worker 7 does not exist: ranks are 0 .. 1"),
    (["--straggler", "1:speed=2"], "KEY one of slowdown, slow_prob"),
    (["--backup-workers", "1"], "backup workers only apply to sync mode"),
    (["--mode", "sync", "-n", "2", "--backup-workers", "2"], "must be fewer than the expected"),
    (["--slow-prob", "2"], "2.0 is not in the range 0<=x<=1"),
    (["--on-divergence", "panic"], "'panic' is not one of 'warn', 'checkpoint-and-stop'"),
    (["--watchdog-arg", "ratio_hgih=0.5"], "unknown watchdog option(s): ratio_hgih"),
    (["--metrics-port", "65535", "-s", "2"], "leave room for 2 shard ports"),
])
def test_bad_launch_options_say_what_is_allowed(args, message):
    result = invoke("launch", *args, "--print-config")
    assert result.exit_code == 2
    assert message in result.output
    assert "env var" not in result.output  # the value came from a flag


def test_bad_value_from_the_environment_names_the_variable():
    result = invoke("launch", "--print-config", env={"PARAMSERVER_MODE": "fast"})
    assert result.exit_code == 2
    assert "PARAMSERVER_MODE" in result.output and "'fast' is not one of" in result.output


@pytest.mark.parametrize(("args", "message"), [
    ([], "Missing option '--servers'"),
    (["--servers", "localhost"], "is not an address like HOST:PORT"),
    (["--servers", "127.0.0.1:0"], "ports are 1..65535"),
    (["--servers", "127.0.0.1:5600", "--rank", "2", "--world-size", "2"],
     "rank must be in [0, 2)"),
])
def test_bad_worker_options(args, message):
    result = invoke("worker", *args, "--print-config")
    assert result.exit_code == 2 and message in result.output


def test_bad_server_options():
    result = invoke("server", "--shard", "2", "--num-shards", "2", "--print-config")
    assert result.exit_code == 2 and "shard must be in [0, 2)" in result.output
    result = invoke("server", "--port", "70000", "--print-config")
    assert result.exit_code == 2 and "70000 is not in the range 0<=x<=65535" in result.output
    result = invoke("server", "--host", "no-such-host.invalid", "--print-config")
    assert result.exit_code == 2 and "cannot resolve 'no-such-host.invalid'" in result.output


def test_observability_options_reach_the_configs():
    cfg = config("launch", "--metrics-port", "9100", "--tensorboard", "tb", "--on-divergence",
                 "stop", "--watchdog-arg", "ratio_high=0.5", "--watchdog-arg",
                 "disable=loss_stalled,worker_lag")
    assert (cfg["metrics-port"], cfg["tensorboard"], cfg["on-divergence"]) == (9100, "tb", "stop")
    assert cfg["watchdog-arg"] == {"ratio_high": 0.5, "disable": "loss_stalled,worker_lag"}
    assert config("server", "--metrics-port", "0")["metrics-port"] == 0


def test_server_host_and_port_make_the_bind_address():
    assert config("server")["host"] == "127.0.0.1"  # loopback unless told otherwise
    cfg = config("server", "--host", "0.0.0.0", "--port", "5600")
    assert (cfg["host"], cfg["port"]) == ("0.0.0.0", 5600)


def test_port_in_use_says_which():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = invoke("server", "--port", str(port))
    assert result.exit_code == 1
    assert f"cannot bind tcp://127.0.0.1:{port}: the port is already in use" in result.output


def test_unreachable_server_times_out_naming_address_and_role():
    port = free_port()
    result = invoke("worker", "--servers", f"127.0.0.1:{port}", "--timeout", "1",
                    "--steps", "1", "--device", "cpu")
    assert result.exit_code == 1
    assert f"shard 0 at tcp://127.0.0.1:{port}" in result.output
    assert "gave up waiting for a server" in result.output and "--timeout" in result.output


def test_status_of_an_unreachable_server():
    port = free_port()
    result = invoke("status", "--servers", f"127.0.0.1:{port}", "--timeout", "0.5")
    assert result.exit_code == 1
    assert f"shard 0 at tcp://127.0.0.1:{port}: no reply within 0.5s" in result.output
    result = invoke("status", "--servers", f"127.0.0.1:{port}", "--timeout", "0.5", "--json")
    assert json.loads(result.stdout) == [{"address": f"tcp://127.0.0.1:{port}",
                                          "error": "no reply"}]


def test_launch_refuses_to_mix_runs(tmp_path):
    (tmp_path / "result.json").write_text("{}")
    result = invoke("launch", "--out", str(tmp_path))
    assert result.exit_code == 2 and "holds an earlier run" in result.output


# --------------------------------------------------------------------------- configuration


def test_precedence_file_then_environment_then_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('mode = "ssp"\nstaleness-bound = 2\nsteps = 50\n')
    cfg = ["launch", "--config", str(toml)]
    env = {"PARAMSERVER_MODE": "async", "PARAMSERVER_STEPS": "60"}
    assert config("launch")["mode"] == "async"  # the default
    assert config(*cfg)["mode"] == "ssp"
    assert config(*cfg, env=env)["mode"] == "async"
    resolved = config(*cfg, "--mode", "sync", env=env)
    assert (resolved["mode"], resolved["steps"], resolved["staleness-bound"]) == ("sync", 60, 2)
    where = sources(*cfg, "--mode", "sync", env=env)
    assert where["mode"] == "flag"
    assert where["steps"] == "env PARAMSERVER_STEPS"
    assert where["staleness-bound"] == "config file"
    assert where["lr"] == "default"
    # the file may also come from the environment
    assert config("launch", env={"PARAMSERVER_CONFIG": str(toml)})["mode"] == "ssp"


def test_tables_per_command(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(textwrap.dedent("""
        steps = 10
        mode = "sync"
        servers = ["127.0.0.1:5600", "127.0.0.1:5601"]
        [server]
        port = 5600
        lr = 0.05
        [worker]
        steps = 20
        [launch]
        steps = 30
        num-workers = 3
        straggler = ["1:slowdown=3", "1:delay=exp:0.01"]
    """))
    launch = config("launch", "--config", str(toml))
    assert (launch["steps"], launch["num-workers"], launch["lr"]) == (30, 3, 0.05)
    assert launch["straggler"] == ["1:slowdown=3.0", "1:delay=exp:0.01"]
    worker = config("worker", "--config", str(toml))
    assert worker["steps"] == 20
    assert worker["servers"] == ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"]
    server = config("server", "--config", str(toml))
    assert (server["port"], server["mode"], server["lr"]) == (5600, "sync", 0.05)


def test_epochs_replace_steps_from_a_stronger_source(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 50\n")
    resolved = config("launch", "--config", str(toml), "--epochs", "2")
    assert resolved["epochs"] == 2 and "steps" not in resolved
    toml.write_text("epochs = 3\n")
    resolved = config("launch", "--config", str(toml), env={"PARAMSERVER_STEPS": "7"})
    assert resolved["steps"] == 7 and "epochs" not in resolved
    assert config("launch", "--epochs", "1.5")["epochs"] == 1.5


def test_key_value_options_from_every_source(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('optimizer-arg = { momentum = 0.9, nesterov = true }\n'
                    'policy-arg = { max_staleness = 3 }\npolicy = "reject"\n')
    env = {"PARAMSERVER_TASK_ARG": "hidden=32 dtype=float64"}
    resolved = config("launch", "--config", str(toml), "--optimizer-arg", "dampening=0",
                      env=env)
    assert resolved["optimizer-arg"] == {"dampening": 0}  # flags replace the file's list
    resolved = config("launch", "--config", str(toml), env=env)
    assert resolved["optimizer-arg"] == {"momentum": 0.9, "nesterov": True}
    assert resolved["policy-arg"] == {"max_staleness": 3}
    assert resolved["task-arg"] == {"hidden": "32", "dtype": "float64"}


def test_print_config_round_trips(tmp_path):
    args = ["launch", "-s", "3", "-n", "4", "--mode", "ssp", "--staleness-bound", "2",
            "--policy", "exponential", "--policy-arg", "decay=0.7", "--optimizer", "adam",
            "--optimizer-arg", "betas=0.9,0.99", "--scheduler", "step", "--scheduler-arg",
            "step_size=10", "--task-arg", "hidden=16", "--straggler", "2:slowdown=3",
            "--delay", "uniform:0,0.01", "--epochs", "2", "--quiet", "--no-eval"]
    first = invoke(*args, "--print-config").stdout
    saved = tmp_path / "saved.toml"
    saved.write_text(first)
    again = invoke("launch", "--config", str(saved), "--print-config").stdout
    assert tomllib.loads(again) == tomllib.loads(first)
    assert tomllib.loads(first)["optimizer-arg"] == {"betas": [0.9, 0.99]}


@pytest.mark.parametrize(("text", "message"), [
    ("stpes = 5", "unknown key 'stpes' in the top level; did you mean steps"),
    ('mode = "bogus"', "mode = 'bogus': 'bogus' is not one of"),
    ('[launch]\nhost = "127.0.0.1"', "unknown key 'host' in [launch]"),
    ('mode = ["sync"]', "mode takes one value"),
    ("launch = 3", "[launch] must be a table"),
    ("= 1", "is not valid TOML"),
])
def test_config_file_errors(tmp_path, text, message):
    toml = tmp_path / "bad.toml"
    toml.write_text(text + "\n")
    result = invoke("launch", "--config", str(toml), "--print-config")
    assert result.exit_code == 2
    assert message in result.output
    assert "bad.toml" in result.output


def test_missing_config_file():
    result = invoke("launch", "--config", "/nonexistent/run.toml")
    assert result.exit_code == 2 and "cannot read /nonexistent/run.toml" in result.output


def test_server_addresses_comma_separated_repeated_or_from_the_environment():
    resolved = config("worker", "--servers", "127.0.0.1:1,tcp://h:2", "--servers", "[::1]:3")
    assert resolved["servers"] == ["tcp://127.0.0.1:1", "tcp://h:2", "tcp://[::1]:3"]
    env = {"PARAMSERVER_SERVERS": "127.0.0.1:1 127.0.0.1:2"}
    assert config("worker", env=env)["servers"] == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]


# --------------------------------------------------------------------------- listings


def test_policies_lists_builtins_with_parameters():
    result = invoke("policies")
    assert result.exit_code == 0
    for name in ("none", "reject", "inverse", "exponential"):
        assert name in result.output
    assert "max_staleness: int = 4" in result.output and "decay: float = 0.5" in result.output
    rows = json.loads(invoke("policies", "--json").stdout)
    reject = next(r for r in rows if r["name"] == "reject")
    assert reject["parameters"] == {"max_staleness": {"type": "int", "default": 4}}
    assert reject["from"] == "built-in"


def test_policies_describes_a_plugin_class():
    rows = json.loads(invoke("policies", "tests.policies_fixture:OnlyWorker", "--json").stdout)
    assert rows[0]["parameters"]["worker"]["default"] == 0
    assert rows[0]["from"] == "tests.policies_fixture"
    result = invoke("policies", "nope")
    assert result.exit_code == 2 and "unknown staleness policy 'nope'; known: " in result.output


def test_tasks_lists_builtins_with_parameters():
    result = invoke("tasks")
    assert result.exit_code == 0
    for name in ("digits-mlp", "synthetic-logreg", "synthetic-mlp"):
        assert name in result.output
    rows = {r["name"]: r for r in json.loads(invoke("tasks", "--json").stdout)}
    assert rows["digits-mlp"]["parameters"]["hidden"] == {"type": "int", "default": 64}
    assert "rank" not in rows["digits-mlp"]["parameters"]
    rows = json.loads(invoke("tasks", "tests.tasks_fixture:make_task", "--json").stdout)
    assert rows[0]["parameters"]["scale"] == {"type": "float", "default": 1.0}
    assert invoke("tasks", "nope").exit_code == 2


# --------------------------------------------------------------------------- run


def test_run_outside_a_launcher_explains():
    result = invoke("run")
    assert result.exit_code == 2
    assert "torchrun" in result.output and "paramserver launch" in result.output


def test_run_with_too_few_ranks():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    result = invoke("run", "--num-servers", "2", env=env)
    assert result.exit_code == 2 and "cannot hold 2 server(s)" in result.output


def test_run_print_config_needs_no_launcher():
    resolved = config("run", "--num-servers", "2", "--port", "5600", "--mode", "sync")
    assert (resolved["num-servers"], resolved["port"], resolved["mode"]) == (2, 5600, "sync")


def test_console_script_is_cli_main():
    setup = (Path(__file__).parent.parent / "setup.cfg").read_text()
    assert "paramserver = paramserver.cli.main:main" in setup
    assert sys.modules["paramserver.cli.main"].main is main


def test_installed_task_and_policy_plugins_are_listed(tmp_path, monkeypatch):
    import paramserver.policies.registry as S
    import paramserver.workers.tasks as T
    from paramserver.util import plugins

    dist = tmp_path / "myplugins-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{T.ENTRY_POINT_GROUP}]\ntiny-linear = tests.tasks_fixture:make_task\n"
        f"broken = tests.no_such_module:make\n"
        f"[{S.ENTRY_POINT_GROUP}]\nhalve = tests.policies_fixture:Halve\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_loaded", set())
    for module in (T, S):
        monkeypatch.setattr(module, "_REGISTRY", dict(module._REGISTRY))
    monkeypatch.setattr(T, "_DESCRIPTIONS", dict(T._DESCRIPTIONS))
    tasks = {r["name"]: r for r in json.loads(invoke("tasks", "--json").stdout)}
    assert tasks["tiny-linear"]["from"] == "tests.tasks_fixture"  # the broken one is skipped
    assert tasks["tiny-linear"]["parameters"]["scale"]["default"] == 1.0
    assert "broken" not in tasks and "digits-mlp" in tasks
    policies = {r["name"] for r in json.loads(invoke("policies", "--json").stdout)}
    assert {"halve", "reject"} <= policies
    assert config("launch", "--task", "tiny-linear")["task"] == "tiny-linear"


def test_a_policy_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "localpolicy_xyz.py").write_text(textwrap.dedent("""
        from paramserver.policies import Decision, StalenessPolicy

        class Halve(StalenessPolicy):
            name = "halve-local"

            def decide(self, update):
                return Decision(True, 0.5)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cfg = config("launch", "--policy", "localpolicy_xyz:Halve")
    assert cfg["policy"] == "localpolicy_xyz:Halve"
    assert str(tmp_path) == sys.path[-1]  # appended: never shadows an installed package


def test_early_parts_is_one_client_option_of_worker_launch_and_run():
    # declared once (WorkerConfig), so every command that starts a worker takes it, off
    # by default (it pays across hosts only)
    base = {"worker": ["--servers", "127.0.0.1:5600", "--steps", "1"], "launch": [],
            "run": []}
    for command, args in base.items():
        assert config(command, *args)["early-parts"] is False
        assert config(command, *args, "--early-parts")["early-parts"] is True
