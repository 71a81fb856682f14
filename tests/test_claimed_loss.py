"""A worker's claimed loss cannot stop a shard under CURVE (issue 42, item 8).

A push's ``loss`` is what the worker says, not what the shard measures. Under CURVE,
where stopping is reserved for admin keys, a non-admin key that claimed a rising loss
made ``loss_rising`` stop a shard run with ``--on-divergence stop`` (exit 3). The loss
rules still raise their alarms on anyone's claims, but once a loss they read came from
a key that may not stop the shard (Access.may_stop), the alarm is not divergence.
"""

from __future__ import annotations

from paramserver.observe.watchdog import PushObservation, StepObservation, Watchdog
from paramserver.server.access import Access
from paramserver.wire.curve import KeyGrant

RISING = [1.0] * 100 + [1.0 + 0.02 * i for i in range(200)]


def _feed(dog: Watchdog, losses: list[float], may_stop: list[bool]) -> list:
    out = []
    for i, (loss, trusted) in enumerate(zip(losses, may_stop, strict=True)):
        out += dog.observe_push(PushObservation(worker=i % 2, version=i + 1, accepted=True,
                                                loss=loss, loss_may_stop=trusted))
        out += dog.observe_step(StepObservation(i + 1, 0.01, 1.0))
    return out


def _rising(alarms: list) -> list:
    return [a for a in alarms if a.signal == "loss_rising"]


def test_a_claimed_rising_loss_alarms_but_is_not_divergence() -> None:
    got = _rising(_feed(Watchdog(0), RISING, [False] * len(RISING)))
    assert got and not any(a.divergence for a in got)
    assert "does not stop" in got[0].message


def test_a_trusted_rising_loss_is_still_divergence() -> None:
    got = _rising(_feed(Watchdog(0), RISING, [True] * len(RISING)))
    assert got and got[0].divergence


def test_one_claim_among_the_losses_the_rules_read_is_enough() -> None:
    """The claim may be the reference (a low loss claimed early) or one push of the
    rise: either way the figures are not the shard's own."""
    for claimed in (5, len(RISING) - 150):
        trust = [True] * len(RISING)
        trust[claimed] = False
        got = _rising(_feed(Watchdog(0), RISING, trust))
        assert got and not any(a.divergence for a in got)


def test_the_stall_rule_follows_the_same_rule() -> None:
    flat = [2.3 + 0.05 * ((i * 7919) % 13 - 6) / 6 for i in range(600)]
    got = [a for a in _feed(Watchdog(0), flat, [False] * 600) if a.signal == "loss_stalled"]
    assert got and not got[0].divergence


def test_who_may_stop_a_shard() -> None:
    assert Access(None).may_stop(None)  # no CURVE: everyone is trusted
    access = Access({"w": KeyGrant(), "op": KeyGrant(admin=True)})
    assert access.may_stop("op")
    assert not access.may_stop("w")
    assert not access.may_stop("unlisted")
    assert not access.may_stop(None)
