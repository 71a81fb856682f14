"""What one worker is told: :class:`WorkerConfig`, declared like ``ServerConfig``.

Apart from worker.py (the training loop, which loads torch) so that the CLI can
declare the worker options from it without loading torch: every module it imports
is light. Importable from ``paramserver.workers.worker`` too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from paramserver.core import features
from paramserver.core.limits import DEFAULT_CHUNK_BYTES
from paramserver.errors import ConfigError
from paramserver.server.config import ConfigRecord, check_bounds, option
from paramserver.util.coerce import parse_kwargs, parse_task_args
from paramserver.util.jsontypes import JSONObject
from paramserver.workers.stragglerspec import StragglerSpec

__all__ = ["EVALUATOR_ENV", "GRAD_WIRE_DTYPE_NAMES", "OPTIONS_ENV", "RUN_ENV", "LaunchOptions",
           "WorkerConfig", "check_evaluator", "worker_default"]

#: the names of paramserver.util.dtypes.GRAD_WIRE_DTYPES, the 16-bit dtypes gradients may
#: travel in (a test keeps the two equal; that table is torch's dtypes)
GRAD_WIRE_DTYPE_NAMES: tuple[str, ...] = ("bfloat16", "float16")

#: what --device may say; whether a CUDA device is here is torch's to tell
_DEVICE = re.compile(r"auto|(cpu|cuda)(:\d+)?")


@dataclass
class WorkerConfig(ConfigRecord):
    """Everything one worker needs; validated on construction."""

    WHAT: ClassVar[str] = "worker"

    rank: int = option(0, min=0, per_process=True,
                       help="This worker's rank, 0 .. world-size - 1 (selects its part of the "
                            "data).")
    world_size: int = option(1, min=1, metavar="N", per_process=True,
                             help="How many workers share the data.")
    #: the run this worker belongs to: a shard of another run refuses its HELLO
    run_id: str | None = option(None, per_process=True, metavar="ID",
                                help="This worker's run: a shard of another run refuses it "
                                     "(launch gives every process of a run one id).")
    servers: list[str] = option(default_factory=list, kind="shards", per_process=True,
                                required=True,
                                help="Every shard's address, in shard order: comma-separated "
                                     "or repeated; a shard with replicas as its replicas' "
                                     "addresses joined by |, the primary first.")
    task: str = option("digits-mlp", metavar="NAME|module:function",
                       help="What to train: a registered task (see `paramserver tasks`) or "
                            "your factory.")
    task_args: dict[str, Any] = option(default_factory=dict, flag="task-arg", kind="pairs",
                                       parse=parse_task_args,
                                       help="Task parameter, e.g. hidden=128 (repeatable).")
    device: str = option("auto", metavar="auto|cpu|cuda[:N]",
                         help="Where the model replica computes; auto takes CUDA when present.")
    steps: int | None = option(100, min=1, metavar="N", help="Updates (pushes) per worker.")
    epochs: float | None = option(None, min=0, min_open=True, metavar="E",
                                  help="Train for E passes over the worker's data instead of "
                                       "--steps.")
    #: wall-clock budget from the worker's first step; checked before each step
    budget_seconds: float = option(0.0, min=0, metavar="SECONDS",
                                   help="Stop pushing once this many seconds have passed since "
                                        "the worker's first step (checked before each step, so "
                                        "the last step ends at most one step later); then say "
                                        "BYE as usual. With it, --steps/--epochs are a cap "
                                        "and may be left out (0: no budget).")
    #: passed to the task if it takes batch_size
    batch_size: int | None = option(None, min=1, metavar="N",
                                    help="Mini-batch size (default: the task's).")
    #: passed to the task if it takes seed; also seeds straggler draws
    seed: int = option(0, min=0, metavar="N",
                       help="Seed of the task's data order and of the straggler draws.")
    push_every: int = option(1, min=1, metavar="K", help="Accumulate K mini-batches per push.")
    # local SGD / DiLoCo (workers/localsgd.py): the inner optimizer runs here, the
    # servers' optimizer is the outer one
    local_optimizer: str | None = option(None, metavar="NAME|module:Class",
                                         help="Local SGD / DiLoCo: step this torch.optim "
                                              "optimizer (sgd, adamw, ...) on the worker and "
                                              "push the weights' change every --sync-every "
                                              "steps (docs/research.md).")
    local_args: dict[str, Any] = option(default_factory=dict, flag="local-arg", kind="pairs",
                                        parse=parse_kwargs,
                                        help="Local optimizer keyword argument, e.g. lr=0.001 "
                                             "(repeatable).")
    sync_every: int = option(1, min=1, metavar="H",
                             help="With --local-optimizer: push (and pull) every H local "
                                  "steps; --steps counts local steps, so a worker pushes "
                                  "ceil(steps / H) times.")
    straggler: StragglerSpec = option(default_factory=StragglerSpec, nested=True,
                                      help="How this worker is slowed down (the straggler "
                                           "options).")
    eval_every: int = option(0, min=0, metavar="N",
                             help="The evaluator (--evaluator) evaluates held-out data every "
                                  "N clocks (0: at the end only).")
    #: checked against the number of workers where that is known (ClusterSpec, the worker)
    evaluator: int = option(0, min=0, metavar="RANK",
                            help="The worker that evaluates held-out data; a command finds it "
                                 "as PARAMSERVER_EVALUATOR (DistributedOptimizer.evaluates).")
    chunk_bytes: int = option(DEFAULT_CHUNK_BYTES, min=1, metavar="BYTES",
                              help="Tensors larger than this are split across shards.")
    # a shard's share of a push above this goes in parts, added as they arrive (0: whole);
    # the default is workers.client.PART_BYTES, the default chunk
    part_bytes: int = option(DEFAULT_CHUNK_BYTES, min=0, metavar="BYTES",
                             help="A shard's share of a push larger than this is sent in parts "
                                  "of about this size (whole chunks), which a sync shard adds "
                                  "up as they arrive, so its memory does not grow with the "
                                  "number of workers (0: always whole).")
    # each part's next weights asked for as soon as its sum is final (pipelined per part):
    # off by default, since on one host the CPU, not the link, is the limit
    early_parts: bool = option(False,
                               help="A sync push in parts (--part-bytes) asks each shard, over "
                                    "TCP, for a part's next weights as soon as every worker's "
                                    "copy of it is in, so they come back while later parts "
                                    "still go up. Pays across hosts, where the link is the "
                                    "limit; on one host it only costs CPU (docs/performance.md, "
                                    "\"Across hosts: an emulated cluster\").")
    timeout: float = option(60.0, min=0, min_open=True, metavar="SECONDS",
                            help="How long to wait for a server, first contact included "
                                 "(servers may start after workers), before giving up with the "
                                 "address waited for.")
    request_timeout: float = option(5.0, min=0, min_open=True, metavar="SECONDS",
                                    help="A request unanswered this long is sent again (until "
                                         "--timeout).")
    barrier_timeout: float = option(0.0, min=0, metavar="SECONDS",
                                    help="How long a pull may wait at a live shard's sync "
                                         "barrier or SSP gate (slow peers: data loading, "
                                         "evaluation, restarts) before giving up (0: no "
                                         "bound; a progress line is logged meanwhile). A shard "
                                         "that does not answer at all fails after --timeout.")
    heartbeat_interval: float = option(1.0, min=0, metavar="SECONDS",
                                       help="Seconds between heartbeats to every shard (0: "
                                            "none).")
    # push gradients in buckets from inside backward and get the next weights with the
    # last one (workers/overlap.py); wire_dtype: send gradients in 16 bits
    overlap: bool = option(False,
                           help="Push gradients in buckets from inside backward and get the "
                                "next weights with the last one (docs/performance.md).")
    bucket_bytes: int = option(4 << 20, min=1, metavar="BYTES",
                               help="--overlap: gradients are pushed in buckets of about this "
                                    "many bytes.")
    wire_dtype: str | None = option(None, choices=GRAD_WIRE_DTYPE_NAMES,
                                    help="Send gradients in this 16-bit dtype (default: as "
                                         "they are).")
    # the push's compressor (paramserver/compress); bf16/fp16 are --wire-dtype, to the byte
    compression: str | None = option(None, metavar="NAME[:key=value,...]",
                                     help="Compress each push: none, bf16, fp16, int8, "
                                          "topk:ratio=R, randomk:ratio=R, sign, or "
                                          "module:Class (see `paramserver compressors`). "
                                          "Biased ones keep what a push leaves out and add "
                                          "it to the next (error feedback; ef=0: off), e.g. "
                                          "topk:ratio=0.01 or sign:ef=0.")
    event_log: str | None = option(None, kind="file", metavar="FILE", per_process=True,
                                   help="Append JSONL events (one per step) to FILE.")
    trace: str | None = option(None, kind="file", metavar="FILE", per_process=True,
                               flag="trace-file", dest="trace_file",
                               help="Record this worker's steps (versions read, compute "
                                    "and wire time, bytes) in FILE (docs/research.md).")
    result_file: str | None = option(None, kind="file", metavar="FILE", per_process=True,
                                     help="Write this worker's result (counts, loss, timings) "
                                          "as JSON to FILE.")
    curve_key: str | None = option(None, kind="file", metavar="FILE",
                                   help="CURVE: this worker's secret key file.")
    curve_server_key: str | None = option(None, kind="file", metavar="FILE",
                                          help="CURVE: the servers' public key file.")

    def __post_init__(self) -> None:
        if isinstance(self.straggler, Mapping):
            self.straggler = StragglerSpec(**self.straggler)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.steps is None and self.epochs is None and not self.budget_seconds:
            raise ConfigError("give steps, epochs or budget_seconds")
        if bool(self.curve_key) != bool(self.curve_server_key):
            raise ConfigError("CURVE needs both curve_key (this client's .key_secret file) and "
                              "curve_server_key (the server's public .key file)")
        if self.timeout <= 0 or self.request_timeout <= 0:
            raise ConfigError("timeout and request_timeout must be > 0")
        if self.part_bytes < 0:
            raise ConfigError(f"part_bytes must be >= 0 (0: pushes go whole), "
                              f"got {self.part_bytes}")
        if self.wire_dtype not in (None, *GRAD_WIRE_DTYPE_NAMES):
            raise ConfigError(f"wire_dtype must be one of {', '.join(GRAD_WIRE_DTYPE_NAMES)} or "
                              f"None (gradients as they are); got {self.wire_dtype!r}")
        features.check(self.features())  # the pairs of features that do not work together
        if self.compression is not None:  # (loads torch: only when one is given)
            check_compression(self.compression, self.wire_dtype)
        if self.sync_every != 1 and self.local_optimizer is None:
            raise ConfigError("sync_every needs local_optimizer (--local-optimizer)")
        check_bounds(self)  # the rest of the bounds the fields declare
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be auto, cpu or cuda:N; got {self.device!r}")
        if self.device.startswith("cuda"):  # is it here? torch knows, so ask it only then
            from paramserver.workers.worker import resolve_device

            resolve_device(self.device)


    def features(self) -> set[str]:
        """The features of paramserver/core/features.py this worker's options turn on."""
        return features.active(curve=bool(self.curve_key),
                               local_sgd=self.local_optimizer is not None,
                               overlap=self.overlap, wire_dtype=self.wire_dtype,
                               compression=self.compression, trace=bool(self.trace))


def check_compression(spec: str, wire_dtype: str | None) -> None:
    """Refuse, in one line, a ``--compression`` that names no compressor, a parameter
    it lacks or a bad value, or that contradicts ``--wire-dtype``."""
    from paramserver.compress import with_wire_dtype

    with_wire_dtype(spec, wire_dtype)


def worker_default(name: str) -> Any:
    """WorkerConfig's default for its option ``name``."""
    default = WorkerConfig.__dataclass_fields__[name].default
    assert default is not MISSING, name
    return default


#: the launcher's worker options for a command run (a LaunchOptions JSON file)
OPTIONS_ENV = "PARAMSERVER_WORKER_OPTIONS"
#: the rank that evaluates held-out data, as a launcher tells a command (``--evaluator``)
EVALUATOR_ENV = "PARAMSERVER_EVALUATOR"
#: the launcher's run id: a shard of another run (at a reused port) refuses the worker
RUN_ENV = "PARAMSERVER_RUN"


def check_evaluator(evaluator: int, workers: int) -> None:
    """One line, where the number of workers is known, for an evaluator that is none."""
    if not 0 <= evaluator < workers:
        raise ConfigError(f"evaluator must be a worker rank, 0 .. {workers - 1} with "
                          f"{workers} worker(s); got {evaluator}")


@dataclass(frozen=True)
class LaunchOptions:
    """The launcher's worker options that act on a command run: what
    ``paramserver launch [flags] -- COMMAND`` hands each rank's DistributedOptimizer
    (arguments the script passes win). ``straggler`` is this rank's scenario,
    injected by ``step()``, its draws seeded by ``(seed, rank)``."""

    # the same options as WorkerConfig's, with its defaults (declared once, there)
    straggler: StragglerSpec = field(default_factory=StragglerSpec)
    seed: int = worker_default("seed")
    timeout: float = worker_default("timeout")
    request_timeout: float = worker_default("request_timeout")
    heartbeat_interval: float = worker_default("heartbeat_interval")
    barrier_timeout: float = worker_default("barrier_timeout")
    chunk_bytes: int = worker_default("chunk_bytes")
    part_bytes: int = worker_default("part_bytes")
    early_parts: bool = worker_default("early_parts")
    wire_dtype: str | None = worker_default("wire_dtype")
    compression: str | None = worker_default("compression")
    curve_key: str | None = worker_default("curve_key")
    curve_server_key: str | None = worker_default("curve_server_key")

    @classmethod
    def of(cls, worker: WorkerConfig, straggler: StragglerSpec) -> LaunchOptions:
        """``worker``'s values of these options, with this rank's ``straggler``."""
        return cls(straggler=straggler, **{
            f.name: getattr(worker, f.name) for f in fields(cls) if f.name != "straggler"})

    def to_json(self) -> JSONObject:
        data: JSONObject = msgspec.to_builtins(self)
        return data

    @classmethod
    def from_env(cls) -> LaunchOptions:
        """The file ``PARAMSERVER_WORKER_OPTIONS`` names; the defaults without one."""
        path = os.environ.get(OPTIONS_ENV)
        if not path:
            return cls()
        try:
            return msgspec.convert(json.loads(Path(path).read_text()), type=cls)
        except (OSError, ValueError, msgspec.ValidationError) as exc:
            raise ConfigError(f"{OPTIONS_ENV}={path}: {exc}") from None
