"""The push rules every payload obeys, written once: dense slices (core/shard.py) and
sparse rows (core/rows.py) differ only in what is stepped or held in a round.

* exactly-once (:func:`replay`, :func:`check_window`): a push id at or below the
  worker's last is answered with the first outcome (the same id) or as a duplicate
  (an older one), never applied again; a new id may lie at most ``window`` ahead.
* admission (:func:`judge`): in sync mode a gradient read before the open round's
  version is ``late`` and a second push into the same round is
  ``duplicate_in_round``, both dropped before the policy; every other push is the
  staleness policy's to decide, through :func:`decide`.
* the round (:func:`round_full`): a sync round closes when at most
  ``backup_workers`` of the workers it waits for have not pushed into it; the SSP
  bound a policy sets is checked by :func:`ssp_bound`.
* the answers (:func:`refused`, :func:`answered`): one :class:`PushOutcome` shape.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from paramserver.core.records import Mode, PushOutcome
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.policies.base import BoundStats, Decision, StalenessPolicy, UpdateInfo

__all__ = ["answered", "check_window", "decide", "judge", "refused", "replay", "round_full",
           "ssp_bound"]

#: the reasons a sync push is dropped before its policy sees it
LATE = "late"
DUPLICATE_IN_ROUND = "duplicate_in_round"


def replay(push_id: int, last_push_id: int, last_outcome: PushOutcome | None,
           version: int) -> PushOutcome | None:
    """The answer to a push id already seen (None: a new one). The last id is answered
    with its outcome again, an older one as a plain duplicate; neither is applied."""
    if push_id > last_push_id:
        return None
    prior = last_outcome if push_id == last_push_id else None
    base = prior or PushOutcome(False, 0.0, "duplicate", 0, version, False)
    return PushOutcome(base.accepted, base.weight, base.reason, base.staleness,
                       base.version, base.applied, duplicate=True)


def check_window(worker: int, push_id: int, last_push_id: int, anchored: bool,
                 window: int) -> None:
    """A new push id more than ``window`` past the worker's last (once its own pushes
    set that last id: ``anchored``) -> :class:`ProtocolError`: a forged id may hide
    at most ``window`` of the real worker's pushes."""
    if anchored and push_id > last_push_id + window:
        raise ProtocolError(
            ErrorCode.BAD_FIELD,
            f"push_id {push_id} is more than {window} ahead of worker {worker}'s "
            f"last ({last_push_id})",
        )


def decide(policy: StalenessPolicy, info: UpdateInfo) -> Decision:
    """The policy's decision on a push, checked; an accept at weight 0 is a rejection."""
    decision = policy.decide(info)
    if not isinstance(decision, Decision):
        raise ConfigError(f"policy {policy.name!r} returned {decision!r}, not a Decision")
    if decision.accept and decision.weight == 0.0:
        decision = Decision(False, 0.0, decision.reason or "weight 0")
    return decision


def judge(mode: Mode, policy: StalenessPolicy, info: UpdateInfo,
          in_round: bool) -> tuple[Decision | None, str]:
    """Admit a new push and decide on it, from its header alone: (the decision, its
    reason), or (None, why it was dropped before the policy)."""
    if mode == Mode.SYNC and info.staleness > 0:
        # a gradient for a round that already closed (a backup worker's or a
        # rejoining worker's): dropped, and the worker moves on
        return None, LATE
    if mode == Mode.SYNC and in_round:
        return None, DUPLICATE_IN_ROUND
    decision = decide(policy, info)
    return decision, decision.reason


def ssp_bound(policy: StalenessPolicy, stats: BoundStats, configured: int) -> int:
    """The SSP bound ``policy`` sets from ``stats`` (None: the ``configured`` one)."""
    bound = policy.staleness_bound(stats)
    if bound is None:
        return configured
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
        raise ConfigError(f"policy {policy.name!r} returned SSP bound {bound!r}; need an int >= 0")
    return bound


def round_full(members: Collection[int], waited_for: Iterable[int], backup_workers: int
               ) -> bool:
    """Whether a sync round with ``members`` may close: it has one, and at most
    ``backup_workers`` of the workers it waits for are missing from it."""
    if not members:
        return False
    missing = [w for w in waited_for if w not in members]
    return len(missing) <= backup_workers


def refused(reason: str, staleness: int, version: int) -> PushOutcome:
    """The answer to a push that is not applied."""
    return PushOutcome(False, 0.0, reason, staleness, version, False)


def answered(decision: Decision, staleness: int, version: int, applied: bool
             ) -> PushOutcome:
    """The answer to a push its policy decided on (in a sync round: once it joined;
    ``applied``: a step happened because of it, as when it closed the round)."""
    return PushOutcome(decision.accept, decision.weight if decision.accept else 0.0,
                       decision.reason, staleness, version, applied)
