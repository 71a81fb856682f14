"""A shard server's sparse tables built off its event loop.

A plan's tables cost their rows, ids and per-row version counters (hundreds of
MiB, seconds of drawing rows for a large one). A shard builds them only once
a registered live worker uses the plan (the dense INIT, or its first SPULL, SPUSH
or SINIT), never because a HELLO declared them, and in a thread, so the loop
goes on answering heartbeats and dense traffic meanwhile. Sparse requests that come before the
tables are built are held here, one per connection, and answered once they are.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.sparse.shard import SparseShard
from paramserver.wire.protocol import Message

__all__ = ["TableBuilder"]

log = logging.getLogger(__name__)

#: a held request: the handler to run again once built, the message, its sender
Held = tuple[Callable[[Message, bytes], Message | None], Message]


class TableBuilder:
    """Builds ``sparse`` (:meth:`SparseShard.build`) in a thread and holds the
    requests that wait for it: at most ``limit``, one per connection (a client
    has one sparse request in flight per shard; a resent one replaces it)."""

    def __init__(self, sparse: SparseShard, shard: int, limit: int = 1024) -> None:
        self.sparse = sparse
        self.shard = shard
        self.limit = limit
        self.held: OrderedDict[bytes, Held] = OrderedDict()
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None or self.sparse.built

    def start(self) -> None:
        """A live worker uses the plan: build the tables now, in the background."""
        if self.started:
            return
        log.info("shard %d: building its sparse tables", self.shard)
        self._thread = threading.Thread(target=self._build, daemon=True,
                                        name=f"shard{self.shard}-tables")
        self._thread.start()

    def _build(self) -> None:
        try:
            self.sparse.build()
        except Exception as exc:  # (MemoryError included) answered to every request
            log.exception("shard %d: building the sparse tables failed", self.shard)
            self.error = f"{type(exc).__name__}: {exc}"[:500]

    def check(self) -> None:
        """Raise the ProtocolError every sparse request gets once a build failed."""
        if self.error is not None:
            raise ProtocolError(ErrorCode.INTERNAL,
                                f"the shard's sparse tables could not be built: {self.error}")

    def hold(self, identity: bytes, handler: Callable[[Message, bytes], Message | None],
             msg: Message) -> None:
        """Answer ``msg`` once the tables are built (the oldest held one is dropped
        past ``limit``: its client sends it again)."""
        self.held.pop(identity, None)
        self.held[identity] = (handler, msg)
        while len(self.held) > self.limit:
            self.held.popitem(last=False)

    def take(self) -> list[tuple[bytes, Held]]:
        """The held requests, once the tables are built (or their build failed)."""
        if not self.held or (not self.sparse.built and self.error is None):
            return []
        out = list(self.held.items())
        self.held.clear()
        return out

    def ready(self) -> None:
        """Wait for the tables (built here if no build started): a checkpoint needs them."""
        if self._thread is not None:
            self._thread.join()
        else:
            self.sparse.build()
