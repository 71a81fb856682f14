"""No import circle in server/ or core/, type-checking imports included: setup.cfg's
acyclic contract holds, and it catches a circle put back."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _contract(tmp_path: Path) -> Path:
    """setup.cfg's acyclic contract alone, as a config file."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    path = tmp_path / "acyclic.ini"
    path.write_text("[importlinter]\nroot_package = paramserver\n\n"
                    "[importlinter:contract:acyclic]\n" + "".join(
                        f"{k} = {v.replace(chr(10), chr(10) + '    ')}\n"
                        for k, v in cfg["importlinter:contract:acyclic"].items()))
    return path


def _lint(config: Path, tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "lint-imports"), "--config", str(config)], cwd=tree,
                          text=True, capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tree)})


def test_server_and_core_hold_no_import_circle_and_one_put_back_is_caught(tmp_path):
    config = _contract(tmp_path)
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "paramserver", tree / "paramserver", ignore=shutil.ignore_patterns(
        "workers", "cli", "benchmarks", "__pycache__"))
    kept = _lint(config, tree)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    # the report reading the core that calls it, for its type only: a circle again
    report = tree / "paramserver" / "core" / "report.py"
    report.write_text(report.read_text() + "\nif TYPE_CHECKING:\n"
                      "    from paramserver.core.shard import ShardCore  # noqa: F401\n")
    broken = _lint(config, tree)
    assert broken.returncode != 0, broken.stdout + broken.stderr
    assert ".shard -> .report" in broken.stdout
