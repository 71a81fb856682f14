"""How a shard stops training when the divergence watchdog says so (--on-divergence).

:class:`Divergence` holds that state (the alarm that stopped it, until when it
lingers refusing requests, which workers were told) and is given what it acts
through: the server's config, event log and observer, and how to save a checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.observe import records as ev
from paramserver.persist.checkpoint import CheckpointError
from paramserver.wire.protocol import Message, Op

if TYPE_CHECKING:
    from paramserver.core.records import WorkerState
    from paramserver.observe.events import EventLog
    from paramserver.observe.recorder import ShardObserver
    from paramserver.observe.watchdog import Alarm
    from paramserver.server.config import ServerConfig

__all__ = ["DIVERGED_EXIT_CODE", "Divergence"]

log = logging.getLogger(__name__)

DIVERGED_EXIT_CODE = 3  # the watchdog stopped training (--on-divergence stop/checkpoint-and-stop)


class Divergence:
    """Whether the watchdog stopped this shard's training, and what follows from it."""

    def __init__(self, config: ServerConfig, events: EventLog, observer: ShardObserver,
                 save: Callable[[str], str | None]) -> None:
        self.config = config
        self.events = events
        self.observer = observer
        self.save = save  # a checkpoint into this directory; its manifest's path
        self.alarm: Alarm | None = None  # the alarm that stopped training
        self.stop_at: float | None = None  # refuse requests until then, then exit
        self.told: set[int] = set()  # workers refused since training stopped
        self.exit_code = 0

    def act(self, version: int) -> None:
        """Carry out --on-divergence for alarms raised while handling a message: only
        for the model's own state (Alarm.divergence), never for a push it refused."""
        alarms = [a for a in self.observer.take_alarms() if a.divergence]
        action = self.config.on_divergence
        if not alarms or action == "warn" or self.alarm is not None:
            return
        first = self.alarm = alarms[0]
        log.error("the divergence watchdog stops training (--on-divergence %s): %s", action,
                  first.message)
        path = None
        if action == "checkpoint-and-stop":
            assert self.config.checkpoint_dir is not None
            try:
                path = self.save(str(Path(self.config.checkpoint_dir) / "diverged"))
            except CheckpointError as exc:  # weights not finite: resume would refuse it
                log.error("%s", exc)
        self.events.write(ev.Diverged(shard=self.config.shard, action=action, signal=first.signal,
                                      worker=first.worker, message=first.message, version=version,
                                      checkpoint=path))
        self.events.flush()
        self.exit_code = DIVERGED_EXIT_CODE
        # linger a little, refusing every request, so workers learn why and stop
        self.stop_at = time.monotonic() + min(10.0, self.config.heartbeat_timeout)

    def refuse(self, msg: Message) -> None:
        """Refuse ``msg`` (STOPPED), noting its worker as told unless it only beats."""
        assert self.alarm is not None
        worker = getattr(msg.body, "worker", None)
        if worker is not None and msg.op is not Op.HEARTBEAT:
            self.told.add(worker)
        raise ProtocolError(ErrorCode.STOPPED,
                            f"the divergence watchdog stopped training: {self.alarm.message}")

    def over(self, now: float, workers: Iterable[WorkerState] | None) -> bool:
        """Whether the lingering is over: its time is up, or every live worker that
        has not finished (of ``workers``; None: no core) was told."""
        if self.stop_at is None:
            return False
        if now >= self.stop_at or workers is None:
            return True
        return all(w.worker in self.told for w in workers if w.live and not w.finished)

    def forget(self, known: Container[int]) -> None:
        """Keep only the workers in ``known`` (the core's, after an eviction)."""
        self.told = {w for w in self.told if w in known}
