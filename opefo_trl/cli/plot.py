"""``opefo-plot``: training curves (entropy, reward, lambda*, entropy flows) of one or more runs as a PNG.

Usage:
    opefo-plot runs/grpo runs/opefo --output curves.png
    opefo-plot runs/opefo/checkpoint-500 other/trainer_state.json --output cmp.png --smoothing 0.6

Each RUN is a run's output_dir (its trainer_state.json, else the metrics.jsonl opefo-train writes, else its latest
checkpoint-*), a checkpoint folder or the file itself. Runs are labelled by folder name; ``--group`` draws seeds of
one setting (``opefo-seed0``, ``opefo-seed1``) as their mean +- std.
"""

from __future__ import annotations

import argparse
import re
import sys

from opefo_trl.plotting import RunNotFoundError, load_runs, plot_runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opefo-plot",
        description="Plot token entropy, reward, OPEFO's lambda* and the entropy flows from trainer_state.json or "
        "metrics.jsonl files.",
        allow_abbrev=False,  # as opefo-train and opefo-eval: `--smooth` is an error, not `--smoothing`
    )
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="run dir, checkpoint dir, trainer_state.json or metrics.jsonl"
    )
    parser.add_argument("--output", "-o", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument(
        "--smoothing", type=float, default=0.0, help="exponential moving-average weight in [0, 1) (default 0: raw)"
    )
    parser.add_argument(
        "--group",
        action="store_true",
        help="draw runs whose labels differ only by a trailing seed suffix (opefo-seed0, opefo-seed1, or opefo_0, "
        "opefo_1) as one mean +- std line",
    )
    return parser


_SEED_SUFFIX = re.compile(r"[-_.]?seed[-_]?\d+$")
_BARE_NUMBER_SUFFIX = re.compile(r"[-_]\d+$")
_ENDS_IN_A_VALUE = re.compile(r"(\d|\d[eE]|\.)$")


def seed_group(label: str) -> str:
    """The label without a trailing seed suffix: ``opefo-seed1`` and ``opefo_2`` -> ``opefo``; others unchanged.

    A bare trailing number counts as a seed only after a name: in ``lr-1e-6`` or ``beta_0.1`` it is part of a
    setting, and runs that differ in a setting are never averaged together.
    """
    stripped = _SEED_SUFFIX.sub("", label)
    if stripped != label:
        return stripped or label
    bare = _BARE_NUMBER_SUFFIX.sub("", label)
    if bare and bare != label and not _ENDS_IN_A_VALUE.search(bare):
        return bare
    return label


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs = load_runs(args.runs)
        groups = {run.label: seed_group(run.label) for run in runs} if args.group else None
        result = plot_runs(runs, args.output, groups=groups, smoothing=args.smoothing, title=args.title)
    except (RunNotFoundError, ValueError) as err:
        print(f"opefo-plot: error: {err}", file=sys.stderr)
        return 2
    for run in runs:
        print(f"{run.label}: {run.state_path}")
    if result.missing:
        print(f"note: not logged by any run, left out: {', '.join(result.missing)}")
    print(f"wrote {result.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
