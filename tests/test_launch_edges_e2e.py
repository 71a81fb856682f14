"""`paramserver launch -- python ...` as a new user first runs it (issue 43, item 8):
with a `python` on PATH that cannot import paramserver, and a script that never builds
a DistributedOptimizer. One run: the shards' addresses and the `status` command are
printed at start, the foreign `python` is replaced in one line, and the script that
never joined fails the run under --on-worker-failure fail, saying so."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.test_cli_e2e import PARAMSERVER, ROOT, env


def test_launch_says_where_the_shards_are_and_what_its_command_did(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    foreign = bins / "python"  # a Python outside the launcher's environment
    foreign.write_text("#!/bin/sh\necho 'ModuleNotFoundError: paramserver' >&2\nexit 1\n")
    foreign.chmod(0o755)
    out = tmp_path / "run"
    done = subprocess.run(
        [*PARAMSERVER, "launch", "-s", "1", "-n", "1", "--out", str(out), "--quiet", "--",
         "python", "-c", "print('a script without DistributedOptimizer')"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env=env(PATH=f"{bins}{os.pathsep}{os.environ['PATH']}"))
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    lines = said.splitlines()
    (shards,) = [line for line in lines if "shards at" in line]
    address = shards.split("shards at ", 1)[1].split(";")[0]
    assert f"paramserver status --servers {address}" in shards
    assert sum("cannot import paramserver" in line for line in lines) == 1
    assert "ModuleNotFoundError" not in said
    assert "worker0 exited without joining the run" in said
    assert "without building a DistributedOptimizer" in said
    # its output is the script's, run by the launcher's own Python
    assert "a script without DistributedOptimizer" in (out / "logs" / "worker0.log").read_text()
