"""Bad input to the CLI: one line naming the culprit, exit code 2, before any process
starts (CliRunner: nothing is spawned; a fixed port is held by this test)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result

from paramserver.cli.main import main

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other process listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def one_line_error(result: Result) -> str:
    """The error's one line (click's usage lines above it aside); no traceback."""
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.output
    return errors[0]


WORKER = ["worker", "--servers", "127.0.0.1:5600"]


@pytest.mark.parametrize(("args", "message"), [
    # a task argument the factory does not take: refused before a worker starts
    (["launch", "--task-arg", "hiden=3"],
     "task 'digits-mlp' has no argument 'hiden'; accepted: seed, batch_size, dtype, hidden"),
    ([*WORKER, "--task-arg", "hiden=3"], "has no argument 'hiden'"),
    (["launch", "--task-arg", "hidden=lots"], "argument hidden: 'lots' is not a valid int"),
    # a policy whose constructor raises
    (["launch", "--policy", "tests.broken_policies:BoomInit"],
     "policy tests.broken_policies:BoomInit failed to construct: the policy's own "
     "constructor blew up"),
    (["server", "--policy", "tests.broken_policies:BoomInit"],
     "policy tests.broken_policies:BoomInit failed to construct"),
    (["run", "--policy", "tests.broken_policies:BoomInit"],
     "policy tests.broken_policies:BoomInit failed to construct"),
    (["experiment", "--policy", "tests.broken_policies:BoomInit", "--out", "unused"],
     "policy tests.broken_policies:BoomInit failed to construct"),
    # an optimizer argument of the wrong kind
    (["launch", "--optimizer-arg", "momentum=abc"], "momentum must be a number"),
    (["server", "--optimizer-arg", "momentum=abc"], "momentum must be a number"),
])
def test_bad_input_is_one_line_naming_the_culprit(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(*args, *(["--print-config"] if args[0] != "experiment" else []))
    assert result.exit_code == 2, result.output
    assert message in one_line_error(result)
    assert not any(tmp_path.iterdir())  # no run folder was made


@pytest.mark.parametrize("command", ["server", "launch"])
def test_busy_metrics_port_is_one_line_before_anything_starts(command, busy_port, tmp_path):
    out = tmp_path / "run"
    extra = ["--out", str(out)] if command == "launch" else []
    result = invoke(command, "--metrics-port", str(busy_port), *extra)
    assert result.exit_code == 2, result.output
    assert one_line_error(result) == f"Error: --metrics-port {busy_port}: address in use"
    assert not out.exists()


@pytest.mark.parametrize(("text", "shown"), [("20.5", "20.5"), ("true", "True")])
@pytest.mark.parametrize("command", ["launch", "worker"])
def test_a_fraction_in_the_config_file_is_refused_like_the_flag(command, text, shown,
                                                               tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f"steps = {text}\n")
    args = ["--servers", "127.0.0.1:5600"] if command == "worker" else []
    result = invoke(command, *args, "--config", str(path), "--print-config")
    assert result.exit_code == 2, result.output
    assert f"steps = {shown}: {shown} is not a valid integer" in one_line_error(result)
    flag = invoke(command, *args, "--steps", "20.5", "--print-config")
    assert flag.exit_code == 2 and "'20.5' is not a valid integer" in flag.output


def test_a_whole_number_in_the_config_file_still_works(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("steps = 20\n")
    result = invoke("launch", "--config", str(path), "--print-config")
    assert result.exit_code == 0, result.output
    assert "steps = 20 " in result.output



def test_shard_addresses_out_of_order_are_named(monkeypatch):
    """Each HELLO reply says which shard answered: the client compares it with the
    address's place in --servers (no server needed: the replies are made here)."""
    import torch

    from paramserver.core.sharding import ShardPlan
    from paramserver.errors import ConfigError
    from paramserver.wire.protocol import Message, Op, reply
    from paramserver.workers.client import PSClient

    plan = ShardPlan.from_module(torch.nn.Linear(4, 3), 3)
    addresses = ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"]
    with PSClient(addresses, plan, worker=0, heartbeat_interval=0, timeout=1) as client:
        def answered_by(*shards: int) -> None:
            # the address at place i is answered by shard shards[i]; connect() asks
            # shard 0 alone first, then the rest
            hello = Message(Op.HELLO, 1)
            monkeypatch.setattr(client, "call", lambda msgs, op, asked, **k: [
                reply(hello, shard=shards[i], num_shards=3, clock=0) for i in asked])

        answered_by(0, 1, 2)
        assert client.connect() == 0
        answered_by(2, 1, 0)
        with pytest.raises(ConfigError) as info:
            client.connect()
    assert str(info.value) == ("address 0 (tcp://127.0.0.1:5600) is shard 2; give the "
                               "addresses in shard order")


def test_a_worker_killed_by_a_shards_internal_error_names_the_shard(tmp_path):
    """The logs as a launch with a policy whose decide() raises leaves them (trimmed)."""
    from paramserver.workers.launch.processes import shard_cause

    worker = tmp_path / "worker0.log"
    worker.write_text(
        'Traceback (most recent call last):\n'
        '  File "/x/paramserver/workers/client.py", line 340, in _call\n'
        '    raise error\n'
        "paramserver.errors.RemoteInternalError: shard 1 at tcp://127.0.0.1:40359 refused "
        "the request: internal: ZeroDivisionError: boom\n")
    servers = [tmp_path / "server0.log", tmp_path / "server1.log"]
    servers[0].write_text("nothing wrong here\n")
    servers[1].write_text(
        "ERROR internal error while handling a message\n"
        'Traceback (most recent call last):\n'
        '  File "/x/paramserver/core/shard.py", line 684, in _decide\n'
        '    decision = self.policy.decide(info)\n'
        '               ^^^^^^^^^^^^^^^^^^^^^^^^\n'
        '  File "/x/mypkg/broken.py", line 26, in decide\n'
        '    raise ZeroDivisionError("boom")\n'
        "ZeroDivisionError: boom\n")
    assert shard_cause(worker, servers) == (
        "shard 1 failed handling a request: ZeroDivisionError: boom\n"
        '  at File "/x/mypkg/broken.py", line 26, in decide: raise ZeroDivisionError("boom")\n'
        f"  (its log: {servers[1]})\n")
    worker.write_text("RequestTimeoutError: shard 0 did not answer\n")
    assert shard_cause(worker, servers) == ""


def test_help_and_listings_show_brackets_and_no_rst_markup():
    policies = CliRunner().invoke(main, ["policies"], env={"COLUMNS": "200"})
    assert policies.exit_code == 0, policies.output
    assert "[s_min, s_max]" in policies.output
    export = invoke("checkpoint", "export", "--help")
    assert export.exit_code == 0 and "``" not in export.output
    assert "model.load_state_dict(safetensors.torch.load_file(OUT))" in export.output


def test_launches_without_out_in_the_same_second_get_folders_of_their_own(tmp_path,
                                                                           monkeypatch):
    from paramserver.cli.launch import _out_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt, *a: "launch-20260101-000000")
    first, second = _out_dir(None, False), _out_dir(None, False)
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == "launch-20260101-000000-2"
