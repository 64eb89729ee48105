"""Training curves from ``trainer_state.json`` or ``metrics.jsonl`` files: token entropy, reward, lambda* and the
entropy flows.

Works on anything a ``transformers.Trainer`` wrote with ``save_state()`` or a checkpoint (the demo's runs, and real
GPU runs of ``OPEFOTrainer`` / ``GRPOTrainer``), and on the ``metrics.jsonl`` that ``opefo-train`` writes (every
logged step, also with ``save_strategy: "no"``). Only ``state.log_history`` (or the metrics lines) is read; rows
without a ``step`` or without a metric are skipped, so the final ``train_runtime`` row and evaluation rows do no harm.

A run is given as a run directory (``output_dir``: its ``trainer_state.json``, else its ``metrics.jsonl`` (or
``metrics.rank0.jsonl``), else its latest ``checkpoint-*``), a checkpoint directory, or the path of a
``trainer_state.json`` or ``metrics*.jsonl``. Runs are labelled by folder name (a checkpoint folder by its run's
folder); repeated labels are made unique with their parent folder.

Example:
    >>> from opefo_trl.plotting import load_runs, plot_runs
    >>> runs = load_runs(["runs/grpo", "runs/opefo"])  # doctest: +SKIP
    >>> result = plot_runs(runs, "curves.png")  # doctest: +SKIP
    >>> result.missing  # metrics no run logged, left out of the figure  # doctest: +SKIP
    []
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from opefo_trl._extras import needs_extra
from opefo_trl.runs import (
    CHECKPOINT_RE,
    METRICS_FILE,
    METRICS_FILE_PER_RANK,
    TRAINER_STATE_NAME,
    checkpoints,
    read_metrics_lines,
)

logger = logging.getLogger(__name__)

STATE_FILE = TRAINER_STATE_NAME
#: What `opefo-train` writes (`metrics_jsonl`): the main process's file, else rank 0's.
METRICS_FILES = (METRICS_FILE, METRICS_FILE_PER_RANK.format(rank=0))


@dataclass(frozen=True)
class Panel:
    """One subplot: a title, a y-axis label and the ``log_history`` keys drawn in it (one line style per key)."""

    title: str
    ylabel: str
    metrics: tuple[str, ...]
    #: Drawn only when some run logged it, and not reported missing otherwise (metrics most runs need not log).
    optional: bool = False
    #: matplotlib y scale; "log" for the flows, which shrink by orders of magnitude as the entropy collapses.
    yscale: str = "linear"
    #: Divide each run's lines by the sum of the panel's metrics at the run's first step that logged them all: the
    #: `param` flow (parameter-space units, ~1e3-1e4 on the demo) and the tabular ones (per logit, ~1e-1) on one
    #: axis, each starting from its own size.
    relative_to_first_step: bool = False


DEFAULT_PANELS: tuple[Panel, ...] = (
    Panel("Mean token entropy", "entropy (nats)", ("entropy",)),
    Panel("Reward", "mean reward", ("reward",)),
    Panel("OPEFO balance coefficient", "lambda*", ("entropy_flow/lambda",)),
    Panel(
        "Entropy flow, over the first step's P + N\n(solid: increase P, dashed: decrease N)",
        "flow / first step's P + N",
        ("entropy_flow/increase", "entropy_flow/decrease"),
        yscale="log",
        relative_to_first_step=True,
    ),
    Panel(
        "Entropy change per update (solid: measured, dashed: predicted)",
        "change of mean token entropy",
        ("entropy_flow/measured_delta", "entropy_flow/predicted_delta"),
        optional=True,
    ),
)
_LINESTYLES = ("-", "--", ":", "-.")
#: The title's distance from the figure's top edge, in inches.
_TITLE_MARGIN_IN = 0.1


class RunNotFoundError(FileNotFoundError):
    """A path given as a run has no ``trainer_state.json`` nor ``metrics.jsonl`` (nor a checkpoint holding one)."""


@dataclass
class RunHistory:
    """The ``log_history`` of one run, with its label and the file it came from."""

    label: str
    state_path: str
    log_history: list[dict]

    def keys(self) -> set[str]:
        """Every metric name that appears in a logged training step."""
        return {k for row in self.log_history if "step" in row for k in row}

    def series(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of ``metric`` over the logged steps that have a finite value, in step order.

        A step logged twice (e.g. a train row and an eval row) keeps its last value.
        """
        by_step: dict[int, float] = {}
        for row in self.log_history:
            value = row.get(metric)
            if "step" not in row or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if math.isfinite(value):
                by_step[int(row["step"])] = float(value)
        steps = np.array(sorted(by_step), dtype=np.int64)
        return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def find_state_file(path: str | os.PathLike) -> str:
    """The ``trainer_state.json`` or ``metrics.jsonl`` a run path refers to (see the module docstring), or
    ``RunNotFoundError``."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise RunNotFoundError(
            f"{path!r} does not exist; give a run directory, a checkpoint directory, a {STATE_FILE} or a "
            f"{METRICS_FILES[0]}."
        )
    for name in (STATE_FILE, *METRICS_FILES):  # metrics.jsonl before a checkpoint: it has every logged step
        direct = os.path.join(path, name)
        if os.path.isfile(direct):
            return direct
    saved = [folder for _, folder in checkpoints(path) if os.path.isfile(os.path.join(folder, STATE_FILE))]
    if saved:
        return os.path.join(saved[-1], STATE_FILE)
    raise RunNotFoundError(
        f"No {STATE_FILE} nor {METRICS_FILES[0]} in {path!r}, nor a checkpoint-* folder under it. Point at a run's "
        "output_dir after `trainer.save_state()` (or with save_strategy != 'no') or from opefo-train, a checkpoint "
        "folder, or the file itself."
    )


def _default_label(state_path: str) -> str:
    folder = os.path.dirname(os.path.abspath(state_path))
    name = os.path.basename(folder)
    if CHECKPOINT_RE.match(name):
        name = os.path.basename(os.path.dirname(folder))
    return name


def _read_metrics_lines(metrics_path: str) -> list[dict]:
    """The logged rows of a ``metrics.jsonl`` (opefo-train's reader); a last line cut short by a kill is left out,
    with a warning: the figure then ends a step early."""
    lines, cut_off = read_metrics_lines(metrics_path)
    if cut_off:
        logger.warning(
            "%s: its last line is cut off (a write was interrupted); the step it logged is left out of the figure.",
            metrics_path,
        )
    return [json.loads(line) for line in lines]


def load_run(path: str | os.PathLike, label: str | None = None) -> RunHistory:
    """Read one run's ``log_history`` (see the module docstring for accepted paths)."""
    state_path = find_state_file(path)
    if state_path.endswith(".jsonl"):
        return RunHistory(label or _default_label(state_path), state_path, _read_metrics_lines(state_path))
    try:
        with open(state_path) as f:
            state = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{state_path!r} is not valid JSON ({err}); is the file complete?") from err
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(f"{state_path!r} has no `log_history` list; it does not look like a Trainer state file.")
    return RunHistory(label=label or _default_label(state_path), state_path=state_path, log_history=history)


def load_runs(paths: Sequence[str | os.PathLike]) -> list[RunHistory]:
    """``load_run`` for each path; labels that repeat are prefixed with their parent folder."""
    if not paths:
        raise ValueError("No runs given: pass at least one run directory, checkpoint directory or trainer_state.json.")
    runs = [load_run(p) for p in paths]
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            folder = os.path.dirname(os.path.abspath(run.state_path))
            if CHECKPOINT_RE.match(os.path.basename(folder)):
                folder = os.path.dirname(folder)
            run.label = f"{os.path.basename(os.path.dirname(folder))}/{run.label}"
    return runs


@dataclass
class PlotResult:
    """What ``plot_runs`` drew: the PNG path, the metrics plotted (``"pass@k"`` for that panel), those no run had
    (left out), and the runs with too few logged steps for a curve (drawn as points, each with its count)."""

    path: str
    plotted: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    too_short: list[str] = field(default_factory=list)


#: The fewest logged steps that draw a curve (one step is a lone point, which a line leaves invisible).
MIN_STEPS = 2


def too_few_steps(run: RunHistory, metrics: Sequence[str]) -> str | None:
    """``"'label' (N logged steps)"`` if ``run`` logged ``metrics`` at fewer than :data:`MIN_STEPS` steps, else None."""
    steps = sorted(set().union(*(run.series(m)[0].tolist() for m in metrics)))
    if len(steps) >= MIN_STEPS:
        return None
    where = f": step {steps[0]}" if steps else ""
    return f"{run.label!r} ({len(steps)} logged step{'' if len(steps) == 1 else 's'}{where})"


def _smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """Exponential moving average (TensorBoard-style, debiased); ``weight=0`` returns the values unchanged."""
    if weight <= 0 or len(values) == 0:
        return values
    out = np.empty_like(values)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[i] = acc / norm
    return out


def first_step_total(run: RunHistory, metrics: Sequence[str]) -> float | None:
    """The sum of ``metrics`` at the first step where ``run`` logged all of them; None if none or not positive."""
    series = [dict(zip(*run.series(m), strict=True)) for m in metrics]
    common = sorted(set.intersection(*(set(s) for s in series)))
    total = sum(s[common[0]] for s in series) if common else 0.0
    return total if total > 0 else None


def _group_series(runs: Sequence[RunHistory], metric: str, smoothing: float, relative_to: Sequence[str] | None = None):
    """Mean and std over runs at the steps every run that logged ``metric`` has; None if no run has it. With
    ``relative_to``, each run's values are divided by its :func:`first_step_total` of those metrics first."""
    series = []
    for run in runs:
        steps, values = run.series(metric)
        scale = first_step_total(run, relative_to) if relative_to else 1.0
        if len(steps) and scale is not None:
            series.append((steps, _smooth(values / scale, smoothing)))
    if not series:
        return None
    common = series[0][0]
    for steps, _ in series[1:]:
        common = np.intersect1d(common, steps)
    if len(common) == 0:
        return None
    stacked = np.stack([v[np.searchsorted(s, common)] for s, v in series])
    return common, stacked.mean(axis=0), stacked.std(axis=0), len(series)


def plot_runs(
    runs: Sequence[RunHistory],
    output_path: str | os.PathLike,
    panels: Sequence[Panel] = DEFAULT_PANELS,
    groups: Mapping[str, str] | None = None,
    smoothing: float = 0.0,
    title: str | None = None,
    pass_at_k: Mapping[str, Sequence[Mapping[int, float]]] | None = None,
) -> PlotResult:
    """Draw one panel per entry of ``panels`` with a line per run (or per group), save a PNG and return what was drawn.

    Args:
        runs: loaded runs (``load_runs``).
        output_path: the PNG to write (parent folders are created).
        panels: which metrics to draw; a panel whose metrics no run logged is left out, and the missing metrics are
            listed in ``PlotResult.missing`` and in a note at the bottom of the figure.
        groups: optional ``{run label: group name}``; runs of one group (e.g. seeds of a method) are drawn as their
            mean with a +-1 std band, at the steps all of them logged. Runs not in the mapping form their own group.
        smoothing: exponential moving-average weight in [0, 1) applied to each run before grouping (0 = raw values).
        title: figure title.
        pass_at_k: optional ``{group name: [{k: pass@k} of each run]}``, drawn as one more panel: pass@k against k
            (log scale), the mean over a group's runs with a +-1 std band, in the group's colour; a name that is not a
            group of ``runs`` (e.g. the policy before training) is drawn in black, dashed.
    """
    # A bare Figure (no pyplot): works headless and leaves a notebook's or script's own backend alone.
    with needs_extra("plot", "matplotlib", "Plotting (opefo_trl.plotting, opefo-plot)"):
        from matplotlib import rcParams
        from matplotlib.figure import Figure

    if not runs:
        raise ValueError("plot_runs needs at least one run.")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}.")
    available = set().union(*(run.keys() for run in runs))
    wanted = [m for panel in panels for m in panel.metrics]
    required = [m for panel in panels if not panel.optional for m in panel.metrics]
    missing = [m for m in dict.fromkeys(required) if m not in available]
    shown = [p for p in panels if any(m in available for m in p.metrics)]
    if not shown:
        raise ValueError(
            f"None of the metrics {wanted} appear in the runs' log_history (found: {sorted(available)[:20]}). "
            "Were the runs logged with logging_steps and an OPEFO/GRPO trainer?"
        )
    too_short = [note for run in runs if (note := too_few_steps(run, wanted)) is not None]
    groups = dict(groups or {})
    grouped: dict[str, list[RunHistory]] = {}
    for run in runs:
        grouped.setdefault(groups.get(run.label, run.label), []).append(run)

    pass_at_k = {name: list(curves) for name, curves in (pass_at_k or {}).items() if curves}
    for name, curves in pass_at_k.items():
        if any(set(c) != set(curves[0]) for c in curves) or not all(k >= 1 for k in curves[0]):
            raise ValueError(f"pass_at_k[{name!r}]: every run needs the same k values, each >= 1; got {curves}.")
    panels_drawn = len(shown) + bool(pass_at_k)
    ncols = 2 if panels_drawn > 1 else 1
    nrows = math.ceil(panels_drawn / ncols)
    fig = Figure(figsize=(6.0 * ncols, 3.6 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    plotted: list[str] = []
    for ax, panel in zip(axes.flat, shown, strict=False):  # the grid may have one axis more than panels
        for g, (name, members) in enumerate(grouped.items()):
            color = colors[g % len(colors)]
            for k, metric in enumerate(panel.metrics):
                relative_to = panel.metrics if panel.relative_to_first_step else None
                stats = _group_series(members, metric, smoothing, relative_to)
                if stats is None:
                    continue
                steps, mean, std, n = stats
                label = name if k == 0 else None
                if label is not None and n > 1:
                    label = f"{name} (n={n})"
                linestyle = _LINESTYLES[k % len(_LINESTYLES)]
                marker = "o" if len(steps) < MIN_STEPS else None  # a lone point: no line to see
                ax.plot(steps, mean, color=color, linestyle=linestyle, marker=marker, label=label, lw=1.5)
                if n > 1:
                    lower = mean - std
                    if panel.yscale == "log":  # a band reaching 0 or below has no log-scale picture: leave a gap
                        lower = np.where(lower > 0, lower, np.nan)
                    ax.fill_between(steps, lower, mean + std, color=color, alpha=0.15, lw=0)
                if metric not in plotted:
                    plotted.append(metric)
        if "entropy_flow/lambda" in panel.metrics or panel.optional:
            ax.axhline(0.0, color="0.5", lw=0.8, zorder=0)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.set_yscale(panel.yscale)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if pass_at_k:
        order = list(grouped)
        ax = list(axes.flat)[len(shown)]
        for name, curves in pass_at_k.items():
            ks = sorted(curves[0])
            values = np.array([[c[k] for k in ks] for c in curves], dtype=np.float64)
            mean, std = values.mean(axis=0), values.std(axis=0)
            inside = name in order
            color = colors[order.index(name) % len(colors)] if inside else "black"
            label = f"{name} (n={len(curves)})" if len(curves) > 1 else name
            ax.plot(ks, mean, color=color, linestyle="-" if inside else "--", marker="o", ms=3, lw=1.5, label=label)
            if len(curves) > 1:
                ax.fill_between(ks, mean - std, mean + std, color=color, alpha=0.15, lw=0)
        ax.set_xscale("log", base=2)
        ticks = sorted({k for curves in pass_at_k.values() for k in curves[0]})
        ax.set_xticks(ticks, labels=[str(k) for k in ticks])
        ax.set_title("pass@k on held-out prompts", fontsize=10)
        ax.set_xlabel("k (samples)")
        ax.set_ylabel("pass@k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        plotted.append("pass@k")
    for ax in list(axes.flat)[panels_drawn:]:
        ax.set_visible(False)
    if title:  # its default height is a fraction of the figure's, which a tall grid's top panel titles overlapped
        fig.suptitle(title, y=1 - _TITLE_MARGIN_IN / fig.get_figheight(), va="top")
    notes = [f"Not logged by any run: {', '.join(missing)}"] if missing else []
    notes += [f"Too few logged steps for a curve (drawn as points): {', '.join(too_short)}"] if too_short else []
    if notes:
        fig.text(0.01, 0.005, ". ".join(notes), fontsize=8, color="0.4")
    fig.tight_layout(rect=(0, 0.03 if notes else 0, 1, 1))  # keeps the panels clear of the title
    output_path = os.fspath(output_path)
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    fig.savefig(output_path, dpi=120)
    return PlotResult(path=output_path, plotted=plotted, missing=missing, too_short=too_short)
