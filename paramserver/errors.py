"""One exception tree for the whole project.

Every error raised to a user derives from :class:`ParamServerError`. Errors
from third-party libraries (zmq, msgpack, torch) are translated at the
boundary with ``raise ... from exc`` so callers need catch only these::

    ParamServerError
    ├── ConfigError (also ValueError)
    │   └── RegistryError (also LookupError)
    ├── ProtocolError            this side refuses a message; .code is an ErrorCode
    ├── RemoteError              a peer answered ERROR; .peer, .code, .reason
    │   ├── BadRequestError      bad_message, bad_header, unknown_op, bad_field,
    │   │                        bad_tensor, too_large, unknown_key
    │   ├── ProtocolVersionError protocol_version
    │   ├── IncompatiblePlanError plan_mismatch
    │   ├── NotRegisteredError   not_registered
    │   ├── DuplicateWorkerError duplicate_worker
    │   ├── WorkerInUseError     worker_in_use
    │   ├── WrongRunError        wrong_run
    │   ├── NotInitializedError  not_initialized
    │   ├── FutureVersionError   future_version
    │   ├── NonFiniteError       nonfinite
    │   ├── TrainingStoppedError stopped
    │   ├── TooManyWorkersError  too_many_workers
    │   ├── BusyError            busy
    │   ├── ForbiddenError       forbidden
    │   ├── PlanMovedError       plan_moved (a live reshard: the new plan's addresses)
    │   └── RemoteInternalError  internal
    ├── TransportError
    │   ├── RequestTimeoutError (also the builtin TimeoutError)
    │   │   └── BarrierTimeoutError  a live shard held a pull past --barrier-timeout
    │   └── RendezvousError      (paramserver.workers.launch.rendezvous)
    ├── CheckpointError          (paramserver.persist.checkpoint)
    ├── ClusterError             (paramserver.workers.launch.cluster)
    ├── SimulationError          (paramserver.workers.launch.virtual)
    ├── ZygoteError (also RuntimeError) (paramserver.workers.launch.zygote)
    └── AgentError               (paramserver.benchmarks.common)

A shard raises :class:`ProtocolError` with an :class:`ErrorCode`; its code
travels back in an ERROR reply, and the client raises the :class:`RemoteError`
subclass that :data:`REMOTE_ERRORS` maps the code to (through
:meth:`RemoteError.from_reply`), so callers catch classes instead of comparing
strings. A code this side does not know (a newer peer) raises a plain
:class:`RemoteError` whose ``code`` is the string as received.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import ClassVar

__all__ = [
    "REMOTE_ERRORS",
    "BadRequestError",
    "BarrierTimeoutError",
    "BusyError",
    "ConfigError",
    "DuplicateWorkerError",
    "ErrorCode",
    "ForbiddenError",
    "FutureVersionError",
    "IncompatiblePlanError",
    "NonFiniteError",
    "NotInitializedError",
    "NotRegisteredError",
    "OptimizerMismatchError",
    "ParamServerError",
    "PlanMovedError",
    "ProtocolError",
    "ProtocolVersionError",
    "RegistryError",
    "RemoteError",
    "RemoteInternalError",
    "RequestTimeoutError",
    "TooManyWorkersError",
    "TrainingStoppedError",
    "TransportError",
    "WorkerInUseError",
    "WrongRunError",
]


class ErrorCode(StrEnum):
    """Codes carried by ERROR replies; stable strings, part of the wire protocol.

    A member equals its string (``ErrorCode.BUSY == "busy"``) and msgpack
    encodes it as that string.
    """

    BAD_MESSAGE = "bad_message"  # not a multipart message we can parse at all
    BAD_HEADER = "bad_header"  # header is not a valid msgpack map of the schema
    UNKNOWN_OP = "unknown_op"
    BAD_FIELD = "bad_field"  # a field is missing, of the wrong type or out of range
    BAD_TENSOR = "bad_tensor"  # dtype not allowed, shape x itemsize != frame length, ...
    TOO_LARGE = "too_large"  # over a size limit
    PROTOCOL_VERSION = "protocol_version"
    PLAN_MISMATCH = "plan_mismatch"
    # the optimizer a worker's script wraps is not the one the shard runs
    OPTIMIZER_MISMATCH = "optimizer_mismatch"
    NOT_REGISTERED = "not_registered"
    DUPLICATE_WORKER = "duplicate_worker"  # another process holds the id: retry, it may be dead
    WORKER_IN_USE = "worker_in_use"  # ... and it is live: a second process, final
    WRONG_RUN = "wrong_run"  # a worker of another run (launch's run id): final
    NOT_INITIALIZED = "not_initialized"
    UNKNOWN_KEY = "unknown_key"
    FUTURE_VERSION = "future_version"
    NONFINITE = "nonfinite"
    STOPPED = "stopped"  # the divergence watchdog stopped training on this shard
    TOO_MANY_WORKERS = "too_many_workers"  # the worker table is full of active workers
    BUSY = "busy"  # a memory budget is spent for now: back-pressure, retry later
    # CURVE: this key may not act as that worker id, or run an administrative op
    FORBIDDEN = "forbidden"
    # a live reshard moved the plan (issue 47): the reply names the new plan's servers
    PLAN_MOVED = "plan_moved"
    INTERNAL = "internal"

    ALL: ClassVar[frozenset[str]]  # every code, as strings (kept for older callers)


ErrorCode.ALL = frozenset(ErrorCode)


class ParamServerError(Exception):
    """Base class of every error this project raises."""


class ConfigError(ParamServerError, ValueError):
    """An option, spec or argument has a value that is not allowed."""


class RegistryError(ConfigError, LookupError):
    """A name is unknown to a registry, or registered twice."""


class ProtocolError(ParamServerError):
    """This side refuses a message: it could not be decoded or failed validation.

    ``code`` is an :class:`ErrorCode`; a shard sends it back to the sender in
    an ERROR reply, where the sender raises the matching :class:`RemoteError`.
    """

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason

    def __reduce__(self) -> tuple[type[ProtocolError], tuple[ErrorCode, str]]:
        return type(self), (self.code, self.reason)


class RemoteError(ParamServerError):
    """A peer answered with an ERROR reply.

    Raise it with :meth:`from_reply`, which picks the subclass for the code
    (see :data:`REMOTE_ERRORS`). ``code`` is an :class:`ErrorCode`, or the
    string as received when this side does not know it.
    """

    #: the codes this class stands for on the client (empty: none of its own)
    codes: ClassVar[tuple[ErrorCode, ...]] = ()

    def __init__(self, peer: str, code: ErrorCode | str, reason: str) -> None:
        super().__init__(f"{peer} refused the request: {code}: {reason}")
        self.peer = peer
        self.code = code
        self.reason = reason

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, ErrorCode | str, str]]:
        return type(self), (self.peer, self.code, self.reason)

    @classmethod
    def from_reply(cls, peer: str, code: str, reason: str) -> RemoteError:
        """The most specific error for an ERROR reply's ``code``, ready to raise."""
        try:
            known = ErrorCode(code)
        except ValueError:  # a code from a newer peer
            return RemoteError(peer, code, reason)
        return REMOTE_ERRORS[known](peer, known, reason)


class BadRequestError(RemoteError):
    """The peer could not accept the message as sent: a bug or a broken sender."""

    codes = (ErrorCode.BAD_MESSAGE, ErrorCode.BAD_HEADER, ErrorCode.UNKNOWN_OP,
             ErrorCode.BAD_FIELD, ErrorCode.BAD_TENSOR, ErrorCode.TOO_LARGE,
             ErrorCode.UNKNOWN_KEY)


class ProtocolVersionError(RemoteError):
    """The peer speaks another protocol version."""

    codes = (ErrorCode.PROTOCOL_VERSION,)


class IncompatiblePlanError(RemoteError):
    """A worker's shard plan differs from the server's (other model or shard count)."""

    codes = (ErrorCode.PLAN_MISMATCH,)


class OptimizerMismatchError(RemoteError):
    """The optimizer a worker's script wraps is not the one the shard runs (the launch
    named another, or another worker's script wrapped another)."""

    codes = (ErrorCode.OPTIMIZER_MISMATCH,)


class NotRegisteredError(RemoteError):
    """The shard does not know this worker (no HELLO, said BYE, or timed out)."""

    codes = (ErrorCode.NOT_REGISTERED,)


class DuplicateWorkerError(RemoteError):
    """Another live process holds this worker id."""

    codes = (ErrorCode.DUPLICATE_WORKER,)


class WorkerInUseError(RemoteError):
    """A live process holds this worker id (rank): this one is a duplicate, not a
    restart; final (a restarted process gets DuplicateWorkerError until its old one
    goes quiet)."""

    codes = (ErrorCode.WORKER_IN_USE,)


class WrongRunError(RemoteError):
    """The shard belongs to another run than this worker (a port another job took
    over, a stale address): final, the worker never talks to it."""

    codes = (ErrorCode.WRONG_RUN,)


class NotInitializedError(RemoteError):
    """The shard has no weights yet: no worker has sent INIT."""

    codes = (ErrorCode.NOT_INITIALIZED,)


class FutureVersionError(RemoteError):
    """A push read at a version the shard has not reached."""

    codes = (ErrorCode.FUTURE_VERSION,)


class NonFiniteError(RemoteError):
    """A gradient held NaN or Inf; the shard did not apply it."""

    codes = (ErrorCode.NONFINITE,)


class TrainingStoppedError(RemoteError):
    """The shard's divergence watchdog stopped training."""

    codes = (ErrorCode.STOPPED,)


class TooManyWorkersError(RemoteError):
    """The shard's worker table is full of active workers."""

    codes = (ErrorCode.TOO_MANY_WORKERS,)


class BusyError(RemoteError):
    """A memory budget of the shard is spent for now (back-pressure): retry later."""

    codes = (ErrorCode.BUSY,)


class ForbiddenError(RemoteError):
    """CURVE: this key may not act as that worker id, or run an administrative op."""

    codes = (ErrorCode.FORBIDDEN,)


class PlanMovedError(RemoteError):
    """A live reshard moved the shards to a new plan (issue 47): ``epoch`` and
    ``servers`` (the new plan's addresses, in shard order) come with the ERROR reply
    (wire/messages.py's PlanMoved); the client moves there and sends again."""

    codes = (ErrorCode.PLAN_MOVED,)

    def __init__(self, peer: str, code: ErrorCode | str, reason: str, epoch: int = 0,
                 servers: tuple[str, ...] = ()) -> None:
        super().__init__(peer, code, reason)
        self.epoch = epoch
        self.servers = servers


class RemoteInternalError(RemoteError):
    """The peer hit an exception it did not expect (a bug there; it logged a traceback)."""

    codes = (ErrorCode.INTERNAL,)


#: ErrorCode -> the RemoteError subclass a client raises for it; every code has one
REMOTE_ERRORS: Mapping[ErrorCode, type[RemoteError]] = MappingProxyType({
    code: cls
    for cls in (BadRequestError, ProtocolVersionError, IncompatiblePlanError,
                OptimizerMismatchError,
                NotRegisteredError, DuplicateWorkerError, WorkerInUseError, WrongRunError,
                NotInitializedError,
                FutureVersionError, NonFiniteError, TrainingStoppedError,
                TooManyWorkersError, BusyError, ForbiddenError, PlanMovedError,
                RemoteInternalError)
    for code in cls.codes
})


class TransportError(ParamServerError):
    """A socket could not be bound, connected or used."""


class RequestTimeoutError(TransportError, builtins.TimeoutError):
    """A blocking call waited longer than its timeout; the message names whom it waited for.

    Also a builtin :class:`TimeoutError`, so ``except TimeoutError`` catches it.
    """


class BarrierTimeoutError(RequestTimeoutError):
    """A shard that answers (its heartbeats) held a pull at its sync barrier or SSP
    gate longer than the worker's barrier timeout: the peers it waits for are slow
    or stuck, the shard is not."""
