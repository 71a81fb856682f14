"""Literature checks on local SGD (the ``local-sgd`` preset), beside report.py's own.

* Douillard et al. (2023), DiLoCo: sync local SGD with H = 32 ends within 10% of
  sync SGD's final loss at equal gradients computed, with at least 20x fewer bytes
  communicated per worker.
* Liu et al. (2024), asynchronous local SGD: naive async local SGD (Nesterov on every
  pseudo-gradient) makes less progress per local update than sync local SGD, and
  delayed Nesterov closes most of that gap.

"Per update" is per local update (gradient computed), as in Liu et al.'s figures: every
configuration of the preset computes the same gradients, so the final held-out loss
compares them. Each claim is checked per scenario that has the configurations it needs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paramserver.workers.experiments.report import ClaimCheck, ConfigSummary

__all__ = ["DILOCO_BYTES_FACTOR", "DILOCO_LOSS_TOLERANCE", "GAP_CLOSED", "check_local_sgd"]

log = logging.getLogger(__name__)

#: DiLoCo's final loss may be this much above sync SGD's
DILOCO_LOSS_TOLERANCE = 0.10
#: and it must send at least this many times fewer bytes per worker
DILOCO_BYTES_FACTOR = 20.0
#: "most of the gap": the share of naive async's excess loss that delayed Nesterov removes,
#: measured in log loss (a diverging naive run would otherwise make any gap look closed)
GAP_CLOSED = 0.5
DILOCO_H = 32


def _median(s: ConfigSummary, stat: str) -> float:
    return s.stats[stat].median if s.runs else math.nan


def _usable(summaries: Sequence[ConfigSummary]) -> dict[str, list[ConfigSummary]]:
    by_scenario: dict[str, list[ConfigSummary]] = {}
    for s in summaries:
        if s.runs and s.config.policy == "none" and not s.config.backups:
            by_scenario.setdefault(s.scenario, []).append(s)
    return by_scenario


def _find(group: Sequence[ConfigSummary], mode: str, h: int | None,
          outer: str | None = None) -> ConfigSummary | None:
    for s in group:
        c = s.config
        if c.mode == mode and c.sync_every == h and (outer is None or c.outer == outer) \
                and c.lr_scaling in (None, "none") and c.momentum_target is None:
            return s
    return None


def _claim_diloco(summaries: Sequence[ConfigSummary]) -> ClaimCheck:
    from paramserver.workers.experiments.report import ClaimCheck

    claim = (f"DiLoCo (sync local SGD, H = {DILOCO_H}) ends within "
             f"{DILOCO_LOSS_TOLERANCE:.0%} of sync SGD's final held-out loss at equal gradients "
             f"computed, with at least {DILOCO_BYTES_FACTOR:g}x fewer bytes per worker "
             f"(Douillard et al. 2023)")
    checked, bad = [], []
    for scenario, group in sorted(_usable(summaries).items()):
        sync, diloco = _find(group, "sync", None), _find(group, "sync", DILOCO_H)
        if sync is None or diloco is None:
            continue
        ls, ld = _median(sync, "final_loss"), _median(diloco, "final_loss")
        bs, bd = _median(sync, "bytes_per_worker"), _median(diloco, "bytes_per_worker")
        gs, gd = _median(sync, "gradients"), _median(diloco, "gradients")
        factor = bs / bd if bd > 0 else math.inf
        checked.append(f"{scenario}: loss {ld:.3f} vs {ls:.3f}, {factor:.0f}x fewer bytes "
                       f"({bd / 1e6:.3g} vs {bs / 1e6:.3g} MB), gradients {gd:.0f} vs {gs:.0f}")
        if gs != gd:
            bad.append(f"{scenario}: unequal gradients computed ({gd:.0f} vs {gs:.0f})")
        if not ld <= (1 + DILOCO_LOSS_TOLERANCE) * ls:
            bad.append(f"{scenario}: {diloco.label} ended at {ld:.3f}, over "
                       f"{1 + DILOCO_LOSS_TOLERANCE:.0%} of sync's {ls:.3f}")
        if not factor >= DILOCO_BYTES_FACTOR:
            bad.append(f"{scenario}: only {factor:.1f}x fewer bytes per worker")
    if not checked:
        return ClaimCheck(claim, "skipped", f"needs sync and sync:h={DILOCO_H}")
    return ClaimCheck(claim, "fail" if bad else "pass", "; ".join(bad or checked))


def _async_pairs(summaries: Sequence[ConfigSummary]
                 ) -> list[tuple[str, ConfigSummary, ConfigSummary, ConfigSummary | None]]:
    """(scenario, sync local, naive async local, delayed-Nesterov async local) at one H."""
    out = []
    for scenario, group in sorted(_usable(summaries).items()):
        for naive in group:
            c = naive.config
            if c.mode != "async" or c.sync_every is None or c.outer == "delayed-nesterov":
                continue
            sync = _find(group, "sync", c.sync_every)
            if sync is not None:
                out.append((scenario, sync, naive,
                            _find(group, "async", c.sync_every, "delayed-nesterov")))
    return out


def _claim_naive_async(summaries: Sequence[ConfigSummary]) -> ClaimCheck:
    from paramserver.workers.experiments.report import ClaimCheck

    claim = ("naive asynchronous local SGD (the outer Nesterov step on every pseudo-gradient) "
             "makes less progress per local update than sync local SGD at the same H: a "
             "higher final held-out loss at equal gradients computed (Liu et al. 2024)")
    checked, bad = [], []
    for scenario, sync, naive, _ in _async_pairs(summaries):
        ls, ln = _median(sync, "final_loss"), _median(naive, "final_loss")
        checked.append(f"{scenario}: {naive.label} {ln:.3f} vs {sync.label} {ls:.3f}")
        if not ln > ls:
            bad.append(f"{scenario}: {naive.label} ended at {ln:.3f}, not above "
                       f"{sync.label}'s {ls:.3f}")
    if not checked:
        return ClaimCheck(claim, "skipped", "needs async:h=H and sync:h=H")
    return ClaimCheck(claim, "fail" if bad else "pass", "; ".join(bad or checked))


def _claim_delayed_nesterov(summaries: Sequence[ConfigSummary]) -> ClaimCheck:
    from paramserver.workers.experiments.report import ClaimCheck

    claim = (f"delayed Nesterov closes most (at least {GAP_CLOSED:.0%}) of the gap in final "
             f"held-out log loss between naive async local SGD and sync local SGD (Liu et al. "
             f"2024)")
    checked, bad = [], []
    for scenario, sync, naive, delayed in _async_pairs(summaries):
        if delayed is None:
            continue
        ls, ln, ld = (_median(s, "final_loss") for s in (sync, naive, delayed))
        gap = math.log(ln / ls) if ln > 0 and ls > 0 else math.nan
        closed = math.log(ln / ld) / gap if gap > 0 and ld > 0 else math.nan
        checked.append(f"{scenario}: {delayed.label} {ld:.3f}, naive {ln:.3f}, sync {ls:.3f}"
                       + (f": {closed:.0%} of the gap closed" if math.isfinite(closed) else ""))
        if not gap > 0 or not math.isfinite(closed):
            bad.append(f"{scenario}: no gap to close (naive {ln:.3f}, sync {ls:.3f})")
        elif not closed >= GAP_CLOSED:
            bad.append(f"{scenario}: {delayed.label} closed {closed:.0%} of the gap "
                       f"({ld:.3f}; naive {ln:.3f}, sync {ls:.3f})")
    if not checked:
        return ClaimCheck(claim, "skipped", "needs async:h=H, "
                          "async:h=H,outer=delayed-nesterov and sync:h=H")
    return ClaimCheck(claim, "fail" if bad else "pass", "; ".join(bad or checked))


def check_local_sgd(summaries: Sequence[ConfigSummary]) -> list[ClaimCheck]:
    """The local-SGD claims (none for an experiment without local SGD); each is "skipped"
    without the configurations it needs."""
    if not any(s.config.sync_every is not None for s in summaries):
        return []
    return [_claim_diloco(summaries), _claim_naive_async(summaries),
            _claim_delayed_nesterov(summaries)]
