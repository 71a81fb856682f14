"""Fuzzing a live shard server with random and mutated messages over a real socket.

One server process serves the whole test. A real worker (the project's client,
a real model and real gradients) registers, seeds the weights and trains a few
steps; then hypothesis generates N_MESSAGES messages: valid HELLO / INIT /
PULL / PUSH / HEARTBEAT / BYE / STATS messages with mutations (flipped bytes,
truncated, missing or extra frames, wrong dtypes and shapes, huge declared
shapes, unknown ops and keys, future protocol versions and read versions,
NaN/Inf gradients, wrong plan hashes, duplicate registration, fields of the
wrong type) and plain garbage. They go out on a few DEALER sockets without
waiting, and every reply is collected.

A message that would legitimately change the weights must not be sent if the
weights are to stay unchanged: so a PUSH that decodes and holds only finite
gradients gets a NaN (it then must be refused), and a decodable SHUTDOWN,
CHECKPOINT or BYE for the real worker is replaced by an unknown op. Everything
else is sent as generated.

Afterwards: the server is up, every message got exactly one answer, a message
the protocol decoder refuses (checked locally with the same decoder) got an
ERROR with the same code, no message caused an internal error, the server's
error counters equal the ERROR replies, weights (bit for bit) and version are
unchanged, and the real worker pulls and pushes again.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from paramserver.core.sharding import ShardPlan
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.server.loop import ServerConfig
from paramserver.util.dtypes import FLOAT_DTYPES, WIRE_DTYPES
from paramserver.wire.protocol import MAX_HEADER_BYTES, PROTOCOL_VERSION, decode
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.tasks import create_task
from paramserver.workers.worker import WorkerConfig

pytestmark = pytest.mark.integration

N_MESSAGES = 10_000
N_SOCKETS = 4
BATCH = 10  # messages per hypothesis example: the engine's per-example cost is the larger
TASK = "synthetic-logreg"
REAL_STEPS = 3  # the real worker's pushes before the fuzzing: its last push id
INT64 = st.integers(-(2**63), 2**64 - 1)  # everything msgpack can carry as an integer
SMALL = st.integers(-3, 12)
OPS = ["hello", "init", "pull", "push", "heartbeat", "bye", "stats"]


@dataclass
class Draft:
    """A message under construction: header fields and tensor frames."""

    header: dict[str, Any]
    frames: list[bytes]
    raw_header: bytes | None = None  # set: send these header bytes instead


@dataclass
class Sample:
    frames: list[bytes]
    expect: str  # "ok" or the ErrorCode the local decoder raised
    neutralised: str = ""
    want: str = ""  # for the hand-written corpus: the server's answer it must get


# ------------------------------------------------------------------ strategies


def _tensor_frames(plan: ShardPlan, seed: int) -> tuple[list[list[Any]], list[bytes]]:
    rng = np.random.default_rng(seed)
    descs, frames = [], []
    for s in plan.shard_slices(0):
        descs.append([s.key, s.dtype, [s.numel]])
        frames.append((rng.standard_normal(s.numel) * 0.01).astype(np.float32).tobytes())
    return descs, frames


# mostly the real worker (registered, live) or small ids a fuzzed HELLO may register
WORKER_IDS = st.one_of(st.just(0), st.just(0), st.integers(0, 4), INT64)
_SCALARS = st.one_of(st.none(), st.booleans(), INT64, st.floats(), st.text(max_size=12),
                     st.binary(max_size=12))
JUNK = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8)
MUTATIONS = st.sampled_from([
    "version", "op", "drop_field", "field_type", "extra_field", "seq", "f_type", "t_type",
    "dtype", "shape", "huge_shape", "key", "desc_form", "dup_key", "nonfinite",
    "extra_frame", "missing_frame", "extra_desc", "extra_tensor", "plan_hash", "plan",
    "protocol", "flip", "truncate", "garbage_header", "junk_header", "huge_header",
])
_S: dict[str, st.SearchStrategy[Any]] = {
    "version": st.one_of(st.integers(PROTOCOL_VERSION + 1, 2**32), st.just(0), st.none(),
                         st.just(str(PROTOCOL_VERSION)), st.integers(-9, -1)),
    "op": st.one_of(st.text(max_size=12), INT64, st.none(),
                    st.sampled_from(["reply", "error", "PUSH", "push "])),
    "field_type": st.one_of(JUNK, st.integers(2**62, 2**64 - 1), st.integers(-(2**63), -1)),
    "seq": st.one_of(st.integers(-(2**63), -1), st.integers(2**62, 2**64 - 1),
                     st.text(max_size=4), st.floats(), st.booleans()),
    "f_type": st.one_of(st.lists(SMALL, max_size=3), st.text(max_size=5), INT64),
    "t_type": st.one_of(st.dictionaries(st.text(max_size=3), SMALL, max_size=2),
                        st.text(max_size=5), INT64),
    "dtype": st.one_of(st.sampled_from([*WIRE_DTYPES, "float128", "object", "<f4", "",
                                        "complex64"]), st.text(max_size=8), INT64),
    "shape": st.one_of(st.lists(st.integers(0, 64), max_size=9),
                       st.lists(st.integers(-5, 5), max_size=3), st.lists(INT64, max_size=3),
                       st.just([True]), st.just([1.5]), st.text(max_size=4)),
    "huge_shape": st.sampled_from([[2**40], [2**31, 2**31], [2**62 - 1, 2**62 - 1], [2**63],
                                   [0, 2**62], [2**20] * 8]),
    "key": st.one_of(st.text(max_size=20), st.just(""), st.just("k" * 2000), INT64, st.none()),
    "nonfinite": st.sampled_from([math.nan, math.inf, -math.inf]),
    "tensor_key": st.sampled_from(["bogus", "weight/0", "param/weight"]),
    "plan_hash": st.one_of(st.text("0123456789abcdef", max_size=64), JUNK),
    "plan": st.one_of(JUNK, st.just({"params": [], "num_shards": 1}),
                      st.just({"num_shards": 2})),
    "protocol": st.one_of(st.integers(PROTOCOL_VERSION + 1, 2**32), st.just(0)),
    "binary": st.binary(max_size=80),
    # values mostly valid, so that the checks past decoding are reached often
    "push_id": st.one_of(st.integers(REAL_STEPS + 1, 1000), st.integers(REAL_STEPS + 1, 1000),
                         st.integers(0, REAL_STEPS), INT64),
    "read_version": st.one_of(st.integers(0, REAL_STEPS), st.integers(0, REAL_STEPS),
                              st.integers(REAL_STEPS + 1, 99), INT64),
    "clock": st.one_of(st.integers(0, 12), st.integers(0, 12), SMALL, INT64),
    "num_samples": st.one_of(st.integers(1, 64), st.integers(1, 64), INT64),
    "incarnation": st.text("0123456789abcdef", min_size=1, max_size=32),
    "op_name": st.sampled_from(OPS),
    "role": st.sampled_from(["worker", "observer"]),
}


@st.composite
def _base(draw: st.DrawFn, plan: ShardPlan) -> Draft:
    op = draw(_S["op_name"])
    wid = draw(WORKER_IDS)
    fields: dict[str, Any]
    descs: list[list[Any]] = []
    frames: list[bytes] = []
    if op == "hello":
        fields = {"worker": wid, "role": draw(_S["role"]),
                  "protocol": PROTOCOL_VERSION, "plan_hash": plan.hash, "plan": plan.describe(),
                  "incarnation": draw(_S["incarnation"])}
    elif op in ("init", "push"):
        descs, frames = _tensor_frames(plan, draw(st.integers(0, 2**32 - 1)))
        fields = {"worker": wid}
        if op == "push":
            # push ids past the real worker's are new, the others duplicates
            fields.update(push_id=draw(_S["push_id"]), clock=draw(_S["clock"]),
                          read_version=draw(_S["read_version"]),
                          num_samples=draw(_S["num_samples"]))
    elif op == "pull":
        fields = {"worker": wid, "clock": draw(_S["clock"]),
                  "observer": draw(st.booleans())}
    elif op == "stats":
        fields = {}
    else:
        fields = {"worker": wid}
    header = {"v": PROTOCOL_VERSION, "op": op, "seq": draw(st.integers(0, 2**31)), "f": fields,
              "t": descs}
    return Draft(header, frames)


def _mutation(draw: st.DrawFn, d: Draft) -> None:
    """Apply one randomly chosen mutation to a draft, in place."""
    h = d.header
    # earlier mutations may have replaced the fields map or the descriptor list
    f: dict[str, Any] = h["f"] if isinstance(h["f"], dict) else {}
    t: list[list[Any]] = (h["t"] if isinstance(h["t"], list)
                          and all(isinstance(x, list) and len(x) == 3 for x in h["t"]) else [])
    kind = draw(MUTATIONS)
    if kind in ("version", "op", "seq"):
        h[{"version": "v"}.get(kind, kind)] = draw(_S[kind])
    elif kind == "drop_field" and f:
        f.pop(draw(st.sampled_from(sorted(f))))
    elif kind == "field_type" and f:
        f[draw(st.sampled_from(sorted(f)))] = draw(_S["field_type"])
    elif kind == "extra_field":
        f[draw(st.text(max_size=10))] = draw(JUNK)
    elif kind in ("f_type", "t_type"):
        h[kind[0]] = draw(_S[kind])
    elif kind in ("dtype", "shape", "huge_shape", "key") and t:
        i = draw(st.integers(0, len(t) - 1))
        t[i][{"key": 0, "dtype": 1}.get(kind, 2)] = draw(_S[kind])
    elif kind == "desc_form" and t:
        i = draw(st.integers(0, len(t) - 1))
        t[i] = draw(st.one_of(st.just(t[i][:2]), st.just([*t[i], "x"]), st.text(max_size=5),
                              st.dictionaries(st.text(max_size=3), SMALL, max_size=2)))
    elif kind == "dup_key" and t and d.frames:
        t.append(list(t[0]))
        d.frames.append(d.frames[0])
    elif kind == "nonfinite" and d.frames:
        i = draw(st.integers(0, len(d.frames) - 1))
        usable = len(d.frames[i]) // 4 * 4  # an extra frame may be any length
        arr = np.frombuffer(d.frames[i][:usable], dtype=np.float32).copy()
        if arr.size:
            arr[draw(st.integers(0, arr.size - 1))] = draw(_S["nonfinite"])
            d.frames[i] = arr.tobytes() + d.frames[i][usable:]
    elif kind == "extra_frame":
        d.frames.append(draw(st.binary(max_size=64)))
    elif kind == "missing_frame" and d.frames:
        d.frames.pop(draw(st.integers(0, len(d.frames) - 1)))
    elif kind == "extra_desc" and isinstance(h["t"], list):
        h["t"].append(["extra", "float32", [draw(st.integers(0, 8))]])
    elif kind == "extra_tensor" and isinstance(h["t"], list):  # well-formed, unknown key
        n = draw(st.integers(0, 8))
        h["t"].append([draw(_S["tensor_key"]), "float32", [n]])
        d.frames.append(bytes(4 * n))
    elif kind in ("plan_hash", "plan", "protocol"):
        f[kind] = draw(_S[kind])
    elif kind == "flip":
        _finish(d)
        frames = [d.raw_header or b"", *d.frames]
        i = draw(st.integers(0, len(frames) - 1))
        buf = bytearray(frames[i])
        for _ in range(draw(st.integers(1, 4)) if buf else 0):
            buf[draw(st.integers(0, len(buf) - 1))] ^= draw(st.integers(1, 255))
        frames[i] = bytes(buf)
        d.raw_header, d.frames = frames[0], frames[1:]
    elif kind == "truncate":
        _finish(d)
        frames = [d.raw_header or b"", *d.frames]
        i = draw(st.integers(0, len(frames) - 1))
        frames[i] = frames[i][:draw(st.integers(0, max(0, len(frames[i]) - 1)))]
        d.raw_header, d.frames = frames[0], frames[1:]
    elif kind == "garbage_header":
        d.raw_header = draw(_S["binary"])
    elif kind == "junk_header":
        d.raw_header = msgpack.packb(draw(JUNK), use_bin_type=True)
    elif kind == "huge_header" and draw(st.integers(0, 19)) == 0:  # rare: 1 MiB each
        h["pad"] = "x" * (MAX_HEADER_BYTES + 1)


def _finish(d: Draft) -> None:
    if d.raw_header is None:
        d.raw_header = msgpack.packb(d.header, use_bin_type=True)


@st.composite
def samples(draw: st.DrawFn, plan: ShardPlan) -> Draft:
    d = draw(_base(plan))
    for _ in range(draw(st.integers(0, 3))):
        if d.raw_header is not None:  # byte-level already: only more bytes-level changes
            _bytes_only(draw, d)
        else:
            _mutation(draw, d)
    _finish(d)
    return d


def seed_corpus(plan: ShardPlan) -> list[tuple[Draft, str]]:
    """One hand-written message per kind of hostile input, with the error code it must
    get; sent before the random ones."""
    descs, frames = _tensor_frames(plan, 0)

    def push(**over: Any) -> Draft:
        f = {"worker": 0, "push_id": REAL_STEPS + 1, "clock": REAL_STEPS, "read_version": 0,
             "num_samples": 8, **over}
        return Draft({"v": PROTOCOL_VERSION, "op": "push", "seq": 1, "f": f,
                      "t": [list(x) for x in descs]}, list(frames))

    def hello(**over: Any) -> Draft:
        f = {"worker": 0, "role": "worker", "protocol": PROTOCOL_VERSION, "plan_hash": plan.hash,
             "plan": plan.describe(), "incarnation": "intruder", **over}
        return Draft({"v": PROTOCOL_VERSION, "op": "hello", "seq": 1, "f": f, "t": []}, [])

    nan = bytearray(frames[0])
    nan[:4] = np.float32(math.nan).tobytes()
    out = [
        hello(),  # duplicate registration of the live worker 0
        hello(worker=7, plan_hash="0" * 64),  # wrong plan hash
        hello(worker=7, protocol=PROTOCOL_VERSION + 1),  # a future protocol
        Draft({"v": PROTOCOL_VERSION + 1, "op": "pull", "f": {}, "t": []}, []),
        Draft({"v": PROTOCOL_VERSION, "op": "rewind", "f": {}, "t": []}, []),  # unknown op
        push(read_version=10**6),  # a version from the future
        push(worker=12345),  # never registered
        push(num_samples=-1),
        push(clock="soon"),
        push(),  # NaN: replaced below
        push(),  # wrong dtype: below
        push(),  # wrong shape: below
        push(),  # a huge declared shape: below
        push(),  # an unknown key: below
        push(),  # truncated frame: below
        push(),  # an extra frame: below
        push(),  # a missing frame: below
        Draft({"v": PROTOCOL_VERSION, "op": "stats", "f": {}, "t": [],
               "pad": "x" * (MAX_HEADER_BYTES + 1)}, []),  # over the header limit
    ]
    out[9].frames[0] = bytes(nan)
    out[10].header["t"][0][1] = "int32"
    out[11].header["t"][0][2] = [len(frames[0]) // 4 + 1]
    out[12].header["t"][0][2] = [2**31, 2**31]
    out[13].header["t"].append(["bogus", "float32", [1]])
    out[13].frames.append(bytes(4))
    out[14].frames[0] = frames[0][:-3]
    out[15].frames.append(b"extra")
    out[16].frames.pop()
    for d in out:
        _finish(d)
    out.append(Draft({}, [], raw_header=b"\xc1garbage"))
    E = ErrorCode
    want = [E.DUPLICATE_WORKER, E.PLAN_MISMATCH, E.PROTOCOL_VERSION, E.PROTOCOL_VERSION,
            E.UNKNOWN_OP, E.FUTURE_VERSION, E.NOT_REGISTERED, E.BAD_FIELD, E.BAD_FIELD,
            E.NONFINITE, E.BAD_TENSOR, E.BAD_TENSOR, E.BAD_TENSOR, E.UNKNOWN_KEY, E.BAD_TENSOR,
            E.BAD_MESSAGE, E.BAD_MESSAGE, E.TOO_LARGE, E.BAD_HEADER]
    return list(zip(out, want, strict=True))


def _bytes_only(draw: st.DrawFn, d: Draft) -> None:
    frames = [d.raw_header or b"", *d.frames]
    i = draw(st.integers(0, len(frames) - 1))
    if draw(st.booleans()) and frames[i]:
        buf = bytearray(frames[i])
        buf[draw(st.integers(0, len(buf) - 1))] ^= draw(st.integers(1, 255))
        frames[i] = bytes(buf)
    else:
        frames[i] = frames[i][:draw(st.integers(0, len(frames[i])))]
    d.raw_header, d.frames = frames[0], frames[1:]


# ------------------------------------------------------------------ the oracle


_UNKNOWN_OP_HEADER = msgpack.packb({"v": PROTOCOL_VERSION, "op": "neutralised", "f": {}, "t": []})


def _nan_bytes(dtype: torch.dtype) -> bytes:
    return bytes(torch.tensor([math.nan], dtype=dtype).view(torch.uint8).numpy().tobytes())


def neutralise(d: Draft) -> Sample:
    """Classify with the protocol's own decoder; defuse what a server must obey."""
    frames = [d.raw_header or b"", *d.frames]
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        return Sample(frames, exc.code)
    except Exception as exc:  # the decoder must only ever raise ProtocolError
        raise AssertionError(f"decode raised {type(exc).__name__}: {exc}") from exc
    op = msg.op.value
    # (a RESHARD freeze would hold every later request: an admin's, as SHUTDOWN is)
    if op in ("shutdown", "checkpoint", "reshard") or (op == "bye" and msg.get("worker") == 0):
        return Sample([_UNKNOWN_OP_HEADER], ErrorCode.UNKNOWN_OP, f"{op} (replaced)")
    if op == "push":
        floats = [(i, t) for i, t in enumerate(msg.tensors.values())
                  if t.dtype in FLOAT_DTYPES.values() and t.numel()]
        if floats and all(bool(torch.isfinite(t).all()) for _, t in floats):
            i, t = floats[0]
            frame = bytearray(frames[i + 1])
            nan = _nan_bytes(t.dtype)
            frame[:len(nan)] = nan
            frames[i + 1] = bytes(frame)
            decode(frames)  # still decodes
            return Sample(frames, "ok", "finite push (NaN added)")
    return Sample(frames, "ok")


# ------------------------------------------------------------------ the test


@dataclass
class Fuzzer:
    address: str
    sockets: list[zmq.Socket[bytes]] = field(default_factory=list)
    sent: list[list[Sample]] = field(default_factory=list)
    replies: list[list[list[bytes]]] = field(default_factory=list)
    turn: int = 0

    def __post_init__(self) -> None:
        ctx = zmq.Context.instance()
        for i in range(N_SOCKETS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.IDENTITY, b"fuzz%d" % i)
            sock.connect(self.address)
            self.sockets.append(sock)
            self.sent.append([])
            self.replies.append([])

    def send(self, sample: Sample) -> None:
        i = self.turn % N_SOCKETS
        self.turn += 1
        self.sockets[i].send_multipart(sample.frames)
        self.sent[i].append(sample)
        self.drain(i)

    def drain(self, i: int) -> None:
        sock = self.sockets[i]
        while True:
            try:
                self.replies[i].append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def wait_all(self, timeout: float) -> None:
        """Every message answered (the server answers each connection in order)."""
        deadline = time.monotonic() + timeout
        for i, sock in enumerate(self.sockets):
            while len(self.replies[i]) < len(self.sent[i]):
                left = deadline - time.monotonic()
                assert left > 0, (f"socket {i}: {len(self.replies[i])} replies to "
                                  f"{len(self.sent[i])} messages")
                if sock.poll(int(left * 1000)):
                    self.drain(i)
            self.drain(i)
            assert len(self.replies[i]) == len(self.sent[i])

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)


def _observer_weights(address: str, plan: ShardPlan) -> tuple[dict[str, torch.Tensor], int]:
    model = create_task(TASK, 0, 1, {}).model
    params = dict(model.named_parameters())
    with PSClient([address], plan, worker=99, role="observer", heartbeat_interval=0,
                  timeout=20) as client:
        client.connect()
        versions = client.pull(params).versions
    return {k: v.detach().clone() for k, v in params.items()}, versions[0]


def _train_step(client: PSClient, task: Any, params: dict[str, torch.Tensor],
                clock: int) -> tuple[int, bool]:
    pulled = client.pull(params, clock)
    inputs, targets = next(iter(task.batches))
    task.model.zero_grad(set_to_none=True)
    task.loss_fn(task.model(inputs), targets).backward()
    grads = {k: p.grad for k, p in params.items()}
    pushed = client.push(grads, pulled.versions, int(targets.shape[0]), clock)
    return clock + 1, pushed.accepted


def test_fuzzed_messages_leave_a_live_server_unchanged(tmp_path: Any) -> None:
    spec = ClusterSpec(num_servers=1, num_workers=1,
                       server=ServerConfig(mode="async", heartbeat_timeout=600),
                       worker=WorkerConfig(servers=[], task=TASK), evaluate=False)
    task = create_task(TASK, 0, 1, {})
    plan = ShardPlan.from_module(task.model, 1)
    params = dict(task.model.named_parameters())
    with LocalCluster(spec, tmp_path) as cluster:
        (address,) = cluster.start_servers()
        server_pid = cluster.servers[0].popen.pid
        # the real worker: no heartbeat thread, so that every message the server
        # counts during the fuzzing is accounted for (its registration outlives
        # the test: heartbeat_timeout is long)
        with PSClient([address], plan, worker=0, heartbeat_interval=0, timeout=20) as real:
            clock = real.connect()
            real.initialize(params)
            for _ in range(REAL_STEPS):
                clock, accepted = _train_step(real, task, params, clock)
                assert accepted
            weights_before, version_before = _observer_weights(address, plan)
            before = server_stats([address])[0]
            assert before.version == version_before == REAL_STEPS

            fuzzer = Fuzzer(address)
            neutralised: Counter[str] = Counter()

            @settings(max_examples=N_MESSAGES // BATCH, deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(st.lists(samples(plan), min_size=BATCH, max_size=BATCH))
            def fuzz(drafts: list[Draft]) -> None:
                for draft in drafts:
                    sample = neutralise(draft)
                    neutralised[sample.neutralised] += 1
                    fuzzer.send(sample)

            t0 = time.monotonic()
            try:
                for draft, want in seed_corpus(plan):
                    sample = neutralise(draft)
                    sample.want = want
                    neutralised[sample.neutralised] += 1
                    fuzzer.send(sample)
                while fuzzer.turn < N_MESSAGES:  # hypothesis skips repeats: top up
                    fuzz()
                fuzzer.wait_all(timeout=60)
            finally:
                fuzzer.close()
            elapsed = time.monotonic() - t0
            assert cluster.servers[0].popen.poll() is None, "the server died"
            assert cluster.servers[0].popen.pid == server_pid

            after = server_stats([address])[0]
            weights_after, version_after = _observer_weights(address, plan)
            # ---- state untouched
            assert version_after == after.version == before.version
            for key, w in weights_before.items():
                assert torch.equal(w.view(torch.uint8), weights_after[key].view(torch.uint8)), key
            assert after.workers["0"].applied == before.workers["0"].applied
            # ---- every message answered, and refused with the decoder's own code
            sent = [s for per in fuzzer.sent for s in per]
            assert len(sent) >= N_MESSAGES
            codes: Counter[str] = Counter()
            for per_sent, per_replies in zip(fuzzer.sent, fuzzer.replies, strict=True):
                for sample, frames in zip(per_sent, per_replies, strict=True):
                    reply = decode(frames)
                    code = reply["code"] if reply.op.value == "error" else "ok"
                    codes[code] += 1
                    if sample.expect != "ok":
                        assert code == sample.expect, (sample.frames[:1], reply.fields)
                    if sample.want:
                        assert code == sample.want, (sample.frames[:1], reply.fields)
                    if code == "ok" and reply.get("re") == "push":
                        # only a repeated push id is answered (with the first answer)
                        assert reply["duplicate"], reply.fields
            assert codes[ErrorCode.INTERNAL] == 0, codes
            # ---- the counters account for all of it
            delta = Counter({k: v - before.counters.get(k, 0)
                             for k, v in after.counters.items()})
            errors = {k[len("error_"):]: v for k, v in delta.items()
                      if k.startswith("error_") and v}
            assert errors == {c: n for c, n in codes.items() if c != "ok"}
            decodable = sum(1 for s in sent if s.expect == "ok")
            # + the STATS request that took `after`
            assert delta["messages"] == decodable + 1
            # the mix reached every kind of refusal the issue lists
            for code in (ErrorCode.BAD_MESSAGE, ErrorCode.BAD_HEADER, ErrorCode.UNKNOWN_OP,
                         ErrorCode.BAD_FIELD, ErrorCode.BAD_TENSOR, ErrorCode.TOO_LARGE,
                         ErrorCode.PROTOCOL_VERSION, ErrorCode.PLAN_MISMATCH,
                         ErrorCode.DUPLICATE_WORKER, ErrorCode.UNKNOWN_KEY,
                         ErrorCode.FUTURE_VERSION, ErrorCode.NONFINITE,
                         ErrorCode.NOT_REGISTERED):
                assert codes[code] > 0, (code, codes)
            print(f"\n{len(sent)} messages in {elapsed:.1f}s; replies by code: "
                  f"{dict(codes)}; neutralised: {dict(neutralised)}")
            # ---- and it still serves the real worker
            clock, accepted = _train_step(real, task, params, clock)
            assert accepted
            assert server_stats([address])[0].version == REAL_STEPS + 1
            real.bye()

