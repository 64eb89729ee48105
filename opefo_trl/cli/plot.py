"""``opefo-plot``: training curves (entropy, reward, lambda*, entropy flows) of one or more runs as a PNG.

Usage:
    opefo-plot runs/grpo runs/opefo --output curves.png
    opefo-plot runs/opefo/checkpoint-500 other/trainer_state.json --output cmp.png --smoothing 0.6

Each RUN is a run's output_dir (its trainer_state.json, else the metrics.jsonl opefo-train writes, else its latest
checkpoint-*), a checkpoint folder or the file itself. Runs are labelled by folder name; ``--group`` draws seeds of
one setting (``opefo-seed0``, ``opefo-seed1``) as their mean +- std.

Options are parsed as ``opefo-train`` and ``opefo-eval`` parse theirs (``opefo_trl.cli.options``): every field of
:class:`PlotOptions` is a flag, ``--config plot.yaml`` reads them from a YAML file, an unknown or misspelt option is an
error naming the closest ones, and the runs may also be given with ``--runs``. Bad input is reported as
``opefo-plot: error: ...`` with exit status 2.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from opefo_trl._extras import require_extra
from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error

PROG = "opefo-plot"


@dataclass
class PlotOptions:
    """Options of ``opefo-plot`` (the runs also as arguments without a flag: ``opefo-plot RUN... --output x.png``).

    Example:
        >>> PlotOptions(runs=["runs/grpo"], output="curves.png").smoothing
        0.0
    """

    runs: list[str] = field(
        metadata={"help": "Runs to draw: run dirs, checkpoint dirs, trainer_state.json or metrics.jsonl files."}
    )
    output: str = field(metadata={"aliases": ["-o"], "help": "PNG file to write."})
    title: str | None = field(default=None, metadata={"help": "Figure title."})
    smoothing: float = field(
        default=0.0, metadata={"help": "Exponential moving-average weight in [0, 1); 0 draws the raw values."}
    )
    group: bool = field(
        default=False,
        metadata={
            "help": "Draw runs whose labels differ only by a trailing seed suffix (opefo-seed0, opefo-seed1, or "
            "opefo_0, opefo_1) as one mean +- std line."
        },
    )


def make_parser():
    """The parser over `PlotOptions`: see `opefo_trl.cli.options`."""
    return build_parser(
        [PlotOptions],
        prog=PROG,
        description="Plot token entropy, reward, OPEFO's lambda* and the entropy flows from trainer_state.json or "
        "metrics.jsonl files. The runs can be given first, without --runs: opefo-plot RUN... --output curves.png.",
    )


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


def check_output(output: str) -> None:
    """Refuse, before any run is read, a figure path that is a folder or lies where this user cannot write."""
    from opefo_trl.runs.files import unwritable_reason

    if os.path.isdir(output):
        raise ValueError(f"--output {output!r} is a folder; give the PNG file to write, e.g. {output}/curves.png.")
    reason = unwritable_reason(os.path.dirname(os.path.abspath(output)))
    if reason:
        raise ValueError(f"Cannot write the figure {output!r} ({reason}); give an --output this user can write.")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse options, draw the runs, print what was drawn; return the exit status (2 for bad input)."""
    from opefo_trl.plotting import MIN_STEPS, load_runs, plot_runs

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # as opefo-eval's

    try:
        (options,) = parse_options(make_parser(), argv, positional="runs")
        require_extra("plot", "matplotlib", PROG)
        check_output(options.output)
        runs = load_runs(options.runs)
        groups = {run.label: seed_group(run.label) for run in runs} if options.group else None
        result = plot_runs(runs, options.output, groups=groups, smoothing=options.smoothing, title=options.title)
    except INPUT_ERRORS as err:  # RunNotFoundError is a FileNotFoundError
        return report_error(PROG, err)
    for run in runs:
        print(f"{run.label}: {run.state_path}")
    if result.missing:
        print(f"note: not logged by any run, left out: {', '.join(result.missing)}")
    if result.too_short:
        print(
            f"note: too few logged steps for a curve, drawn as points: {', '.join(result.too_short)}; a curve needs "
            f"{MIN_STEPS} (train more steps, or log more often: logging_steps)"
        )
    print(f"wrote {result.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
