"""Task factories used by tests/test_cli_e2e.py through ``module:function``."""

from __future__ import annotations

from typing import Any

from paramserver.workers.tasks import create_task


def crash_on_rank_one(*, rank: int, world_size: int) -> Any:
    """digits-mlp, except that worker 1 fails while building its task."""
    if rank == 1:
        raise RuntimeError("boom: worker 1 cannot build its task")
    return create_task("digits-mlp", rank, world_size)
