"""The shard's state machine, with no I/O: every consistency rule lives here once.

``ShardCore`` holds one shard's parameter slices as torch tensors and a
torch.optim optimizer over them, the shard's ``version`` (optimizer steps
applied), every worker's ``clock`` (pushes completed) and liveness, and the
rules of the three modes:

* ``sync`` (BSP): a round at version v closes when every live worker has
  pushed a gradient read at v (or all but ``backup_workers``); one optimizer
  step with the sample-weighted mean ``sum(n_i w_i g_i) / sum(n_i)``. A pull by
  a worker that contributed to the open round waits for the round to close.
  A push may come in parts, each added into the round's one buffer as it
  arrives (the shard never holds a worker's whole gradient); a push given up
  half-way (its worker died, a part was not finite) voids the round: it
  closes without a step, since what was added cannot be taken back out.
* ``async`` (ASP): every accepted push is its own optimizer step.
* ``ssp``: as async, plus a pull by a worker at clock c is answered only when
  ``c - min(clock of live workers) <= s``, where s is ``staleness_bound`` or,
  if the policy overrides :meth:`StalenessPolicy.staleness_bound`, the bound
  it returns from the shard's measured waiting and staleness (adaptive SSP).

The push rules are written once in rules.py, for the dense slices here and the
sparse tables' rows (rows.py); the workers' membership is a :class:`Membership`
the core owns (membership.py).

Time is an argument (``now``, seconds), never read from a clock, so the same
core runs under the socket server, in unit tests and in a virtual-time
simulator. Waiting is expressed as parked pull *tokens*; after any event the
driver calls :meth:`ShardCore.ready_pulls` and answers what it returns.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from paramserver.core import pullgate, report, rules, snapshot
from paramserver.core.corestate import CoreState
from paramserver.core.probe import GradStats, StepStats, all_finite, norm_and_span
from paramserver.core.pullsqueeze import PullAnswer
from paramserver.core.records import (
    DTYPES,
    MAX_WORKERS,
    MODES,
    STATS_WORKERS,
    CoreConfig,
    Mode,
    ModeSpec,
    PullReply,
    PushOutcome,
    SliceSpec,
    WorkerState,
    check_header,
    check_tensors,
)
from paramserver.core.rounds import Stream
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.policies.base import StalenessPolicy, UpdateInfo

# the records are defined in records.py, the measurements in probe.py; importable here
__all__ = [
    "DTYPES", "MAX_WORKERS", "MODES", "STATS_WORKERS", "CoreConfig", "GradStats", "Mode",
    "ModeSpec", "PullReply", "PushOutcome", "ShardCore", "SliceSpec", "StepStats",
    "WorkerState",
]

log = logging.getLogger(__name__)


class ShardCore(CoreState):
    """One shard's parameters, optimizer and consistency rules. No sockets, no msgpack.
    What it holds is :class:`CoreState`'s (corestate.py); the rules that change it, here."""

    # ------------------------------------------------------------------ weights

    def initialize(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Seed the weights (first INIT wins). Returns False if already initialized."""
        if self.initialized:
            return False
        check_tensors(self.specs, tensors, "INIT")
        with torch.no_grad():
            for key, value in tensors.items():
                self.params[key].copy_(value)
        self.initialized = True
        self.seeding.end()
        return True

    def initialize_part(self, worker: int, tensors: Mapping[str, torch.Tensor],
                        part: int = 0, parts: int = 1) -> bool | None:
        """:meth:`initialize` from INIT sent in ``parts``, each copied in as it arrives.

        The first worker to send a part seeds the shard; parts from others are
        refused (False) meanwhile, and pulls wait instead of failing. If that
        worker dies or restarts before its last part, the next INIT starts over.
        Returns True when this part completed the seeding, None for an earlier
        part (or one sent again).
        """
        state = self.members.known(worker)  # only a registered worker may seed (and own INIT)
        state.spoke = True  # a worker, not a bare HELLO: never evicted for a newcomer
        if not state.live:
            raise ProtocolError(ErrorCode.NOT_REGISTERED,
                                f"worker {worker} is not in the live set; say HELLO")
        if self.initialized:
            return False
        if parts == 1:
            return self.initialize(tensors)
        done = self.seeding.accept(worker, part, parts, tensors, self.specs, self.params)
        if done:
            self.initialized = True
        return done

    def check_part(self, tensors: Mapping[str, torch.Tensor],
                   seen: AbstractSet[str] = frozenset()) -> None:
        """Validate one part of a push that a driver joins (keys of this shard not in
        ``seen``, each with its slice's shape and dtype), before it keeps it."""
        check_tensors(self.specs, tensors, "PUSH", narrow_ok=True, whole=False, seen=seen)

    def check_push_id(self, worker: int, push_id: int) -> WorkerState:
        """The state of a registered ``worker`` (not gone with BYE) whose ``push_id``
        lies within its window; else the ProtocolError :meth:`push` would raise."""
        state = self.members.known(worker)
        if state.finished:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED, f"worker {worker} said BYE; say HELLO to push again")
        self._check_window(state, push_id)
        return state

    def _check_window(self, state: WorkerState, push_id: int) -> None:
        rules.check_window(state.worker, push_id, state.last_push_id, state.anchored,
                           self.config.push_id_window)

    def copy_on_write(self) -> None:
        """Move the parameters to fresh storage, leaving the old for its readers.

        The optimizer keeps working on the same tensor objects; only their
        storage changes, so anything still reading the old memory (a zero-copy
        send in flight) sees a consistent snapshot.
        """
        self.layout.rebind(self.flats, self.params)

    # ------------------------------------------------------------------ pulls

    def request_pull(
        self, worker: int, clock: int, token: Hashable, now: float, observer: bool = False,
        wait_init: bool = False, final: bool = False,
    ) -> None:
        """Park a pull; it is answered through :meth:`ready_pulls` when its gate opens
        (pullgate.py has the rules)."""
        pullgate.request(self, worker, clock, token, now, observer, wait_init, final)

    def ready_pulls(self, now: float) -> list[PullReply]:
        """Pop every parked pull whose gate is open now, oldest first."""
        return pullgate.ready(self, now)

    def answer_squeezed(self, worker: int, version: int) -> PullAnswer | None:
        """A ready pull of ``worker``'s, answered compressed (pullsqueeze.py; None: it
        takes plain weights). The worker then reads its reconstruction, not the
        weights: a policy that rewrites gradients from the weights read (dc-asgd,
        gap-aware) compares against that, the weights the gradient was computed at."""
        assert self.squeeze is not None
        out = self.squeeze.answer(worker, self.params, version)
        if out is not None and self.policy.needs_read_weights:
            held = self.squeeze.held[worker]
            self.read_weights[worker] = {k: held[k].view_as(p).clone()
                                         for k, p in self.params.items()}
        return out

    # ------------------------------------------------------------------ pushes

    def push(
        self,
        worker: int,
        push_id: int,
        clock: int,
        read_version: int,
        num_samples: int,
        grads: Mapping[str, torch.Tensor],
        now: float,
        part: int = 0,
        parts: int = 1,
    ) -> PushOutcome | None:
        """Decide on one gradient push and apply it (async/ssp) or buffer it (sync).

        A push whose ``push_id`` was seen already is answered with the first
        outcome and not applied again (exactly-once under retries). Invalid
        input raises :class:`ProtocolError` before any state changes.

        A push may come in ``parts`` (sync shards, see :attr:`streams_parts`;
        a whole push always returns its outcome). Each part holds a subset of
        the shard's slices, together all of them, each once, all with the same
        header. The push is decided at its first part; every part is added
        into the round's buffer as it arrives and can be released at once. A
        part that is not the last returns None; a part sent again is not added
        again. A push given up half-way (its worker died or restarted, a newer
        push came, a part was not finite) voids the open round.
        """
        state = self.members.known(worker)
        if not self.initialized:
            raise ProtocolError(ErrorCode.NOT_INITIALIZED, "push before INIT")
        again = rules.replay(push_id, state.last_push_id, state.last_outcome, self.version)
        if again is not None:
            return again
        self._check_window(state, push_id)
        if parts != 1 and not self.streams_parts:
            raise ProtocolError(ErrorCode.BAD_FIELD, "this shard takes pushes whole, not in "
                                "parts (only sync shards without a rewriting policy do)")
        if not 0 <= part < parts:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"push part {part} of {parts}: need 0 <= part < parts")
        stream = self.round.streams.get(worker)
        if stream is not None and push_id < stream.push_id:
            # a part of a push its worker gave up on, arriving late: not added
            return PushOutcome(False, 0.0, "superseded", 0, self.version, False, True)
        if stream is not None and stream.push_id != push_id:
            self._give_up(worker, "a newer push came before it was complete")
            stream = None
        if stream is None:
            check_header(self.version, read_version, clock, num_samples)
        else:
            stream.check_header(part, clock, read_version, num_samples, parts)
            if part in stream.received:
                return None  # sent again after a lost reply: added already
        seen: AbstractSet[str] = stream.keys if stream is not None else frozenset()
        check_tensors(self.specs, grads, "PUSH", narrow_ok=True, whole=parts == 1, seen=seen)
        if parts > 1 and len(stream.received if stream else ()) + 1 == parts:
            missing = self.specs.keys() - grads.keys() - seen
            if missing:
                self._give_up(worker, "its parts did not cover the shard")
                raise ProtocolError(ErrorCode.BAD_TENSOR,
                                    f"PUSH: missing keys after the last part: "
                                    f"{sorted(missing)[:5]}")
        norm = None
        flat: torch.Tensor | bool | None = False  # the slices as one span: not looked for
        if self.config.check_finite:
            # a finite norm proves every element finite, in one pass over all slices
            norm, flat = norm_and_span(list(grads.values()))
            if not math.isfinite(norm):
                for key, g in grads.items():
                    if not all_finite(g):
                        if stream is not None:
                            self._give_up(worker, "a part was not finite")
                        raise ProtocolError(
                            ErrorCode.NONFINITE, f"gradient {key!r} holds NaN or Inf; not applied"
                        )
        if state.finished:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED, f"worker {worker} said BYE; say HELLO to push again"
            )
        if not state.live:
            # a push is a sign of life, as a heartbeat is
            self.members.heartbeat(worker, now)
        state.last_seen = now
        if stream is None:
            self.members.pushed(state, now)  # its pace; back in, if it was left out
            stream = self._open(state, push_id, clock, read_version, num_samples, parts)
            if stream.decision is not None and self.mode.mode == Mode.SYNC:
                self.round.begin(now)  # the round's deadline runs from its first push
        stream.received.add(part)
        stream.keys.update(grads)
        if stream.measure is not None:
            self.probe.measure(stream.measure, grads, norm, flat)
        if self.mode.mode == Mode.SYNC:
            self._add_to_round(stream, grads)
            if len(stream.received) < parts:
                self.round.streams[worker] = stream  # in the making, until its last part
                return None
            self.round.streams.pop(worker, None)
            outcome = self._close_push(state, stream)
        else:
            outcome = self._push_async(state, stream, grads, norm)
        state.last_push_id = push_id
        state.anchored = True
        state.last_outcome = outcome
        self.probe.push_done()  # do not hold on to the push's frames
        return outcome

    @property
    def streams_parts(self) -> bool:
        """Whether this shard adds pushes part by part (sync, no rewriting policy);
        otherwise a driver joins the parts and calls :meth:`push` with the whole."""
        return self.mode.mode == Mode.SYNC and not self.policy_rewrites

    def _open(self, state: WorkerState, push_id: int, clock: int, read_version: int,
              num_samples: int, parts: int) -> Stream:
        """Count a new push and decide on it (from its header alone)."""
        tau = self.version - read_version
        state.opened(clock, tau)
        self.totals.pushed(tau)
        info = UpdateInfo(
            worker=state.worker, shard=self.config.shard, staleness=tau,
            read_version=read_version, version=self.version, clock=clock,
            min_clock=self.members.min_clock(), num_samples=num_samples,
        )
        decision, reason = rules.judge(self.mode.mode, self.policy, info,
                                       state.worker in self.round.members)
        if decision is None:
            state.rejected[reason] += 1
        else:
            state.count(decision)
        return Stream(push_id, parts, info, decision, reason,
                      measure=self.probe.push_begins(state.worker))

    def drop_unfinished(self, worker: int, why: str, restart: bool = False) -> None:
        """``worker`` is gone or starts over: its push in parts is given up, its parked
        sparse push is not answered (``restart``: its sparse push ids start afresh
        too), and if it was seeding the weights in parts, the next INIT seeds them
        from the start."""
        self._give_up(worker, why)
        if restart:
            self.rows.forget(worker)
        else:
            self.rows.drop_waiting(worker)
        if self.seeding.owner == worker:
            self.seeding.end()

    def _give_up(self, worker: int, why: str) -> None:
        """Drop ``worker``'s unfinished push; if some of it is in the round, void the round."""
        stream = self.round.streams.pop(worker, None)
        if stream is None:
            return
        if stream.decision is not None:
            self.members.workers[worker].uncount(stream.decision, "incomplete")
        if self.round.give_up(stream):
            self.ahead.drop()
            log.warning("worker %d's push %d was given up after %d of %d parts (%s): the "
                        "open round is void and closes without a step", worker,
                        stream.push_id, len(stream.received), stream.parts, why)

    def _add_to_round(self, stream: Stream, grads: Mapping[str, torch.Tensor]) -> None:
        decision = stream.decision
        if self.round.void:
            stream.voided = True
        if decision is None or not decision.accept or stream.voided:
            self.round.mute(stream.info.worker)
            self._step_final(stream)
            return
        if self.policy_rewrites:
            grads = self._rewrite(stream.info, grads)  # whole pushes only (streams_parts)
        alpha = stream.info.num_samples * decision.weight
        alone = self._alone(stream.info.worker)
        self.round.add(stream, grads, alpha, borrow=alone)
        if alone:
            # the divisor the round will close with (SyncRound.close: samples / factor)
            rate = self.stepper.fused_alpha(stream.info.num_samples / alpha, 1, self.version)
            self.ahead.part(grads, rate, more=len(stream.received) < stream.parts)
        else:  # not alone (any more): the buffer may be written now
            self.ahead.not_alone()
            self._step_final(stream)

    def _step_final(self, stream: Stream) -> None:
        """Step ahead the keys whose sums just became final, in a round with several
        contributors summed by worker id, if its step only reads them (pipelined per
        part: paramserver/core/ahead.py), at the rate the close will compute."""
        final = self.round.complete()
        if not final or not self.stepper.reads_only(self.params):
            return
        samples, contributors = self.round.totals(stream)
        if samples <= 0:
            return
        rate = self.stepper.fused_alpha(samples, contributors, self.version)
        more = len(self.round.sealed) + len(final) < len(self.params)
        self.ahead.part({k: self.round.agg[k] for k in self.params if k in final}, rate,
                        more=more, shared=True)
        if self.ahead.active:
            self.round.sealed |= final

    def _alone(self, worker: int) -> bool:
        """Whether the open round would close on ``worker``'s push alone, to be stepped
        by a step that only reads it (otherwise it is copied part by part, as usual)."""
        if self.round.members or not self.stepper.reads_only(self.params):
            return False
        others = [w for w in self.members.live() if w.worker != worker]
        return len(others) <= self.mode.backup_workers

    def _close_push(self, state: WorkerState, stream: Stream) -> PushOutcome:
        """The last part of a sync push is in: it joins the round."""
        if stream.measure is not None:
            self.probe.push_complete(state.worker, stream.measure)
        decision = stream.decision
        if stream.voided and not self.round.void and decision is not None:
            # its round closed void while its parts were skipped: it is not in this one
            state.uncount(decision, "round_void")
            decision, stream.reason = None, "round_void"
        if decision is None:
            return rules.refused(stream.reason, stream.info.staleness, self.version)
        self.round.join(state.worker, stream.info.num_samples if decision.accept else 0)
        stepped = self.maybe_close_round()
        if not stepped:
            self.round.settle()  # its tensors are not ours once it is answered
            self.ahead.not_alone()  # nor is the round its alone
        return rules.answered(decision, 0, self.version, stepped)

    def _widen(self, grads: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Gradients that arrived in 16 bits, in their parameter's dtype."""
        if all(g.dtype == self.params[k].dtype for k, g in grads.items()):
            return grads
        return {k: g.to(self.params[k].dtype) for k, g in grads.items()}

    def _rewrite(self, info: UpdateInfo, grads: Mapping[str, torch.Tensor]
                 ) -> Mapping[str, torch.Tensor]:
        if not self.policy_rewrites:
            return grads
        grads = self._widen(grads)
        lr = self.stepper.lr
        read = self.read_weights.get(info.worker)
        return self.policy.rewrite_gradient(info, grads, self.params, read, lr)

    @property
    def policy_rewrites(self) -> bool:
        """Whether the policy overrides rewrite_gradient (it then sees whole pushes)."""
        return type(self.policy).rewrite_gradient is not StalenessPolicy.rewrite_gradient

    def _push_async(self, state: WorkerState, stream: Stream, grads: Mapping[str, torch.Tensor],
                    norm: float | None = None) -> PushOutcome:  # norm: the finite check's
        info, decision = stream.info, stream.decision
        assert decision is not None
        if stream.measure is not None:
            self.probe.push_complete(state.worker, stream.measure, grads)
        if not decision.accept:
            return rules.answered(decision, info.staleness, self.version, False)
        if not self._step(self._widen(self._rewrite(info, grads)), decision.weight,
                          staleness=info.staleness,
                          grad_norm=None if self.policy_rewrites else norm):
            state.uncount(decision, "nonfinite_step")
            return rules.refused("nonfinite_step", info.staleness, self.version)
        return rules.answered(decision, info.staleness, self.version, True)

    def maybe_close_round(self) -> bool:
        """Close the open sync round when at most ``backup_workers`` live ones are missing
        (and no resumed worker is awaited)."""
        if self.mode.mode != Mode.SYNC or self.members.awaited or not rules.round_full(
                self.round.members, self.members.pacing_ids(), self.mode.backup_workers):
            return False
        if self.round.in_flight():
            return False  # a backup's parts are in the buffer already: let it finish
        contributors = self.round.accepted

        def ahead(alpha: float) -> bool:
            return self.ahead.commit(alpha, self.version + 1, self.before_step)

        try:
            return self.round.close(
                lambda sums, divisor: self._step(sums, 1.0, contributors, divisor=divisor,
                                                 ahead=ahead),
                borrow=self.stepper.reads_only(self.params))
        finally:
            self.ahead.end_round()

    def _step(self, grads: Mapping[str, torch.Tensor], weight: float, contributors: int = 1,
              staleness: int = 0, divisor: float = 1.0,
              ahead: Callable[[float], bool] | None = None,
              grad_norm: float | None = None) -> bool:
        """One optimizer step on ``grads / divisor``, the learning rate scaled by
        ``weight`` (and by the step-size rules, for a step averaging ``contributors``
        gradients). False: it would have made the weights or the optimizer's state
        NaN or Inf and was undone (the version stays; ``on_refused`` is told)."""
        prior = 0 if self.mode.mode == Mode.SYNC else max(0, len(self.members.live()) - 1)
        if not self.stepper.step(self.params, grads, weight, contributors=contributors,
                                 version=self.version, staleness=staleness,
                                 prior_staleness=prior, probe=self.probe,
                                 before_step=self.before_step, divisor=divisor, ahead=ahead,
                                 grad_norm=grad_norm):
            refused = self.stepper.refused
            if not refused & (refused - 1):  # at 1, 2, 4, ...: a hostile stream must not flood
                log.warning("shard %d: a step at version %d was refused: its gradient was past "
                            "the input limit, or the step would have made the weights or the "
                            "optimizer's state NaN or Inf (%d so far)",
                            self.config.shard, self.version, refused)
            if self.after_step is not None:  # the weights were written, and back: the
                self.after_step()  # driver's hook closes what before_step opened
            if self.on_refused is not None:
                self.on_refused(self.version)
            return False
        self.version += 1
        if self.after_step is not None:
            self.after_step()
        return True

    # ------------------------------------------------------------------ membership
    # the membership's rules, as the server and the tests call them on the core

    def register(self, worker: int, incarnation: str, now: float,
                 origin: str = "") -> WorkerState:
        return self.members.register(worker, incarnation, now, origin)

    def heartbeat(self, worker: int, now: float) -> None:
        self.members.heartbeat(worker, now)

    def leave(self, worker: int, now: float) -> None:
        self.members.leave(worker, now)

    def expire(self, now: float) -> list[int]:
        return self.members.expire(now)

    def declare_dead(self, worker: int) -> bool:
        return self.members.declare_dead(worker)

    def leave_out(self, now: float) -> list[int]:
        return self.members.leave_out(now)

    def round_deadline(self) -> float:
        return self.members.round_deadline()

    # ------------------------------------------------------------------ observability

    def observe(self, observer: Callable[[GradStats | StepStats], None] | None, *,
                cosine_decay: float | None = 0.97, every: int = 1) -> None:
        """Report pushes' :class:`GradStats` and optimizer steps' :class:`StepStats`.

        ``every``: measure one push in ``every`` (and the step it causes; sync
        rounds are always measured), for shards too large to measure each time;
        0: by the shard's size, every push up to 4M elements (16 MB of float32),
        then one in ``ceil(elements / 4M)``, so that measuring stays a small
        part of the work per push.
        ``cosine_decay``: decay of the running mean gradient the cosine is taken
        against (None: no cosine, and no memory for the mean).
        """
        self.probe.observe(observer, cosine_decay=cosine_decay, every=every)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything needed to resume this shard: (tensors, JSON-able metadata), in
        the format paramserver/core/snapshot.py describes."""
        return snapshot.save(self)

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                        now: float) -> None:
        """Restore :meth:`state_dict`'s output. Workers get a fresh heartbeat
        grace period (``now``) to reconnect. Nothing changes unless the weights fit the
        slices, are finite, and the version is an integer >= 0."""
        snapshot.load(self, tensors, meta)
        self.members.workers = {int(wid): WorkerState.from_record(int(wid), w, now)
                                for wid, w in meta["workers"].items()}
        self.pulls.clear()
        self.rows.reset()

    # ------------------------------------------------------------------ reporting

    def stats(self) -> report.CoreStats:
        return report.stats(self)
