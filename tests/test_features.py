"""The feature-pair table (paramserver/core/features.py), walked: every pair marked as
working names an end-to-end test that exists, every refused pair is refused by the
CLI at start (exit 2, one line, before any process starts: CliRunner, with
--print-config so that a pair the CLI let through would print, not run), and
docs/reliability.md shows the table as it is."""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from paramserver.cli.main import main
from paramserver.core import features
from paramserver.core.features import BUILTIN_POLICIES, PAIRS, pair, policy_feature
from paramserver.core.replica import unreplicable

pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py

ROOT = Path(__file__).resolve().parent.parent

#: the flags that turn each feature of a refused pair on, for `launch` and `run`
FLAGS: dict[str, list[str]] = {
    "replicas": ["--replicas", "1"],
    "sparse": ["--task", "recsys"],
    "local_sgd": ["--local-optimizer", "sgd"],
    "overlap": ["--overlap"],
    "compression": ["--compression", "int8"],
    "pull_compression": ["--pull-compression", "int8"],
    "live_reshard": ["--reshard-at", "2:3", "--mode", "sync"],
    "backup_workers": ["--backup-workers", "1"],
    "trace": ["--trace"],  # (before the features below: a command's "--" ends the flags)
    "resume": ["--resume", str(Path(__file__).resolve().parent)],
    # a checkpoint reshard is a --resume (on another shard count): its pairs refused as
    # --resume's are, by the same check
    "reshard": ["--resume", str(Path(__file__).resolve().parent)],
    "command": ["--", "true"],
    "wire_dtype": ["--wire-dtype", "bfloat16"],
    "hosts": ["--hosts", "2+1"],
    **{policy_feature(p): ["--policy", p] for p in BUILTIN_POLICIES},
}


def _ordered(key: frozenset[str]) -> tuple[str, str]:
    a, b = sorted(key, key=list(features.FEATURES).index)
    return a, b


#: what a script passes DistributedOptimizer for a feature (_script_kwargs)
SCRIPTED = ("script_optimizer", "local_sgd", "overlap")

WORKING = sorted(_ordered(k) for k, p in PAIRS.items() if p.status == "works")
#: refused pairs with a feature only a script turns on and one a script turns on too:
#: DistributedOptimizer refuses them
SCRIPT_REFUSED = sorted(_ordered(k) for k, p in PAIRS.items() if p.status == "refused"
                        and k & set(features.SCRIPT_ONLY) and k <= set(SCRIPTED))
#: the others: `launch` refuses them (a script-only feature with one only a launch turns
#: on, --trace say, as a command: a script runs as one)
REFUSED = sorted(_ordered(k) for k, p in PAIRS.items() if p.status == "refused"
                 and _ordered(k) not in SCRIPT_REFUSED)


@cache
def _tests_in(path: Path) -> frozenset[str]:
    """The test functions of a test module (``name`` and ``Class::name``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body
                      if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    return frozenset(n for n in names if n.split("::")[-1].startswith("test_"))


def _error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize(("a", "b"), WORKING)
def test_a_working_pair_names_an_end_to_end_test_that_exists(a: str, b: str) -> None:
    path, _, name = pair(a, b).test.partition("::")
    assert path.startswith("tests/test_") and (ROOT / path).is_file(), pair(a, b).test
    assert name in _tests_in(ROOT / path), f"{a} + {b}: no test {name} in {path}"


@pytest.mark.parametrize(("a", "b"), REFUSED)
def test_a_refused_pair_is_refused_by_launch_at_start(a: str, b: str) -> None:
    flags = {**FLAGS, "script_optimizer": FLAGS["command"]}  # (a script is a command)
    result = CliRunner().invoke(main, ["launch", *flags[a], *flags[b], "--print-config"],
                                catch_exceptions=False)
    assert pair(a, b).why in _error(result)


def _script_kwargs(feature: str) -> dict[str, object]:
    """What a script passes DistributedOptimizer to turn ``feature`` on."""
    import torch

    model = torch.nn.Linear(2, 1)
    return {"script_optimizer": {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)},
            "local_sgd": {"local": torch.optim.SGD(model.parameters(), lr=0.1)},
            "overlap": {"overlap": True}}[feature] | {"model": model}


@pytest.mark.parametrize(("a", "b"), SCRIPT_REFUSED)
def test_a_refused_pair_a_script_turns_on_is_refused_before_it_connects(a: str, b: str) -> None:
    from paramserver.errors import ConfigError
    from paramserver.workers.optimizer import ClientConfig, DistributedOptimizer

    kwargs = _script_kwargs(a) | _script_kwargs(b)
    model = kwargs.pop("model")
    for k, v in list(kwargs.items()):  # every optimizer over the one model's parameters
        if isinstance(v, object) and hasattr(v, "param_groups"):
            kwargs[k] = type(v)(model.parameters(), lr=0.1)
    # a port nothing listens on: a pair let through would fail connecting, not here
    with pytest.raises(ConfigError, match="does not work with") as info:
        DistributedOptimizer(model, config=ClientConfig(servers=["127.0.0.1:9"]),
                             **kwargs)  # type: ignore[arg-type]
    assert str(info.value).endswith(pair(a, b).why)


@pytest.mark.parametrize("command", ["launch", "run", "server"])
def test_every_command_refuses_a_pair_from_the_same_table(command: str) -> None:
    a, b = "replicas", policy_feature("dc-asgd")
    result = CliRunner().invoke(main, [command, *FLAGS[a], *FLAGS[b], "--print-config"],
                                catch_exceptions=False)
    assert _error(result).endswith(pair(a, b).why)
    if command != "server":  # (a server has no task: its plan brings the tables)
        result = CliRunner().invoke(main, [command, *FLAGS["replicas"], *FLAGS["sparse"],
                                           "--print-config"], catch_exceptions=False)
        assert _error(result).endswith(pair("replicas", "sparse").why)


def test_an_experiment_refuses_a_pair_before_its_first_run(tmp_path: Path) -> None:
    spec = tmp_path / "grid.toml"
    spec.write_text('task = "recsys"\nreplicas = 1\nmodes = ["async"]\nworkers = [2]\n'
                    'scenarios = ["none"]\nsteps = 2\n', encoding="utf-8")
    result = CliRunner().invoke(main, ["experiment", "--spec", str(spec), "--out",
                                       str(tmp_path / "out")], catch_exceptions=False)
    assert _error(result).endswith(pair("replicas", "sparse").why)
    assert not (tmp_path / "out").exists()


def test_a_script_and_a_shard_refuse_what_the_launcher_refuses() -> None:
    """check() is what DistributedOptimizer and a shard adopting a plan call."""
    with pytest.raises(Exception, match="--replicas does not work with a sparse table"):
        features.check(features.active(replicas=1, sparse=True))
    features.check(features.active(replicas=1, policy="reject", curve=True, resume=True))


def test_the_builtin_policies_replicas_refuses_are_those_replication_cannot_follow() -> None:
    """The table holds the rule for the built-in policies; ``unreplicable`` (which asks
    a plug-in policy's hooks) agrees with it for each."""
    from paramserver.policies import available_policies, resolve_policy

    assert set(BUILTIN_POLICIES) | {"none"} <= set(available_policies())
    for name in BUILTIN_POLICIES:
        refused = pair("replicas", policy_feature(name)).status == "refused"
        assert refused == bool(unreplicable(resolve_policy(name))), name


def test_the_sparse_tasks_are_those_whose_model_holds_sharded_tables() -> None:
    from paramserver.workers.tasks import available_tasks

    for name, factory in available_tasks().items():
        module = sys.modules[factory.__module__]
        holds = any(getattr(module, n, None) is not None
                    for n in ("ShardedEmbedding", "ShardedEmbeddingBag"))
        assert holds == (name in features.SPARSE_TASKS), name


def test_reliability_md_shows_the_table() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    start = "<!-- feature pairs: made by paramserver.core.features.markdown() -->\n"
    assert start in text
    shown = text.split(start, 1)[1].split("\n<!-- end of feature pairs -->", 1)[0]
    assert shown == features.markdown(), "run: python -c 'from paramserver.core import " \
        "features; print(features.markdown())' and paste it into docs/reliability.md"


@pytest.mark.parametrize(("feature", "options"), [
    ("backup_workers", {"mode": "sync", "backup_workers": 1, "expected_workers": 3}),
    (policy_feature("dc-asgd-adaptive"), {"mode": "async", "policy": "dc-asgd-adaptive"}),
    (policy_feature("gap-aware"), {"mode": "async", "policy": "gap-aware"}),
    (policy_feature("ssp-adaptive"), {"mode": "ssp", "policy": "ssp-adaptive"})])
def test_a_shard_refuses_a_live_move_launch_refuses(feature: str,
                                                    options: dict[str, object]) -> None:
    """`paramserver reshard` asks shards a launcher did not start: each refuses a move
    of what its own options turn on (server/elastic.py's on_reshard checks these)."""
    from paramserver.errors import ConfigError
    from paramserver.server.config import ServerConfig

    shard = ServerConfig(**options)  # type: ignore[arg-type]
    assert feature in shard.features()
    with pytest.raises(ConfigError) as info:
        features.check({*shard.features(), "live_reshard"})
    assert str(info.value).endswith(pair(feature, "live_reshard").why)
