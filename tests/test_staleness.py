"""Built-in policies, the registry, plug-in loading by module:Class and entry point."""

from __future__ import annotations

import sys

import pytest

from paramserver import policies as S
from paramserver.errors import ConfigError, RegistryError
from paramserver.policies import registry
from paramserver.util import plugins


def info(tau, worker=0):
    return S.UpdateInfo(worker=worker, shard=0, staleness=tau, read_version=10 - tau,
                        version=10, clock=3, min_clock=1, num_samples=8)


@pytest.mark.parametrize(("name", "args", "tau", "accept", "weight"), [
    ("none", {}, 0, True, 1.0),
    ("none", {}, 50, True, 1.0),
    ("reject", {"max_staleness": 2}, 2, True, 1.0),
    ("reject", {"max_staleness": 2}, 3, False, 0.0),
    ("reject", {"max_staleness": 0}, 1, False, 0.0),
    ("inverse", {}, 0, True, 1.0),
    ("inverse", {}, 1, True, 1.0),
    ("inverse", {}, 4, True, 0.25),
    ("exponential", {"decay": 0.5}, 0, True, 1.0),
    ("exponential", {"decay": 0.5}, 3, True, 0.125),
    ("exponential", {"decay": "0.9"}, 2, True, 0.81),
])
def test_builtin_policies(name, args, tau, accept, weight):
    d = S.create_policy(name, args).decide(info(tau))
    assert d.accept is accept and d.weight == pytest.approx(weight)
    if not accept:
        assert d.reason


def test_registry_lists_and_explains():
    assert {"none", "reject", "inverse", "exponential"} <= set(S.available_policies())
    with pytest.raises(RegistryError, match=r"known: .*exponential.*inverse"):
        S.resolve_policy("nope")
    with pytest.raises(RegistryError, match="already registered"):
        S.register_policy(type("Dup", (S.NoPolicy,), {"name": "none"}))


def test_arguments_are_checked_and_converted():
    assert S.create_policy("reject", {"max_staleness": "3"}).max_staleness == 3
    with pytest.raises(ConfigError, match="accepted: max_staleness"):
        S.create_policy("reject", {"max_stale": 3})
    with pytest.raises(ConfigError, match="not a valid int"):
        S.create_policy("reject", {"max_staleness": "three"})
    with pytest.raises(ConfigError, match="decay must be in"):
        S.create_policy("exponential", {"decay": 2})
    assert S.parse_policy_args(["a=1", "b = x"]) == {"a": "1", "b": "x"}
    with pytest.raises(ConfigError, match="key=value"):
        S.parse_policy_args(["a"])


def test_module_class_plugin():
    p = S.create_policy("tests.policies_fixture:OnlyWorker", {"worker": "1"})
    assert p.decide(info(0, worker=1)).accept and not p.decide(info(0, worker=0)).accept
    with pytest.raises(RegistryError, match="cannot import"):
        S.resolve_policy("no.such.module:X")
    with pytest.raises(RegistryError, match="not a StalenessPolicy"):
        S.resolve_policy("tests.policies_fixture:Decision")


def test_entry_point_plugin(tmp_path, monkeypatch):
    dist = tmp_path / "mypolicies-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mypolicies\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{S.ENTRY_POINT_GROUP}]\nhalve = tests.policies_fixture:Halve\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_loaded", set())
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    assert "halve" in S.available_policies()
    assert S.create_policy("halve").decide(info(3)).weight == 0.5
    assert "tests" in sys.modules


def test_decision_validation():
    with pytest.raises(ConfigError):
        S.Decision(True, float("nan"))
    assert S.Decision(False).reason == "rejected"
