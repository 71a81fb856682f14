"""A test's child process, ended whatever happened to the test."""

from __future__ import annotations

import subprocess
from typing import Any


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill ``proc`` if it still runs, wait for it, and close its stdout pipe (a test's
    ``finally``: the assertion that failed is what it reports, not a leftover)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
