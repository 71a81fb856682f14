"""``paramserver experiment --paired``: policy differences on the same schedules.

Two async runs with different staleness policies also differ in their interleaving,
so the difference of their final losses mixes the policy's effect with the schedule's
luck (and each seed's data order). With ``--paired`` every run is traced; for each
seed, the first ``--policy``'s run (the baseline) is replayed on the real core with
each other policy (paramserver/workers/launch/replay.py): the same arrivals, the same
batches, another policy. The paired difference per seed is
``loss(replay with P) - loss(baseline)``; its 95 % confidence interval over seeds is
set beside the *unpaired* one (the real runs of P against the real runs of the
baseline, Welch's interval), and the report says how much narrower the paired one is;
a third interval pairs the own runs by seed only (same data, their own schedules).

Writes ``paired.md``, ``paired.json`` and ``images/paired.png`` into the experiment
directory.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paramserver.errors import ConfigError
from paramserver.workers.experiments.spec import Configuration, ExperimentSpec

__all__ = ["PairedRow", "interval", "paired_report", "t95", "welch"]

# two-sided 95 % quantiles of Student's t, by degrees of freedom (1..30); beyond: normal
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(df: float) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom (rounded
    down: the wider interval)."""
    if df < 1:
        return math.inf
    k = math.floor(df)
    return _T95[k - 1] if k <= len(_T95) else 1.960


def interval(diffs: Sequence[float]) -> tuple[float, float]:
    """Mean of paired differences and its 95 % half-width."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return mean, math.inf
    return mean, t95(n - 1) * statistics.stdev(diffs) / math.sqrt(n)


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """mean(a) - mean(b) and its 95 % half-width (Welch: unequal variances)."""
    mean = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return mean, math.inf
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return mean, 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return mean, t95(df) * se


@dataclass
class PairedRow:
    """One policy against the baseline, in one configuration, over the seeds."""

    config: str  # the baseline configuration's label
    policy: str
    baseline: str
    seeds: list[int]
    paired: list[float]  # per seed: loss(replay with policy) - loss(baseline run)
    real: list[float]  # per seed: the policy's own real run's loss
    base: list[float]  # per seed: the baseline run's loss
    reproduced: list[bool]  # per seed: the baseline's replay was bit for bit its run
    paired_mean: float = 0.0
    paired_half: float = 0.0
    unpaired_mean: float = 0.0
    unpaired_half: float = 0.0
    #: the own runs paired by seed only (same data, another schedule): what sharing the
    #: schedule adds beyond sharing the seed
    seed_mean: float = 0.0
    seed_half: float = 0.0

    @property
    def ratio(self) -> float:
        """How many times narrower the paired interval is than the unpaired one."""
        if not (math.isfinite(self.paired_half) and math.isfinite(self.unpaired_half)):
            return math.nan  # one seed: no interval
        if self.paired_half == 0:
            return math.inf
        return self.unpaired_half / self.paired_half


def _loss(run_dir: Path) -> float:
    try:
        data = json.loads((run_dir / "result.json").read_text())
        return float(data["eval"]["loss"])
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{run_dir}: no final held-out loss in result.json ({exc}); "
                          f"--paired needs a task with held-out data and --eval") from exc


def _sibling(spec: ExperimentSpec, config: Configuration, policy: Any) -> Configuration:
    for c in spec.configurations():
        if (c.scenario, c.mode, c.workers, c.replicas, c.compression, c.policy) == (
                config.scenario, config.mode, config.workers, config.replicas,
                config.compression, policy):
            return c
    raise AssertionError("every policy has every configuration")  # (the grid's product)


def paired_rows(spec: ExperimentSpec, out: Path,
                progress: Callable[[str], None] | None = None) -> list[PairedRow]:
    """Replay each seed's baseline run with every other policy; the rows of the report.
    ``progress`` is told of each replay done (a replay of a long run takes seconds)."""
    say = progress or (lambda _: None)
    from paramserver.workers.launch.replay import Changes, compare, final_weights, replay_dir

    if len(spec.policies) < 2:
        raise ConfigError("--paired compares policies: give at least two --policy (the "
                          "first is the baseline every other is replayed against)")
    base_policy = spec.policies[0]
    rows: list[PairedRow] = []
    for config in spec.configurations():
        if config.policy != base_policy:
            continue
        own: dict[int, tuple[float, bool]] = {}  # seed -> the baseline's replay: loss, equal
        for seed in spec.seeds:
            base_dir = out / "runs" / config.id / f"seed{seed}"
            # (trusted: the traces this experiment wrote a moment ago, from its own spec)
            mine = replay_dir(base_dir, trust_plugins=True)  # its run, bit for bit?
            own[seed] = (mine.eval["loss"], compare(mine.weights, final_weights(base_dir))[0])
            say(f"replayed {config.id}/seed{seed} as recorded")
        for policy in spec.policies[1:]:
            other = _sibling(spec, config, policy)
            row = PairedRow(config.label, policy.label, base_policy.label, [], [], [], [], [])
            for seed in spec.seeds:
                base_dir = out / "runs" / config.id / f"seed{seed}"
                base_loss = _loss(base_dir)
                own_loss, equal = own[seed]
                counter = replay_dir(base_dir, Changes(policy=policy.name,
                                                       policy_args=dict(policy.args)),
                                     trust_plugins=True)
                row.seeds.append(seed)
                row.base.append(base_loss)
                row.real.append(_loss(out / "runs" / other.id / f"seed{seed}"))
                row.paired.append(counter.eval["loss"] - own_loss)
                row.reproduced.append(equal)
                say(f"replayed {config.id}/seed{seed} with {policy.label}")
            row.paired_mean, row.paired_half = interval(row.paired)
            row.unpaired_mean, row.unpaired_half = welch(row.real, row.base)
            row.seed_mean, row.seed_half = interval(
                [r - b for r, b in zip(row.real, row.base, strict=True)])
            rows.append(row)
    return rows


def _plot(rows: Sequence[PairedRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.8 * len(rows)))
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        ax.errorbar(row.unpaired_mean, y + 0.2, xerr=row.unpaired_half, fmt="o",
                    color="tab:gray", capsize=4, label="unpaired (own runs)" if i == 0 else None)
        ax.errorbar(row.seed_mean, y, xerr=row.seed_half, fmt="^", color="tab:orange",
                    capsize=4, label="own runs paired by seed" if i == 0 else None)
        ax.errorbar(row.paired_mean, y - 0.2, xerr=row.paired_half, fmt="s",
                    color="tab:blue", capsize=4,
                    label="paired (replayed on the same schedules)" if i == 0 else None)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r.policy} - {r.baseline}\n{r.config}" for r in reversed(rows)],
                       fontsize=8)
    ax.set_xlabel("difference in final held-out loss (95 % CI over seeds)")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def paired_report(spec: ExperimentSpec, out: Path,
                  progress: Callable[[str], None] | None = None) -> list[PairedRow]:
    """Write paired.md, paired.json and images/paired.png; returns the rows."""
    rows = paired_rows(spec, out, progress)
    _plot(rows, out / "images" / "paired.png")
    (out / "paired.json").write_text(json.dumps([{**asdict(r), "ratio": r.ratio}
                                                 for r in rows], indent=2))
    lines = ["# Paired policy comparison", "",
             f"Baseline: `{spec.policies[0].label}`. Paired: each seed's baseline run replayed "
             "with the other policy on the same arrivals and batches (`paramserver simulate "
             "--replay`); unpaired: the policy's own runs against the baseline's (Welch). "
             "Differences of final held-out loss, 95 % confidence intervals over "
             f"{len(spec.seeds)} seeds.", "",
             "| configuration | policy | paired difference | unpaired difference | "
             "narrower | own runs paired by seed | baseline replay bit for bit |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.config} | {r.policy} | {r.paired_mean:+.4f} ± {r.paired_half:.4f} "
                     f"| {r.unpaired_mean:+.4f} ± {r.unpaired_half:.4f} | {r.ratio:.1f}x | "
                     f"{r.seed_mean:+.4f} ± {r.seed_half:.4f} | "
                     f"{sum(r.reproduced)}/{len(r.reproduced)} |")
    lines += ["", "![paired and unpaired intervals](images/paired.png)", ""]
    (out / "paired.md").write_text("\n".join(lines))
    return rows
