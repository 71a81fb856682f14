"""Two identical sync runs end with the same weights, bit for bit: each shard sums a
round by worker id, not in the order its pushes arrived (real processes, loopback)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.integration


def _launch(out):
    cmd = [sys.executable, "-m", "paramserver.cli", "launch", "-s", "2", "-n", "3",
           "--mode", "sync", "--steps", "40", "-q", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return load_file(out / "final_model.safetensors")


def test_two_identical_sync_runs_end_with_the_same_weights_bit_for_bit(tmp_path):
    first, second = _launch(tmp_path / "a"), _launch(tmp_path / "b")
    assert first.keys() == second.keys() and first
    for key in first:
        assert first[key].equal(second[key]), key
