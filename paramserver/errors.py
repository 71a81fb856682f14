"""One exception tree for the whole project.

Every error raised to a user derives from :class:`ParamServerError`. Errors
from third-party libraries (zmq, msgpack, torch) are translated at the
boundary with ``raise ... from exc`` so callers need catch only these.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ErrorCode",
    "IncompatiblePlanError",
    "ParamServerError",
    "ProtocolError",
    "RegistryError",
    "RemoteError",
    "TimeoutError",
    "TransportError",
]


class ParamServerError(Exception):
    """Base class of every error this project raises."""


class ConfigError(ParamServerError, ValueError):
    """An option, spec or argument has a value that is not allowed."""


class RegistryError(ConfigError, LookupError):
    """A name is unknown to a registry, or registered twice."""


class ProtocolError(ParamServerError):
    """A message could not be decoded or failed validation.

    ``code`` is one of :data:`paramserver.protocol.ErrorCode` and travels back
    to the sender in an ERROR reply.
    """

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class IncompatiblePlanError(ProtocolError):
    """A worker's shard plan differs from the server's (other model or shard count)."""


class RemoteError(ParamServerError):
    """A peer answered with an ERROR reply."""

    def __init__(self, peer: str, code: str, reason: str) -> None:
        super().__init__(f"{peer} refused the request: {code}: {reason}")
        self.peer = peer
        self.code = code
        self.reason = reason


class TransportError(ParamServerError):
    """A socket could not be bound, connected or used."""


class TimeoutError(TransportError):
    """A blocking call waited longer than its timeout; the message names the peer."""


class ErrorCode:
    """Codes carried by ERROR replies; stable strings, part of the wire protocol."""

    BAD_MESSAGE = "bad_message"  # not a multipart message we can parse at all
    BAD_HEADER = "bad_header"  # header is not a valid msgpack map of the schema
    UNKNOWN_OP = "unknown_op"
    BAD_FIELD = "bad_field"  # a field is missing, of the wrong type or out of range
    BAD_TENSOR = "bad_tensor"  # dtype not allowed, shape x itemsize != frame length, ...
    TOO_LARGE = "too_large"  # over a size limit
    PROTOCOL_VERSION = "protocol_version"
    PLAN_MISMATCH = "plan_mismatch"
    NOT_REGISTERED = "not_registered"
    DUPLICATE_WORKER = "duplicate_worker"
    NOT_INITIALIZED = "not_initialized"
    UNKNOWN_KEY = "unknown_key"
    FUTURE_VERSION = "future_version"
    NONFINITE = "nonfinite"
    STOPPED = "stopped"  # the divergence watchdog stopped training on this shard
    TOO_MANY_WORKERS = "too_many_workers"  # the worker table is full of active workers
    BUSY = "busy"  # a memory budget is spent for now: back-pressure, retry later
    # CURVE: this key may not act as that worker id, or run an administrative op
    FORBIDDEN = "forbidden"
    INTERNAL = "internal"

    ALL = frozenset(
        v for k, v in vars().items() if k.isupper() and isinstance(v, str)
    )
