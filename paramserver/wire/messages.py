"""Typed messages: one record per op, made once at the wire from a checked header.

:func:`~paramserver.wire.protocol.decode` checks each field's type against the
protocol's schema, then :func:`parse` turns the fields into the op's record here,
checking what a type cannot say: ranges (worker ids, clocks and versions >= 0,
0 <= part < parts <= :data:`MAX_PARTS`) and, with :func:`check_tensors`, the sparse
row ids one request may carry. A handler reads ``msg.body.clock``, never a field
by name, and never checks a bound again: what reaches it is in range.

Replies are parsed by the op they answer (their ``re``): a worker reads the
push outcome, the pull's version and clock or an error's code as attributes too.
A reply's fields are checked as loosely as before (it comes from a peer we
called), but a field of the wrong type is refused here, not deep in the worker.
The STATS reply becomes a :class:`~paramserver.wire.stats.ShardStats` (its
nested records bounded: workers listed, alarms, reasons), which ``status``,
``watch`` and the tools read by attribute.

Records are msgspec frozen Structs, chosen by measurement: made from a PUSH's
fields, a frozen Struct took 0.23 us, a frozen dataclass with slots 2.9 us (its
``__init__`` sets each field through ``object.__setattr__``), a plain slotted
dataclass 0.39 us; parsing a PUSH costs 1.7 us with Structs, 4.9 us with frozen
dataclasses, against about 17 us for its whole decode (medians of 5 runs of
200,000 on a loaded 2-core machine).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec
import torch
from msgspec.structs import replace

from paramserver.core.hyper import OptimizerSpec, check_lr
from paramserver.core.limits import MAX_PLAN_SERVERS
from paramserver.core.records import PushOutcome
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.sparse.shard import MAX_REQUEST_ROWS
from paramserver.wire.frames import INT_BOUND

if TYPE_CHECKING:  # (wire.stats imports protocol, which imports this module)
    from paramserver.wire.stats import ShardStats

__all__ = [
    "MAX_PARTS",
    "MAX_PLAN_SERVERS",
    "MAX_RUN_ID",
    "RESHARD_STEPS",
    "Body",
    "Bye",
    "ByeReply",
    "Checkpoint",
    "CheckpointReply",
    "Error",
    "Heartbeat",
    "HeartbeatReply",
    "Hello",
    "HelloReply",
    "Init",
    "InitReply",
    "Op",
    "PlanMoved",
    "Pull",
    "PullReply",
    "Push",
    "PushReply",
    "Reshard",
    "ReshardReply",
    "SInit",
    "SInitReply",
    "SPull",
    "SPullReply",
    "SPush",
    "ShmGrant",
    "ShmOffer",
    "Shutdown",
    "Stats",
    "check_tensors",
    "parse",
    "replace",
]

#: parts one PUSH, INIT or SINIT may come in: bounds what a shard keeps per part
#: before its last (handlers bound pushes tighter, by the shard's slices)
MAX_PARTS = 1 << 20


class Op(StrEnum):
    HELLO = "hello"
    INIT = "init"
    PULL = "pull"
    PUSH = "push"
    HEARTBEAT = "heartbeat"
    BYE = "bye"
    STATS = "stats"
    CHECKPOINT = "checkpoint"
    SHUTDOWN = "shutdown"
    # row-sparse tables (paramserver/sparse/shard.py): rows by id, gradients of rows, seed rows
    SPULL = "spull"
    SPUSH = "spush"
    SINIT = "sinit"
    # a live move to another plan (issue 47; server/elastic.py): an admin op
    RESHARD = "reshard"
    REPLY = "reply"
    ERROR = "error"


# ---------------------------------------------------------------------- requests

class Hello(msgspec.Struct, frozen=True):
    worker: int
    role: str
    protocol: int
    plan_hash: str
    incarnation: str
    plan: dict[str, Any] | None = None
    host: str | None = None
    pid: int | None = None
    #: a same-host worker's offer of its gradient segment (paramserver/shm/link.py)
    shm: dict[str, Any] | None = None
    #: the optimizer the worker's script wraps (paramserver/core/hyper.py), checked
    optimizer: OptimizerSpec | None = None
    #: the worker's run (launch's run id): a shard of another run refuses it
    run: str | None = None


class Init(msgspec.Struct, frozen=True):
    worker: int
    part: int = 0
    parts: int = 1
    shm: list[Any] | None = None  # the tensors lie in the sender's segment


class Pull(msgspec.Struct, frozen=True):
    worker: int
    clock: int
    observer: bool = False
    wait_init: bool = False
    via_shm: bool | None = None  # answer with a ticket to the weight board (None: as set up)
    #: held until no expected worker is awaited or live here: the final weights
    final: bool = False
    #: compressed pulls (core/pullsqueeze.py): the answers it holds, -1 none; None: off
    base: int | None = None


class Push(msgspec.Struct, frozen=True):
    worker: int
    push_id: int
    clock: int
    read_version: int
    num_samples: int
    loss: float | None = None  # the worker's training loss on this push's samples
    pull: bool = False  # answer with the weights for clock + 1 once the pull gate opens
    part: int = 0
    parts: int = 1
    shm: list[Any] | None = None
    via_shm: bool | None = None
    early: bool = False  # a part's answer may carry the part's next weights
    lr: float | None = None  # the evaluating rank changed the learning rate to this
    #: its slices travel as parts of paramserver/compress/formats.py's formats
    compressed: bool = False
    base: int | None = None  # with ``pull``: as Pull's


class Heartbeat(msgspec.Struct, frozen=True):
    worker: int
    run: str | None = None  # as HELLO's: a shard of another run refuses it


class Bye(msgspec.Struct, frozen=True):
    worker: int
    dead: bool = False  # from a supervisor that saw the process die (admin)


class Stats(msgspec.Struct, frozen=True):
    pass


class Checkpoint(msgspec.Struct, frozen=True):
    path: str | None = None


class Shutdown(msgspec.Struct, frozen=True):
    pass


class SPull(msgspec.Struct, frozen=True):
    worker: int
    observer: bool = False


class SPush(msgspec.Struct, frozen=True):
    worker: int
    push_id: int
    clock: int
    read_version: int
    num_samples: int
    lr: float | None = None  # as Push.lr (the step's sparse rows go first)


class SInit(msgspec.Struct, frozen=True):
    worker: int
    part: int = 0
    parts: int = 1


#: a live move's steps, in order (server/elastic.py; abort undoes the first three)
RESHARD_STEPS = ("prepare", "freeze", "align", "capture", "adopt", "commit", "abort")
#: the longest address of a plan a move names (its most shards: core/limits.py)
MAX_ADDRESS = 256
#: the longest a shard holds a RESHARD freeze or align before it answers "not yet"
MAX_RESHARD_WAIT = 10.0


class Reshard(msgspec.Struct, frozen=True):
    """One step of a live move. ``at``: freeze once this many sync rounds closed (-1:
    at the next boundary, or now outside sync); ``windows``: align each worker's
    push-id window up to this id; ``epoch``/``shard``/``servers``: the new plan's
    (adopt, commit); ``wait``: how long the answer may be held for the step to
    happen (freeze, align)."""

    step: str
    at: int = -1
    epoch: int = 0
    shard: int = 0
    servers: tuple[str, ...] = ()
    windows: dict[int, int] | None = None
    wait: float = 0.0


class PlanMoved(msgspec.Struct, frozen=True):
    """What an ERROR ``plan_moved`` carries: the plan's epoch and its servers."""

    epoch: int
    servers: tuple[str, ...]


class Error(msgspec.Struct, frozen=True):
    code: str
    reason: str
    moved: PlanMoved | None = None  # (code plan_moved: where the plan went)


# ---------------------------------------------------------------------- replies

def _outcome(f: Mapping[str, Any]) -> PushOutcome:
    """A shard's answer to one push, as the worker reads it: the core's own
    :class:`~paramserver.core.records.PushOutcome`, from its fields (a sparse
    table's outcome has no ``applied``)."""
    get = f.get
    accepted, weight, reason = get("accepted", False), get("weight", 0.0), get("reason", "")
    staleness, version = get("staleness", 0), get("version", 0)
    applied, duplicate = get("applied", False), get("duplicate", False)
    # every field of the type a shard sends (or absent): as below, one test each
    if (type(accepted) is bool and type(weight) is float and type(reason) is str
            and type(staleness) is int and type(version) is int and type(applied) is bool
            and type(duplicate) is bool):
        return PushOutcome(accepted, weight, reason, staleness, version, applied, duplicate)
    return PushOutcome(_bool(f, "accepted"), _float(f, "weight", 0.0), _str(f, "reason", ""),
                       _int(f, "staleness", 0), _int(f, "version", 0), _bool(f, "applied"),
                       _bool(f, "duplicate"))


class ReshardReply(msgspec.Struct, frozen=True):
    """A shard's answer to a RESHARD step: whether it stands frozen (held at the cut),
    its sync rounds closed, version and plan epoch, its mode, and each worker's
    last push id and clock (what align evens out)."""

    frozen: bool
    rounds: int
    version: int
    epoch: int
    mode: str
    windows: dict[int, int]
    clocks: dict[int, int]


class HelloReply(msgspec.Struct, frozen=True):
    shard: int | None
    num_shards: int
    version: int
    clock: int
    initialized: bool
    mode: str
    policy: str
    shm: dict[str, Any] | None = None  # a shared-memory challenge, or the board
    lr: float | None = None  # the learning rate the shard's optimizer has now
    squeeze: bool = False  # it compresses pulls that name a base (core/pullsqueeze.py)


class InitReply(msgspec.Struct, frozen=True):
    seeded: bool
    version: int
    partial: bool = False


class PushReply(msgspec.Struct, frozen=True):
    """A PUSH answered without weights: the outcome, or a part that is not the last
    (``partial``; ``early``: the version of the next weights it carries)."""

    outcome: PushOutcome | None
    partial: bool = False
    early: int | None = None


class PullReply(msgspec.Struct, frozen=True):
    """Weights (in frames, or a ticket to the board in ``shm``) at ``version``; for a
    PUSH that asked for them, its ``push`` outcome too (None: the push was lost)."""

    version: int
    clock: int
    waited: float = 0.0
    shm: dict[str, Any] | None = None
    push: PushOutcome | None = None
    answers_push: bool = False
    early: int | None = None  # this many slices' weights came early, with the parts
    lent: int = 0  # the bytes of weights the board ticket in ``shm`` lends (0: none)
    #: a compressed pull's answer: the count of answers the worker holds once it
    #: applied this one, and whether its tensors are the change (else the weights)
    squeeze: int | None = None
    delta: bool = False


class HeartbeatReply(msgspec.Struct, frozen=True):
    version: int
    held: dict[str, Any] | None = None  # the pull (or sparse push) the shard holds for us


class ByeReply(msgspec.Struct, frozen=True):
    dead: bool | None = None


class SPullReply(msgspec.Struct, frozen=True):
    version: int


class SInitReply(msgspec.Struct, frozen=True):
    initialized: bool


class CheckpointReply(msgspec.Struct, frozen=True):
    path: str | None
    version: int


class ShmOffer(msgspec.Struct, frozen=True, omit_defaults=True):
    """A same-host worker's offer of its gradient segment (the HELLO's ``shm`` map;
    ``proved`` sent only when true, as before it was a field here)."""

    host: str
    seg: str
    size: int
    proved: bool = False  # it wrote the shard's challenge into the segment

    @classmethod
    def of(cls, offer: Any) -> ShmOffer | None:
        """The offer, or None when it is not one (that worker then uses TCP)."""
        if not isinstance(offer, dict):
            return None
        host, seg, size = offer.get("host"), offer.get("seg"), offer.get("size")
        if (not isinstance(host, str) or not isinstance(seg, str) or type(size) is not int
                or size < 0):
            return None
        return cls(host, seg, size, offer.get("proved") is True)


class ShmGrant(msgspec.Struct, frozen=True, omit_defaults=True):
    """A shard's answer to the offer (the HELLO reply's ``shm`` map): a challenge
    (``prove``, a nonce in hex), or its board's segment, size and token (hex)."""

    board: str | None = None
    size: int = 0
    token: str | None = None
    prove: str | None = None

    @classmethod
    def of(cls, grant: Any) -> ShmGrant:
        """The grant; fields of the wrong type read as absent (an empty grant: TCP)."""
        if not isinstance(grant, dict):
            return cls()
        board, size = grant.get("board"), grant.get("size", 0)
        token, prove = grant.get("token"), grant.get("prove")
        return cls(board if isinstance(board, str) else None,
                   size if type(size) is int else 0,
                   token if isinstance(token, str) else None,
                   prove if isinstance(prove, str) else None)


# (a string: ShardStats is imported for the type checker only)
Body: TypeAlias = (
    "Hello | Init | Pull | Push | Heartbeat | Bye | Stats | Checkpoint | Shutdown | SPull"
    " | SPush | SInit | Error | PushOutcome | HelloReply | InitReply | PushReply | PullReply"
    " | HeartbeatReply | ByeReply | SPullReply | SInitReply | CheckpointReply | ShardStats"
    " | Reshard | ReshardReply | None")


# ---------------------------------------------------------------------- parsing

def _worker(op: str, f: Mapping[str, Any]) -> int:
    worker: int = f["worker"]
    if worker < 0:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"worker id must be >= 0, got {worker}")
    return worker


def _parts(op: str, f: Mapping[str, Any]) -> tuple[int, int]:
    """(part, parts): a message in several parts must say which, within MAX_PARTS."""
    parts = f.get("parts", 1)
    part = f.get("part", 0 if parts == 1 else None)
    if part is None:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{op} in {parts} parts without part")
    if not 0 <= part < parts <= MAX_PARTS:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{op} part {part} of {parts}: need "
                            f"0 <= part < parts <= {MAX_PARTS}")
    return part, parts


def _header(f: Mapping[str, Any]) -> tuple[int, int, int]:
    """A push's (read_version, clock, num_samples), in range."""
    read_version, clock, samples = f["read_version"], f["clock"], f["num_samples"]
    if read_version < 0 or clock < 0 or samples < 1:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"need read_version >= 0, clock >= 0, num_samples >= 1; "
            f"got {read_version}, {clock}, {samples}")
    return read_version, clock, samples


#: the longest run id a message may carry (launch's are 32 hex digits)
MAX_RUN_ID = 64


def _run(op: str, f: Mapping[str, Any]) -> str | None:
    """A message's run id: None when it names none, else 1 .. MAX_RUN_ID characters."""
    run: str | None = f.get("run")
    if run is not None and not 0 < len(run) <= MAX_RUN_ID:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{op}: a run id has 1 .. {MAX_RUN_ID} "
                            f"characters, not {len(run)}")
    return run


def _hello(f: Mapping[str, Any]) -> Hello:
    optimizer = f.get("optimizer")
    if optimizer is not None:
        try:
            optimizer = OptimizerSpec.checked(optimizer.get("name"), optimizer.get("args", {}),
                                              what="hello: optimizer")
        except ConfigError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, str(exc)) from None
    return Hello(_worker("hello", f), f["role"], f["protocol"], f["plan_hash"],
                 f["incarnation"], f.get("plan"), f.get("host"), f.get("pid"), f.get("shm"),
                 optimizer, _run("hello", f))


def _lr(op: str, f: Mapping[str, Any], zero: bool = False) -> float | None:
    """A push's learning-rate change: finite and > 0 (``zero``, a hello reply's: >= 0,
    what the shard runs; the optimizer's own bounds are the shard's, which refuses none
    of those)."""
    lr = f.get("lr")
    if lr is None:
        return None
    try:
        return check_lr(lr, f"{op}: lr", zero)
    except ConfigError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, str(exc)) from None


def _init(f: Mapping[str, Any]) -> Init:
    part, parts = _parts("init", f)
    return Init(_worker("init", f), part, parts, f.get("shm"))


def _pull(f: Mapping[str, Any]) -> Pull:
    clock = f["clock"]
    if clock < 0:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"clock must be >= 0, got {clock}")
    final = f.get("final") is True
    if final and f.get("observer") is not True:
        raise ProtocolError(ErrorCode.BAD_FIELD, "a final pull is an observer's: it reads the "
                            "weights once every worker is done, and gates nothing")
    return Pull(_worker("pull", f), clock, f.get("observer") is True,
                f.get("wait_init") is True, f.get("via_shm"), final, _base("pull", f))


def _base(what: str, f: Mapping[str, Any]) -> int | None:
    base = f.get("base")
    if base is not None and base < -1:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{what}: base must be >= -1, got {base}")
    return base


def _push(f: Mapping[str, Any]) -> Push:
    worker = _worker("push", f)
    push_id = f["push_id"]
    if push_id < 0:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"push_id must be >= 0, got {push_id}")
    read_version, clock, samples = _header(f)
    part, parts = _parts("push", f)
    loss = f.get("loss")
    compressed = f.get("compressed") is True
    if compressed and f.get("shm") is not None:
        raise ProtocolError(ErrorCode.BAD_FIELD, "push: a compressed push comes in frames, "
                            "not in a shared-memory segment")
    return Push(worker, push_id, clock, read_version, samples,
                None if loss is None else float(loss), f.get("pull") is True, part, parts,
                f.get("shm"), f.get("via_shm"), f.get("early") is True, _lr("push", f),
                compressed, _base("push", f))


def _spush(f: Mapping[str, Any]) -> SPush:
    worker = _worker("spush", f)
    push_id = f["push_id"]
    if push_id < 0:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"push_id must be >= 0, got {push_id}")
    read_version, clock, samples = _header(f)
    return SPush(worker, push_id, clock, read_version, samples, _lr("spush", f))


def _sinit(f: Mapping[str, Any]) -> SInit:
    part, parts = _parts("sinit", f)
    return SInit(_worker("sinit", f), part, parts)


def _servers(op: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_PLAN_SERVERS or not all(
            isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS for a in value):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{op}: servers must be a list of at most "
                            f"{MAX_PLAN_SERVERS} addresses of 1 .. {MAX_ADDRESS} characters")
    return tuple(value)


def _id_map(op: str, name: str, value: Any, limit: int = 1 << 16) -> dict[int, int]:
    """A map worker id -> a count (a push id, a clock), keys as msgpack gives them."""
    if not isinstance(value, dict) or len(value) > limit:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{op}: {name} must be a map of at most "
                            f"{limit} entries")
    out: dict[int, int] = {}
    for k, v in value.items():
        key = int(k) if isinstance(k, str) and k.isdigit() and len(k) < 19 else k
        if type(key) is not int or type(v) is not int or not (0 <= key < INT_BOUND
                                                                and 0 <= v < INT_BOUND):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{op}: {name} maps worker ids to "
                                "counts >= 0")
        out[key] = v
    return out


def _reshard(f: Mapping[str, Any]) -> Reshard:
    step, at, epoch, shard = f["step"], f.get("at", -1), f.get("epoch", 0), f.get("shard", 0)
    wait = float(f.get("wait", 0.0))
    if step not in RESHARD_STEPS:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"reshard: step must be one of "
                            f"{', '.join(RESHARD_STEPS)}, got {str(step)[:20]!r}")
    if not (-1 <= at < INT_BOUND and 0 <= epoch < INT_BOUND and 0 <= shard < MAX_PLAN_SERVERS
            and 0.0 <= wait <= MAX_RESHARD_WAIT):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"reshard: need at >= -1, epoch >= 0, 0 <= "
                            f"shard < {MAX_PLAN_SERVERS}, 0 <= wait <= {MAX_RESHARD_WAIT}")
    servers = _servers("reshard", f.get("servers", []))
    if step in ("adopt", "commit") and (not servers or shard >= len(servers) or epoch < 1):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"reshard {step}: needs the new plan's "
                            "servers, this shard's index among them and an epoch >= 1")
    windows = f.get("windows")
    return Reshard(step, at, epoch, shard, servers,
                   None if windows is None else _id_map("reshard", "windows", windows), wait)


def _error(f: Mapping[str, Any]) -> Error:
    moved = f.get("moved")
    if moved is None:
        return Error(f["code"], f["reason"])
    if not isinstance(moved, dict) or type(moved.get("epoch")) is not int \
            or not 0 <= moved["epoch"] < INT_BOUND:
        raise ProtocolError(ErrorCode.BAD_FIELD, "error: moved must be a map with an epoch >= 0")
    return Error(f["code"], f["reason"],
                 PlanMoved(moved["epoch"], _servers("error: moved", moved.get("servers"))))


_REQUESTS: dict[Op, Callable[[Mapping[str, Any]], Body]] = {
    Op.HELLO: _hello,
    Op.INIT: _init,
    Op.PULL: _pull,
    Op.PUSH: _push,
    Op.HEARTBEAT: lambda f: Heartbeat(_worker("heartbeat", f), _run("heartbeat", f)),
    Op.BYE: lambda f: Bye(_worker("bye", f), f.get("dead") is True),
    Op.STATS: lambda f: Stats(),
    Op.CHECKPOINT: lambda f: Checkpoint(f.get("path")),
    Op.SHUTDOWN: lambda f: Shutdown(),
    Op.SPULL: lambda f: SPull(_worker("spull", f), f.get("observer") is True),
    Op.SPUSH: _spush,
    Op.SINIT: _sinit,
    Op.RESHARD: _reshard,
    Op.ERROR: _error,
}


def _get(f: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = f.get(name, default)
    if value is default or type(value) is types or (isinstance(value, types) and not (
            types is int and isinstance(value, bool))):
        return value
    raise ProtocolError(ErrorCode.BAD_FIELD, f"reply: {name!r} must be "
                        f"{getattr(types, '__name__', 'a number')}, got {type(value).__name__}")


def _int(f: Mapping[str, Any], name: str, default: Any = 0) -> Any:
    return _get(f, name, int, default)


def _float(f: Mapping[str, Any], name: str, default: float) -> float:
    return float(_get(f, name, (int, float), default))


def _str(f: Mapping[str, Any], name: str, default: Any) -> Any:
    return _get(f, name, str, default)


def _bool(f: Mapping[str, Any], name: str) -> bool:
    return bool(_get(f, name, (bool, int), False))


def _map(f: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return _get(f, name, dict, None)


def _push_reply(f: Mapping[str, Any]) -> PushReply | PullReply:
    if "push" in f:  # a PUSH that asked for the weights: the pull's answer, outcome in it
        push = f["push"]
        if push is not None and not isinstance(push, dict):
            raise ProtocolError(ErrorCode.BAD_FIELD, "reply: 'push' must be a map")
        return _pull_reply(f, None if push is None else _outcome(push), True)
    if f.get("partial"):
        return PushReply(None, True, _int(f, "early", None))
    return PushReply(_outcome(f))


def _pull_reply(f: Mapping[str, Any], push: PushOutcome | None = None,
                answers_push: bool = False) -> PullReply:
    get = f.get
    version, clock, waited = get("version", 0), get("clock", 0), get("waited", 0.0)
    if (type(version) is int and type(clock) is int and type(waited) is float
            and get("shm") is None and get("early") is None
            and get("squeeze") is None):  # weights in frames, as most are
        return PullReply(version, clock, waited, None, push, answers_push)
    ticket = _map(f, "shm")
    squeeze = _int(f, "squeeze", None)
    if squeeze is not None and squeeze < 1:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"reply: 'squeeze' must be >= 1, got {squeeze}")
    return PullReply(_int(f, "version"), _int(f, "clock"), _float(f, "waited", 0.0),
                     ticket, push, answers_push, _int(f, "early", None),
                     0 if ticket is None else _int(ticket, "nbytes"), squeeze,
                     _bool(f, "delta"))


def _stats_reply(f: Mapping[str, Any]) -> ShardStats:
    from paramserver.wire import stats  # (it imports protocol, which imports this module)

    return stats.decode(f)


_REPLIES: dict[str, Callable[[Mapping[str, Any]], Body]] = {
    "hello": lambda f: HelloReply(_int(f, "shard", None), _int(f, "num_shards"),
                                  _int(f, "version"), _int(f, "clock"),
                                  _bool(f, "initialized"), _str(f, "mode", ""),
                                  _str(f, "policy", ""), _map(f, "shm"),
                                  _lr("hello reply", f, zero=True), _bool(f, "squeeze")),
    "init": lambda f: InitReply(_bool(f, "seeded"), _int(f, "version"), _bool(f, "partial")),
    "pull": _pull_reply,
    "push": _push_reply,
    "heartbeat": lambda f: HeartbeatReply(_int(f, "version"), _map(f, "held")),
    "bye": lambda f: ByeReply(f.get("dead") if isinstance(f.get("dead"), bool) else None),
    "spull": lambda f: SPullReply(_int(f, "version")),
    "spush": _outcome,
    "sinit": lambda f: SInitReply(_bool(f, "initialized")),
    "checkpoint": lambda f: CheckpointReply(_str(f, "path", None), _int(f, "version")),
    "stats": _stats_reply,
    "reshard": lambda f: ReshardReply(
        _bool(f, "frozen"), _int(f, "rounds"), _int(f, "version"), _int(f, "epoch"),
        _str(f, "mode", ""), _id_map("reshard reply", "windows", _get(f, "windows", dict, {})),
        _id_map("reshard reply", "clocks", _get(f, "clocks", dict, {}))),
}


def parse(op: Op, fields: Mapping[str, Any]) -> Body:
    """The record of ``op`` from its ``fields`` (their types already checked against
    the schema, protocol._check_fields); a reply's by the op it answers (None for
    SHUTDOWN's, which has no fields). Raises ProtocolError."""
    if op is Op.REPLY:
        make = _REPLIES.get(fields.get("re", ""))
        return None if make is None else make(fields)
    return _REQUESTS[op](fields)


_SPARSE = frozenset({Op.SPULL, Op.SPUSH, Op.SINIT})


def check_tensors(op: Op, tensors: Mapping[str, torch.Tensor]) -> None:
    """The bounds on a request's tensors that need no table: a sparse request carries
    at most MAX_REQUEST_ROWS row ids, all its tables together."""
    if op not in _SPARSE:
        return
    rows = sum(t.numel() for k, t in tensors.items() if k.startswith("ids:"))
    if rows > MAX_REQUEST_ROWS:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{op.value.upper()}: {rows} row ids > the "
                            f"limit of {MAX_REQUEST_ROWS} per request; send them in several")
