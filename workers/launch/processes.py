"""What the launcher knows and says about the processes it ran.

:class:`ProcessInfo` (name, role, pid) is recorded as each process starts
(``processes.json``, ``result.json``); :func:`shard_cause` finds the
shard error behind a worker's failure, with the last frame of the shard's
traceback, so that a launcher names the real culprit.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from paramserver.util.jsontypes import JSONObject

__all__ = ["ProcessInfo", "command_python", "exit_reason", "shard_cause", "tail"]


@dataclass(frozen=True)
class ProcessInfo:
    """One process the launcher started (a restart is a new one, same name)."""

    name: str  # server0, worker1
    role: str  # "server" or "worker"
    pid: int
    started: float  # time.time()

    def as_dict(self) -> JSONObject:
        return {"name": self.name, "role": self.role, "pid": self.pid, "started": self.started}


_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


def command_python(command: Sequence[str], env: Mapping[str, str]
                   ) -> tuple[list[str], str | None]:
    """``launch -- python script.py``: the ``python`` found on PATH may be another
    interpreter than the launcher's (outside its virtual environment), which cannot
    import paramserver; the command then runs with the launcher's own. Returns the
    command to run, and the line that says so (None: it runs as given)."""
    found = shutil.which(command[0], path=env.get("PATH")) if command else None
    if (found is None or not _PYTHON.fullmatch(os.path.basename(command[0]))
            or os.path.abspath(found) == os.path.abspath(sys.executable)):
        return list(command), None  # (not found: starting it says so)
    try:
        works = subprocess.run([found, "-c", "import paramserver"], env=dict(env),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        works = False
    if works:
        return list(command), None
    return [sys.executable, *command[1:]], (
        f"`{command[0]}` ({found}) cannot import paramserver: running the command with "
        f"{sys.executable}, the launcher's own Python (give an interpreter's full path "
        f"after -- to run it with that one)")


def exit_reason(code: int) -> str:
    """A process's exit code in words: ``killed by SIGKILL``, ``exit code 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_INTERNAL = re.compile(r"\bshard (\d+)(?: at \S+)? refused the request: internal: (.+)")


def shard_cause(worker_log: Path, server_logs: Sequence[Path]) -> str:
    """When a worker died of a shard's ``internal`` error reply (a policy's decide()
    raised, say), the shard's reason and the last frame of the traceback in its log,
    as lines to put first; "" otherwise. The worker's own traceback only shows where
    the reply arrived."""
    try:
        text = worker_log.read_text(errors="replace")
    except OSError:
        return ""
    found = list(_INTERNAL.finditer(text))
    if not found:
        return ""
    shard, reason = int(found[-1].group(1)), found[-1].group(2).strip()
    lines = [f"shard {shard} failed handling a request: {reason}"]
    if shard < len(server_logs):
        frame = _last_frame(server_logs[shard])
        if frame:
            lines.append(f"  at {frame}")
        lines.append(f"  (its log: {server_logs[shard]})")
    return "\n".join(lines) + "\n"


def _last_frame(path: Path) -> str:
    """``File "...", line N, in f: code`` of the last traceback in a log, or ""."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return ""
    frames = [i for i in range(starts[-1], len(lines)) if lines[i].startswith("  File ")]
    if not frames:
        return ""
    at = frames[-1]
    code = lines[at + 1].strip() if at + 1 < len(lines) else ""
    return lines[at].strip() + (f": {code}" if code else "")


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])
