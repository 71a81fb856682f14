"""The package's shape: one import root, a light import, a public API, one-way layers."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import paramserver

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HEAVY = ("matplotlib", "sklearn", "rich", "pandas", "torch")


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a user of the installed package would: another directory, no
    PYTHONPATH, so only what is installed can be imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def test_import_paramserver_is_light_and_exports_its_api(tmp_path):
    out = _python("import json, sys, paramserver\n"
                  f"print(json.dumps([paramserver.__all__, [m for m in {HEAVY!r} "
                  "if m in sys.modules]]))", tmp_path)
    assert out.returncode == 0, out.stderr
    exported, loaded = json.loads(out.stdout)
    assert loaded == []
    assert exported == paramserver.__all__


def test_every_public_name_resolves_and_is_documented():
    expected = {"StalenessPolicy", "Decision", "UpdateInfo", "register_policy", "Task",
                "register_task", "ServerConfig", "WorkerConfig", "ClusterSpec",
                "ExperimentSpec", "run_cluster", "PSClient", "ParamServerError"}
    assert expected <= set(paramserver.__all__)
    assert len(set(paramserver.__all__)) == len(paramserver.__all__)
    for name in paramserver.__all__:
        value = getattr(paramserver, name)
        assert value is not None
        if name != "__version__" and not isinstance(value, str):
            assert value.__doc__, name
    with pytest.raises(AttributeError):
        _ = paramserver.no_such_name  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["workers", "cli", "benchmarks"])
def test_no_second_top_level_package_is_installed(tmp_path, name):
    out = _python(f"import {name}", tmp_path)
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, out.stderr


def test_each_module_loads_under_one_name_only(tmp_path):
    out = _python("import sys, paramserver.cli.main, paramserver.benchmarks.run\n"
                  "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                  "('workers', 'cli', 'benchmarks')))", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_wheel_holds_only_the_paramserver_package(tmp_path):
    # built from a copy: setuptools writes build/ and egg-info into the tree it builds
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "runs", "*.egg-info", "__pycache__", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(src)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"paramserver"}
    # the linked folders arrive as real files under the one root
    for module in ("paramserver/workers/launch/cluster.py", "paramserver/cli/main.py",
                   "paramserver/benchmarks/run.py", "paramserver/workers/client.py"):
        assert module in names


def _layers() -> list[list[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    text = cfg["importlinter:contract:layers"]["layers"]
    return [[m.strip() for m in line.replace("|", ":").split(":")]
            for line in text.strip().splitlines()]


def source_files() -> list[str]:
    """Every module of the package, as its path under paramserver/ (``core/shard.py``,
    ``workers/launch/cluster.py``): through the links, as the package installs."""
    found = []
    for folder, dirs, files in os.walk(ROOT / "paramserver", followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = Path(folder).relative_to(ROOT / "paramserver")
        found += [(rel / f).as_posix() for f in sorted(files) if f.endswith(".py")]
    return found


def module_name(path: str) -> str:
    """``workers/launch/__init__.py`` -> ``paramserver.workers.launch``."""
    parts = ["paramserver", *path.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_module_is_in_the_layers_contract():
    """Every module, the worker side's, cli/'s and benchmarks/' included, is named by
    the contract, itself or through a package above it; a package that only holds its
    modules (an empty __init__.py, as workers/ has) need not be. Nothing named is gone.
    Each package under paramserver/ names what it holds in its docstring."""
    named = {m for layer in _layers() for m in layer}
    files = source_files()
    existing = {module_name(f) for f in files}
    assert {"paramserver.core.shard", "paramserver.workers.client", "paramserver.cli.main",
            "paramserver.benchmarks.run", "paramserver.workers.launch.cluster"} <= existing
    holding = {module_name(f) for f in files if not f.endswith("__init__.py")
               or (f != "__init__.py" and (ROOT / "paramserver" / f).read_text().strip())}

    def covered(module: str) -> bool:
        parts = module.split(".")
        return any(".".join(parts[:i]) in named for i in range(2, len(parts) + 1))

    def where(module: str) -> str:
        """The line that holds most of its siblings (the worker side's, for workers/)."""
        parent = module.rsplit(".", 1)[0]
        line = max(_layers(), key=lambda layer: sum(m.rsplit(".", 1)[0] == parent
                                                    for m in layer))
        return (f"{module}: on the line of {line[0]}, as ' : {module}'"
                if any(m.rsplit(".", 1)[0] == parent for m in line)
                else f"{module}: on the line of its layer")

    left_out = sorted(m for m in holding if not covered(m))
    assert not left_out, (
        "setup.cfg's [importlinter:contract:layers] names neither these modules nor a "
        "package above them; add each, then run lint-imports:\n"
        + "\n".join(map(where, left_out)))
    gone = sorted(named - existing)
    assert not gone, ("setup.cfg's [importlinter:contract:layers] names modules that do "
                      "not exist; remove them: " + ", ".join(gone))
    for package in {m for m in existing if m.count(".") == 1}:
        init = ROOT / package.replace(".", "/") / "__init__.py"
        if init.exists() and not init.parent.is_symlink():
            assert init.read_text().startswith('"""'), package


def test_the_core_is_kept_free_of_io(tmp_path):
    """The forbidden contract holds, and it catches a clock read put into the core."""
    kept = _lint_imports(ROOT / "setup.cfg")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "paramserver", tree / "paramserver", ignore=shutil.ignore_patterns(
        "workers", "cli", "benchmarks", "__pycache__"))
    ahead = tree / "paramserver" / "core" / "ahead.py"
    ahead.write_text(ahead.read_text() + "\nimport time  # noqa: E402\n")
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pure = tmp_path / "pure.ini"
    pure.write_text("[importlinter]\nroot_package = paramserver\ninclude_external_packages = "
                    "True\n\n[importlinter:contract:pure]\n" + "".join(
                        f"{k} = {v.replace(chr(10), chr(10) + '    ')}\n"
                        for k, v in cfg["importlinter:contract:pure"].items()))
    broken = subprocess.run([str(BIN / "lint-imports"), "--config", str(pure)], cwd=tree,
                            text=True, capture_output=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    assert broken.returncode != 0, broken.stdout + broken.stderr
    assert "paramserver.core.ahead -> time" in broken.stdout


def _lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "lint-imports"), "--config", str(config)], cwd=ROOT,
                          text=True, capture_output=True, timeout=300)


def test_the_layers_contract_holds_and_catches_a_violation(tmp_path):
    kept = _lint_imports(ROOT / "setup.cfg")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    # the same contract with the CLI put under the core: the core never imports the
    # CLI, but the CLI imports the core, which the reversed contract forbids
    layers = _layers()
    reversed_cfg = tmp_path / "reversed.ini"
    reversed_cfg.write_text(
        "[importlinter]\nroot_package = paramserver\n\n"
        "[importlinter:contract:reversed]\nname = reversed\ntype = layers\nlayers =\n"
        + "".join(f"    {' : '.join(layer)}\n" for layer in reversed(layers)))
    broken = _lint_imports(reversed_cfg)
    assert broken.returncode != 0
    assert "paramserver.cli" in broken.stdout and "BROKEN" in broken.stdout


def test_names_moved_out_of_a_module_stay_importable_from_it() -> None:
    """CURVE keys moved from transport.py to curve.py, the requests outside a session
    from workers/client.py to workers/admin.py: the old imports still work."""
    from paramserver.wire import curve, transport
    from paramserver.workers import admin, client

    for name in curve.__all__:
        if name not in ("start_authenticator", "secure_client"):  # born in curve.py
            assert getattr(transport, name) is getattr(curve, name), name
    for name in admin.__all__:
        assert getattr(client, name) is getattr(admin, name), name
    with pytest.raises(AttributeError):
        _ = transport.no_such_name
