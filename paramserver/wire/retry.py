"""How long a request waits for its replies, and when it is sent again: one value.

A :class:`Retry` travels from the client's options (``--timeout``,
``--request-timeout``) through every caller of
:func:`~paramserver.wire.transport.request_all`, as urllib3's ``Retry`` does: an
immutable policy, made once and narrowed where a caller knows more (its
patience), never four loose parameters repeated at each call. Pure: no sockets.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from paramserver.errors import ConfigError

__all__ = ["Judge", "PatienceFrom", "Retry"]

#: judges requests unanswered when an attempt's time passed (their indices): raises to
#: give up, or says whether to send them again (False: wait on, the peer holds them)
Judge = Callable[[list[int]], bool]
#: a request's patience made when it is first needed: (when the request began) -> the
#: judge, or None (then ``retries`` decide)
PatienceFrom = Callable[[float], "Judge | None"]


class Retry(msgspec.Struct, frozen=True):
    """``attempt`` seconds per try; an unanswered request is sent again (the same
    message: a push keeps its id) up to ``retries`` times, then the peers that did not
    answer are named. ``patience`` (or ``patience_from``, made only once an attempt's
    time first passes, given when the request began) decides in place of ``retries``:
    the caller knows more of its peers (their heartbeats) than one request's replies.

    A msgspec Struct, not a dataclass: a request narrows it with its patience
    (:meth:`judged`) on every call, where a frozen dataclass costs 6 us more."""

    attempt: float = 5.0
    retries: int = 0
    patience: Judge | None = None
    patience_from: PatienceFrom | None = None

    def __post_init__(self) -> None:
        if not self.attempt > 0:
            raise ConfigError(f"a request's attempt timeout must be > 0, got {self.attempt}")
        if self.retries < 0:
            raise ConfigError(f"retries must be >= 0, got {self.retries}")

    @classmethod
    def within(cls, total: float, attempt: float) -> Retry:
        """Tries of ``attempt`` seconds (no longer than ``total``) until about ``total``
        seconds have passed: a worker's ``--timeout`` and ``--request-timeout``."""
        if not total > 0:
            raise ConfigError(f"timeout must be > 0, got {total}")
        attempt = min(attempt, total)
        return cls(attempt, max(0, math.ceil(total / attempt) - 1))

    @classmethod
    def of(cls, value: Retry | float) -> Retry:
        """``value`` as a Retry: a number is one attempt of that many seconds."""
        return value if isinstance(value, Retry) else cls(float(value))

    @property
    def total(self) -> float:
        """The longest a request waits without patience: every attempt's time."""
        return self.attempt * (self.retries + 1)

    def judged(self, patience: Judge | None = None,
               patience_from: PatienceFrom | None = None) -> Retry:
        """This policy with a caller's patience (None: ``retries`` decide)."""
        if patience is self.patience and patience_from is self.patience_from:
            return self
        return Retry(self.attempt, self.retries, patience, patience_from)
