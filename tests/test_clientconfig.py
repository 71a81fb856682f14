"""Configuration declared once (issue 44): the option tables against the records they
land in (ClientConfig, LaunchOptions, CoreConfig), the optimizer's one config value,
Retry as one value, and the fault seam kept out of the options."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Sequence
from pathlib import Path

import pytest

from paramserver.core.modes import CoreConfig
from paramserver.errors import ConfigError
from paramserver.observe.events import EventLog
from paramserver.server.config import CORE_DERIVED, CORE_ONLY, ServerConfig, field_default
from paramserver.util import faults
from paramserver.wire.retry import Retry
from paramserver.workers.clientconfig import ClientConfig
from paramserver.workers.config import LaunchOptions, WorkerConfig
from paramserver.workers.stragglerspec import StragglerSpec

ROOT = Path(__file__).resolve().parents[1]
WORKER = {f.name: f for f in dataclasses.fields(WorkerConfig)}
SERVER = {f.name: f for f in dataclasses.fields(ServerConfig)}


def _hints(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls, localns={"EventLog": EventLog})


def _same_type(record: typing.Any, declared: typing.Any) -> bool:
    """A record's field type against its option's (a list option is a sequence there)."""
    if typing.get_origin(declared) is list:  # any sequence there, kept as a tuple
        return typing.get_origin(record) is Sequence and \
            typing.get_args(record) == typing.get_args(declared)
    return bool(record == declared)


def test_every_client_option_is_a_worker_option_of_the_same_type_and_default() -> None:
    hints, declared = _hints(ClientConfig), _hints(WorkerConfig)
    options = ClientConfig.options()
    assert set(options) <= set(WORKER), set(options) - set(WORKER)
    for f in dataclasses.fields(ClientConfig):
        if f.name in ClientConfig.NOT_OPTIONS:
            assert f.name not in WORKER, f"{f.name} is an option: it must land as one"
            continue
        assert _same_type(hints[f.name], declared[f.name]), f.name
        default = field_default(f)
        want = field_default(WORKER[f.name])
        assert (tuple(want) if isinstance(want, list) else want) == default, f.name


def test_every_worker_option_lands_in_one_record() -> None:
    """An option the client does not take is the built-in loop's (worker.py reads it)."""
    loop = set(WORKER) - set(ClientConfig.options())
    source = (ROOT / "paramserver/workers/worker.py").read_text() + \
        (ROOT / "paramserver/workers/tasks.py").read_text()
    unread = sorted(n for n in loop if not re.search(rf"config\.{n}\b", source))
    assert not unread, f"worker options that land nowhere: {unread}"


def test_the_launchers_options_are_the_clients() -> None:
    hints, client = _hints(LaunchOptions), _hints(ClientConfig)
    for f in dataclasses.fields(LaunchOptions):
        assert f.name in ClientConfig.options(), f.name
        assert hints[f.name] == client[f.name], f.name
        assert field_default(f) == field_default(
            next(c for c in dataclasses.fields(ClientConfig) if c.name == f.name)), f.name


def _changed(value: typing.Any, name: str) -> typing.Any:
    """A valid value of option ``name`` other than ``value``."""
    special = {"servers": ["tcp://127.0.0.1:9"], "wire_dtype": "float16",
               "straggler": StragglerSpec(slowdown=2.0), "run_id": "r1", "curve_key": "a",
               "curve_server_key": "b", "event_log": "e.jsonl", "result_file": "r.json",
               "rank": 1, "world_size": 3, "evaluator": 2, "early_parts": True,
               "mode": "ssp", "lr_scaling": "linear", "optimizer": "adam",
               "scheduler": "step", "scheduler_args": {"step_size": 3},
               "optimizer_args": {"lr": 0.5}, "check_finite": False, "shard": 1,
               "num_shards": 2, "momentum_target": 0.5, "round_timeout": 7.0,
               "max_workers": 9, "expected_workers": 4}
    if name in special:
        return special[name]
    return value * 2 + 1 if isinstance(value, int | float) and not isinstance(value, bool) \
        else value


def test_client_config_of_a_worker_config_takes_every_option() -> None:
    given = {n: _changed(field_default(WORKER[n]), n) for n in ClientConfig.options()}
    worker = WorkerConfig(**given)
    client = ClientConfig.of(worker)
    for name in ClientConfig.options():
        want = getattr(worker, name)
        assert getattr(client, name) == (tuple(want) if isinstance(want, list) else want), name


def test_core_config_is_derived_from_the_server_options() -> None:
    hints, declared = _hints(CoreConfig), _hints(ServerConfig)
    for f in dataclasses.fields(CoreConfig):
        if f.name in CORE_DERIVED:
            assert set(CORE_DERIVED[f.name]) <= set(SERVER), f.name
        elif f.name in CORE_ONLY:
            assert f.name not in SERVER, f"{f.name} is an option: it must land in the core"
        else:
            assert f.name in SERVER, f"CoreConfig.{f.name} is no server option"
            # (a table is a Mapping in the core, a dict as an option)
            assert hints[f.name] == declared[f.name] or f.name.endswith("_args"), f.name
    names = [n for n in {f.name for f in dataclasses.fields(CoreConfig)}
             if n not in CORE_DERIVED and n not in CORE_ONLY]
    config = ServerConfig(num_shards=2, expected_workers=4, staleness_bound=2, **{
        n: _changed(field_default(SERVER[n]), n) for n in names
        if n not in ("expected_workers",)})
    core = config.core_config()
    for name in names:
        assert getattr(core, name) == getattr(config, name), name
    assert core.mode == config.mode_spec()
    assert core.optimizer_args is not config.optimizer_args  # a copy: never shared


def test_the_optimizer_takes_at_most_eight_parameters() -> None:
    from paramserver.workers.optimizer import DistributedOptimizer

    params = inspect.signature(DistributedOptimizer.__init__).parameters
    assert len(params) - 1 <= 8, list(params)  # (self)
    assert "config" in params


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"servers": ["tcp://127.0.0.1:9"], "timeout": 3.0},
     "give config=ClientConfig(servers=..., timeout=...)"),
    ({"request_timeout": 1.0}, "ClientConfig.from_env(request_timeout=...)"),
    ({"drop_rate": 0.1}, faults.DROP_RATE),
])
def test_an_old_keyword_is_refused_in_one_line_naming_the_config_field(
        kwargs: dict[str, typing.Any], says: str) -> None:
    import torch

    from paramserver.workers.optimizer import DistributedOptimizer

    with pytest.raises(TypeError) as info:
        DistributedOptimizer(torch.nn.Linear(2, 1), **kwargs)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_from_env_reads_the_launchers_environment_and_given_values_win(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARAMSERVER_SERVERS", "tcp://a:1, tcp://b:2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("PARAMSERVER_RUN", "run-7")
    monkeypatch.delenv("PARAMSERVER_WORKER_OPTIONS", raising=False)
    config = ClientConfig.from_env(timeout=9.0)
    assert config.servers == ("tcp://a:1", "tcp://b:2")
    assert (config.rank, config.world_size, config.run_id) == (1, 3, "run-7")
    assert config.timeout == 9.0 and config.request_timeout == 5.0
    assert ClientConfig.from_env(rank=2).rank == 2
    with pytest.raises(ConfigError, match=r"rank must be in \[0, 3\), got 3"):
        ClientConfig.from_env(rank=3)


def test_client_config_is_immutable_and_checks_the_declared_bounds() -> None:
    config = ClientConfig(servers=["tcp://a:1"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="request_timeout must be > 0"):
        ClientConfig(request_timeout=0)
    with pytest.raises(ConfigError, match="part_bytes must be >= 0"):
        ClientConfig(part_bytes=-1)


def test_retry_is_one_value_from_the_timeouts() -> None:
    retry = Retry.within(60.0, 5.0)
    assert (retry.attempt, retry.retries, retry.total) == (5.0, 11, 60.0)
    assert Retry.within(2.0, 5.0) == Retry(2.0, 0)  # an attempt no longer than the whole
    assert Retry.of(0.5) == Retry(0.5) and Retry.of(retry) is retry
    assert retry.judged() is retry  # nothing new: the same value
    judge = retry.judged(patience=lambda lost: True)
    assert judge.patience is not None and (judge.attempt, judge.retries) == (5.0, 11)
    assert retry.patience is None  # unchanged
    with pytest.raises(AttributeError):
        retry.attempt = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="attempt timeout must be > 0"):
        Retry(0.0)
    with pytest.raises(ConfigError, match="retries must be >= 0"):
        Retry(1.0, -1)


def test_request_all_takes_a_retry_for_the_loose_parameters() -> None:
    from paramserver.wire.transport import request_all

    params = inspect.signature(request_all).parameters
    assert "retry" in params
    assert not {"timeout", "retries", "patience", "patience_from"} & set(params)


def test_faults_are_no_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from paramserver.cli import options

    specs = [s for group in options.COMMAND_GROUPS.values() for g in group for s in g]
    assert not [s.flag for s in specs if "drop" in s.flag]
    assert not [s.kwargs["envvar"] for s in specs
                if str(s.kwargs.get("envvar")).startswith(faults.PREFIX)]
    assert faults.drop_rate() == 0.0
    monkeypatch.setenv(faults.DROP_RATE, "0.25")
    assert faults.drop_rate() == 0.25
    monkeypatch.setenv(faults.DROP_RATE, "1")
    with pytest.raises(ConfigError, match=r"PARAMSERVER_FAULT_DROP_RATE must be in \[0, 1\)"):
        faults.drop_rate()
