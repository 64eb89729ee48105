"""How many seeds the report's comparison rule needs to decide a comparison, from the spreads of a finished demo.

The report calls method X above (below) GRPO on a figure when the difference of the means exceeds
``STANDARD_ERRORS`` standard errors, sqrt(s_x^2 / n + s_GRPO^2 / n) with n seeds each. If the true difference is d and
the seeds' standard deviations are s_x and s_GRPO, that happens with probability ``power`` (normal approximation)
once

    n >= (STANDARD_ERRORS + z_power)^2 (s_x^2 + s_GRPO^2) / d^2,    z_power = Phi^-1(power).

Taking d as the difference a demo observed overstates it for the comparisons picked because they looked large (and
n, planned from it, is then too small): read the figures as the seeds needed if the observed difference were true.
The report itself (``opefo_trl.demo.report``) states no direction for a comparison run on fewer seeds than this.

``python -m opefo_trl.demo.power runs/demo-full/summary.json`` prints, per numerics setting and method, the
figure's means and spreads and the seeds needed (``--figure pass@1``, ``--power 0.9`` for others).

Example (the pass@64 spreads of 5 seeds: OPEFO 0.800 +- 0.075 against GRPO 0.633 +- 0.139):
    >>> seeds_needed(0.800 - 0.633, 0.075, 0.139)
    8
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from opefo_trl.demo.report import BASELINE, DEFAULT_POWER, seeds_needed


def power_table(summary: dict, figure: str = "pass@64", power: float = DEFAULT_POWER) -> list[dict]:
    """One row per (numerics setting, method other than GRPO) of a demo's ``summary.json``: the figure's mean and
    standard deviation over the non-failed runs of the method and of GRPO, and the seeds needed."""
    rows = []
    for numerics, by_method in summary["summary"].items():
        if BASELINE not in by_method:
            continue
        base = by_method[BASELINE]["non_failed"].get(figure)
        for method, s in by_method.items():
            mine = s["non_failed"].get(figure)
            if method == BASELINE or not mine or not base or mine["std"] is None or base["std"] is None:
                continue
            difference = mine["mean"] - base["mean"]
            rows.append(
                {
                    "numerics": numerics,
                    "method": method,
                    "mean": mine["mean"],
                    "std": mine["std"],
                    "grpo_mean": base["mean"],
                    "grpo_std": base["std"],
                    "runs": mine["n"],
                    "seeds_needed": seeds_needed(difference, mine["std"], base["std"], power),
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opefo_trl.demo.power", description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", help="A demo's summary.json.")
    parser.add_argument("--figure", default="pass@64", help="The compared figure (default pass@64).")
    parser.add_argument("--power", type=float, default=DEFAULT_POWER, help="Probability of deciding (default 0.8).")
    args = parser.parse_args(argv)
    if not 0 < args.power < 1:
        parser.error(f"--power must lie in (0, 1), got {args.power}.")
    with open(args.summary) as f:
        rows = power_table(json.load(f), args.figure, args.power)
    if not rows:
        parser.error(f"{args.summary} has no {args.figure} of GRPO and another method over two runs or more.")
    print(f"| numerics | method | {args.figure} (runs) | GRPO | seeds needed (power {args.power:g}) |")
    print("|---|---|---|---|---|")
    for r in rows:
        needed = "never (no difference)" if r["seeds_needed"] is None else str(r["seeds_needed"])
        print(
            f"| {r['numerics']} | {r['method']} | {r['mean']:.3f} ± {r['std']:.3f} ({r['runs']}) | "
            f"{r['grpo_mean']:.3f} ± {r['grpo_std']:.3f} | {needed} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
