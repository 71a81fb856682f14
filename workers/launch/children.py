"""A launcher's child processes: the record it keeps of each, and the environment they start in.

:class:`ChildProcess` is what :class:`~paramserver.workers.launch.cluster.LocalCluster`
(and its :class:`~paramserver.workers.launch.replicas.ReplicaKeeper`) holds of every
shard, backup and worker it started, however it started it (forked by the zygote or
``python -m``); :func:`child_env` is the environment they are given. Both are apart
from cluster.py, which starts, watches and stops the processes, because they are
the plain data that the launcher's other modules share without the cluster itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from paramserver.util import lifeline

if TYPE_CHECKING:
    from paramserver.workers.launch.zygote import ForkedProcess

__all__ = ["ChildProcess", "child_env"]


@dataclass
class ChildProcess:
    """A process the launcher started: its name, handle, log and metrics port."""

    name: str
    popen: subprocess.Popen[bytes] | ForkedProcess
    log_path: Path
    metrics_port: int | None = None  # a server's Prometheus port, from its ready line


def child_env() -> dict[str, str]:
    """The environment every process the launcher starts runs with."""
    env = dict(os.environ)
    # a launcher that is itself some launcher's child gives its children its own lifeline
    env.pop(lifeline.ENV, None)
    # children import what this process imports (tests' task modules included)
    paths = [p for p in sys.path if p] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # many small processes on few cores: one intra-op thread each avoids thrashing
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env
