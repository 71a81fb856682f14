"""Every option declared once: the config dataclasses' fields are the flags, their help,
their bounds, their environment variables and their TOML keys; one coercer, one registry."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import pytest

from paramserver.cli.main import main
from paramserver.cli.options import field_specs
from paramserver.core.optim import build_optimizer
from paramserver.errors import ConfigError, RegistryError
from paramserver.policies import create_policy
from paramserver.server.config import OPTION, ServerConfig, check_bounds
from paramserver.util.coerce import coerce
from paramserver.util.plugins import Registry
from paramserver.workers.launch.cluster import ClusterSpec
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
#: each config dataclass and the command whose flags set its fields
OWNERS = [(ServerConfig, "server"), (WorkerConfig, "worker"), (StragglerSpec, "worker"),
          (ClusterSpec, "launch")]


def _params(command: str) -> dict[str, click.Option]:
    cmd = main.commands[command]  # type: ignore[attr-defined]
    return {p.name: p for p in cmd.params if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize(("cls", "command"), OWNERS, ids=lambda x: getattr(x, "__name__", x))
def test_every_field_has_a_flag_with_its_help(cls, command):
    params = _params(command)
    for f in dataclasses.fields(cls):
        opt = f.metadata.get(OPTION)
        assert opt is not None, f"{cls.__name__}.{f.name} is declared without option()"
        if opt.internal or opt.nested:
            assert opt.internal or dataclasses.is_dataclass(f.default_factory()), f.name
            continue
        name = opt.dest or f.name
        assert name in params, f"{cls.__name__}.{f.name} has no flag in `paramserver {command}`"
        param = params[name]
        assert param.help == opt.help, f"--{opt.flag or f.name}: help differs from the field's"
        flag = "--" + (opt.flag or f.name.replace("_", "-"))
        assert flag in param.opts
        assert param.envvar == "PARAMSERVER_" + flag[2:].upper().replace("-", "_")


def test_the_new_worker_flags_reach_the_config():
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["launch", "--overlap", "--bucket-bytes", "1024",
                                    "--wire-dtype", "bfloat16", "--print-config"])
    assert out.exit_code == 0, out.output
    assert "overlap = true" in out.stdout and "bucket-bytes = 1024" in out.stdout
    assert 'wire-dtype = "bfloat16"' in out.stdout
    bad = CliRunner().invoke(main, ["worker", "--servers", "127.0.0.1:1", "--wire-dtype",
                                    "int8", "--print-config"])
    assert bad.exit_code == 2 and "int8" in bad.output


def test_docs_tables_name_every_flag():
    text = DOCS.read_text(encoding="utf-8")
    for cls, _command in OWNERS:
        for spec in field_specs(cls):
            assert f"`{spec.flag}" in text or f", {spec.flag}" in text, \
                f"docs/cli.md does not list {spec.flag} ({cls.__name__})"


def test_bounds_come_from_the_declaration():
    with pytest.raises(ConfigError, match=r"checkpoint_keep must be >= 1, got 0"):
        ServerConfig(checkpoint_keep=0)
    with pytest.raises(ConfigError, match=r"heartbeat.timeout must be > 0"):
        ServerConfig(heartbeat_timeout=0)
    with pytest.raises(ConfigError, match=r"bucket_bytes must be >= 1, got 0"):
        WorkerConfig(bucket_bytes=0)
    check_bounds(ServerConfig())


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("yes", True), ("on", True), ("1", True), ("ON", True),
    ("false", False), ("no", False), ("off", False), ("0", False),
])
def test_one_bool_everywhere(text, value):
    assert coerce(text, bool) is value
    assert coerce(text, "bool | None") is value
    assert create_policy("gap-aware", {"bias_correction": text}).bias_correction is value
    import torch

    opt = build_optimizer("sgd", [torch.zeros(2, requires_grad=True)],
                          {"lr": "0.1", "momentum": "0.9", "nesterov": text})
    assert opt.defaults["nesterov"] is value


def test_coerce_by_annotation():
    assert coerce("3", int) == 3 and coerce("3", float) == 3.0 and coerce("3", str) == "3"
    assert coerce("none", "int | None") is None and coerce("4", "int | None") == 4
    assert coerce("1,2", list[int]) == [1, 2] and coerce("0.9,0.99", "tuple[float, ...]") \
        == (0.9, 0.99)
    assert coerce("7", default=1.5) == 7.0  # no annotation: the default's type
    assert coerce("x", untyped=str) == "x" and coerce("2") == 2  # else guessed
    assert coerce(5, bool) == 5  # typed values pass
    with pytest.raises(ConfigError, match=r"k: 'maybe' is not a bool"):
        coerce("maybe", bool, what="k")
    with pytest.raises(ConfigError, match="not a valid int"):
        coerce("1.5", int)


def test_one_registry_class():
    reg: Registry[int] = Registry("widget", hint="or module:name")
    reg.register("a", 1)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("a", 2)
    with pytest.raises(RegistryError, match="not allowed"):
        reg.register("m:x", 3)
    with pytest.raises(RegistryError, match=r"unknown widget 'b'; known: a \(or module:name\)"):
        reg.resolve("b")
    assert reg.resolve("a") == 1 and "a" in reg and reg.available() == {"a": 1}
    assert reg.resolve("math:pi") == pytest.approx(3.14159, abs=1e-4)


def test_one_dtype_table():
    from paramserver.core import sharding
    from paramserver.util import dtypes
    from paramserver.workers import client

    assert sharding.DTYPES is dtypes.PARAM_DTYPES
    assert client.GRAD_WIRE_DTYPES is dtypes.GRAD_WIRE_DTYPES
    assert sharding.dtype_name is dtypes.dtype_name
    assert all(dtypes.DTYPES[k] is v for k, v in dtypes.WIRE_DTYPES.items())


def test_server_config_moved_but_still_importable():
    from paramserver.server import loop as server

    assert server.ServerConfig is ServerConfig
    assert re.search(r"class ServerConfig", Path(server.__file__).read_text()) is None
