"""A shard server whose first push keeps its loop busy for BUSY seconds of Python work
(as applying a very large push does), then is handled as usual:
``python busy_primary_script.py BUSY CONFIG.json``."""

from __future__ import annotations

import sys
import time

from paramserver.core.shard import ShardCore
from paramserver.server.entry import main

busy = float(sys.argv[1])
push = ShardCore.push
spun: list[float] = []


def slow_push(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    if not spun:
        end = time.monotonic() + busy
        while time.monotonic() < end:  # holds the interpreter, as a busy handler does
            pass
        spun.append(busy)
    return push(self, *args, **kwargs)


ShardCore.push = slow_push  # type: ignore[method-assign]
main(sys.argv[2:])
