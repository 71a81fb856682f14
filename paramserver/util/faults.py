"""Fault injection for tests: the one seam, apart from every user option.

Faults are set in the environment of the processes a test starts (a launcher's
children inherit it), never by a flag, a config file or an argument a script
passes: ``--help``, ``--print-config`` and the configuration records hold none of
them. Each variable starts with ``PARAMSERVER_FAULT_``:

* ``PARAMSERVER_FAULT_DROP_RATE=P``: every client channel loses this fraction of
  its requests and replies, as a flaky network would (retries and push ids must make
  up for it); 0 <= P < 1.
* ``PARAMSERVER_FAULT_HOLD_CHECKPOINT=DIR``: a replica's checkpoint write that finds
  ``DIR/hold-shardN`` holds mid-way (paramserver/server/replicackpt.py), so that a
  test can kill a replica in the middle of one.

A test sets them with ``monkeypatch.setenv(faults.DROP_RATE, ...)``; they are read
where the fault acts, so one set after import still counts.
"""

from __future__ import annotations

import os

from paramserver.errors import ConfigError

__all__ = ["DROP_RATE", "HOLD_CHECKPOINT", "PREFIX", "drop_rate", "hold_checkpoint"]

#: every fault's environment variable starts so (no option's does: cli/options.py)
PREFIX = "PARAMSERVER_FAULT_"
DROP_RATE = PREFIX + "DROP_RATE"
HOLD_CHECKPOINT = PREFIX + "HOLD_CHECKPOINT"


def drop_rate() -> float:
    """The fraction of messages a client channel loses on purpose (0: none)."""
    raw = os.environ.get(DROP_RATE)
    if not raw:
        return 0.0
    try:
        rate = float(raw)
    except ValueError:
        raise ConfigError(f"{DROP_RATE}={raw!r} is not a number") from None
    if not 0.0 <= rate < 1.0:
        raise ConfigError(f"{DROP_RATE} must be in [0, 1), got {rate}")
    return rate


def hold_checkpoint() -> str | None:
    """The folder whose ``hold-shardN`` holds shard N's replica checkpoint writes."""
    return os.environ.get(HOLD_CHECKPOINT) or None
