"""Task factories used by tests/test_cli_e2e.py through ``module:function``."""

from __future__ import annotations

import time
from typing import Any

from paramserver.workers.tasks import create_task


def crash_on_rank_one(*, rank: int, world_size: int) -> Any:
    """digits-mlp, except that worker 1 fails while building its task."""
    if rank == 1:
        raise RuntimeError("boom: worker 1 cannot build its task")
    return create_task("digits-mlp", rank, world_size)


def slow_load(*, rank: int, world_size: int, seconds: float = 0.0) -> Any:
    """digits-mlp, except that worker 1 takes ``seconds`` to load its data (the
    scenario: a slow data load keeps its peers at the start barrier)."""
    if rank == 1:
        time.sleep(seconds)
    return create_task("digits-mlp", rank, world_size)
