"""The demo's report: failed runs, per-method figures per numerics setting, and the pre-registered readings.

The rules are the README's pre-registration ("make demo", "Pre-registered"), fixed before the comparison was run:

- a run *failed* when its final reward is <= ``FAILED_REWARD``, its final entropy exceeds ``FAILED_ENTROPY_RATIO``
  times its first step's, or either is not finite (``failure_reason``);
- per method and numerics setting: failures / runs, and mean ± std over the non-failed runs beside all runs;
- the readings (``readings``) are decided per setting, and hold only where they hold in every setting;
- a comparison with GRPO states a direction only on as many seeds as the power analysis asks: those that decide the
  measured difference at the measured spreads with probability 0.8 (:func:`seeds_needed`, ``opefo_trl.demo.power``),
  at most the ``PREREGISTERED_SEEDS`` that docs/demo.md fixed from it for ``make demo-full`` (whose comparisons are
  decided as pre-registered). With fewer it reads ``underpowered``, with the seeds needed, whatever the means say.

Example:
    >>> is_above([3.0, 3.2, 3.1], [1.0, 1.1, 0.9]), is_above([1.0, 1.2], [1.1, 1.0])
    ('above', 'no difference shown')
    >>> versus_baseline([0.67, 0.57, 0.77], [0.5, 0.6, 0.4])  # 2.08 standard errors apart: 3 seeds of 6 needed
    ('underpowered', 6)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from opefo_trl.demo.evaluate import HeldOutResult
from opefo_trl.demo.settings import NUMERICS, DemoSettings, demo_methods
from opefo_trl.demo.tasks import TASKS
from opefo_trl.demo.training import FINAL_WINDOW, RunResult

FAILED_REWARD = 0.1
FAILED_ENTROPY_RATIO = 1.5
#: Reading 1, the regime: strict GRPO's mean |lambda*| at most this, and its final entropy at most this x the start.
REGIME_LAMBDA = 0.05
REGIME_ENTROPY_RATIO = 0.6
#: Reading (a) on a pretrained model (``make demo-real``): GRPO's mean |lambda*| at most this. The paper measured
#: ~1e-3 on Qwen2.5-Math-7B; 32 completions of <= 40 tokens per step give a noisier estimate, so the bound is the
#: synthetic demo's (``REGIME_LAMBDA``), fixed before the first run.
PRETRAINED_LAMBDA = 0.05
#: Reading 2: a method holds entropy when none of its runs failed and its final entropy is at least this x the start.
HOLDS_ENTROPY_RATIO = 0.8
#: Reading 4: a difference of means counts when it exceeds this many standard errors.
STANDARD_ERRORS = 2.0
#: ... and states a direction only with the seeds needed to decide it with this probability, at most this many
#: (the seeds per method the pre-registered power analysis fixed: docs/demo.md, second amendment).
DEFAULT_POWER = 0.8
PREREGISTERED_SEEDS = 16
UNDERPOWERED = "underpowered"
BASELINE = "grpo"


def failure_reason(run: RunResult) -> str | None:
    """Why ``run`` failed by the pre-registered rule, or None when it did not."""
    if not (math.isfinite(run.reward_final) and math.isfinite(run.entropy_final)):
        return "final reward or entropy not finite"
    if run.reward_final <= FAILED_REWARD:
        return f"final reward {run.reward_final:.3f} <= {FAILED_REWARD:g}"
    if run.entropy_final > FAILED_ENTROPY_RATIO * run.entropy_start:
        return f"final entropy {run.entropy_final:.3f} > {FAILED_ENTROPY_RATIO:g} x start {run.entropy_start:.3f}"
    return None


@dataclass
class Spread:
    """Mean and sample standard deviation (None for one value) of ``n`` values."""

    mean: float | None
    std: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread:
        present = [v for v in values if v is not None]
        if not present:
            return cls(None, None, 0)
        return cls(statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None, len(present))

    def format(self, fmt: str) -> str:
        if self.mean is None:
            return "-"
        if self.std is None:
            return format(self.mean, fmt)
        return f"{format(self.mean, fmt)} ± {format(self.std, fmt.lstrip('+'))}"  # a spread has no sign


#: The per-run figures the report aggregates, as RunResult attributes (pass@k and distinct answers are added).
FIGURES = (
    "entropy_start", "entropy_final", "entropy_min", "reward_start", "reward_final", "lambda_mean", "lambda_abs_mean",
    "net_over_gross_mean", "measured_delta_mean", "measured_abs_delta_mean", "predicted_delta_mean",
    "step_first_order_mean", "increase_mean", "decrease_mean", "seconds", "cpu_seconds", "task_entropy_start",
    "task_entropy_final", "off_task_probability_start", "off_task_probability_final", "off_task_increase_share_final",
)  # fmt: skip


def run_figures(run: RunResult) -> dict[str, float | None]:
    """The figures of one run, the held-out evaluation's included (``pass@k``, ``distinct_correct_per_target``)."""
    figures = {name: getattr(run, name) for name in FIGURES}
    figures["entropy_ratio"] = run.entropy_final / run.entropy_start
    if run.held_out is not None:
        figures.update(run.held_out.pass_at_k, distinct_correct_per_target=run.held_out.distinct_correct_per_target)
    return figures


@dataclass
class MethodSummary:
    """One method under one numerics setting: which runs failed, and each figure over all runs and non-failed runs."""

    method: str
    numerics: str
    seeds: list[int]
    failures: dict[int, str]  # seed -> reason
    all_runs: dict[str, Spread] = field(default_factory=dict)
    non_failed: dict[str, Spread] = field(default_factory=dict)
    #: the non-failed runs' values of each figure, for the comparisons
    values: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, runs: Sequence[RunResult]) -> MethodSummary:
        failures = {r.seed: reason for r in runs if (reason := failure_reason(r)) is not None}
        figures = [run_figures(r) for r in runs]
        kept = [f for f, r in zip(figures, runs, strict=True) if r.seed not in failures]
        names = list(dict.fromkeys(name for f in figures for name in f))
        return cls(
            method=runs[0].method,
            numerics=runs[0].numerics,
            seeds=[r.seed for r in runs],
            failures=failures,
            all_runs={n: Spread.of([f.get(n) for f in figures]) for n in names},
            non_failed={n: Spread.of([f.get(n) for f in kept]) for n in names},
            values={n: [v for f in kept if (v := f.get(n)) is not None] for n in names},
        )


def summarize(results: Sequence[RunResult]) -> dict[str, dict[str, MethodSummary]]:
    """``{numerics: {method: MethodSummary}}``, in the order the runs came."""
    grouped: dict[str, dict[str, list[RunResult]]] = {}
    for r in results:
        grouped.setdefault(r.numerics, {}).setdefault(r.method, []).append(r)
    return {n: {m: MethodSummary.of(runs) for m, runs in by_method.items()} for n, by_method in grouped.items()}


def identical_runs(results: Sequence[RunResult]) -> dict[tuple[str, str], tuple[int, int]]:
    """For each pair of numerics settings, ``(runs with identical logs, runs in both)`` over the (method, seed) pairs
    both ran: settings whose runs are all identical are one setting on this machine, not two."""
    by_setting: dict[str, dict[tuple[str, int], str]] = {}
    for r in results:
        by_setting.setdefault(r.numerics, {})[(r.method, r.seed)] = r.log_fingerprint
    names, pairs = list(by_setting), {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            common = by_setting[a].keys() & by_setting[b].keys()
            same = sum(by_setting[a][k] == by_setting[b][k] != "" for k in common)
            pairs[(a, b)] = (same, len(common))
    return pairs


def is_above(values: Sequence[float], baseline: Sequence[float]) -> str:
    """'above' / 'below' when the difference of the means exceeds ``STANDARD_ERRORS`` standard errors
    (sqrt(s_x^2/n_x + s_b^2/n_b)), else 'no difference shown'; 'too few runs' with fewer than 2 values on a side."""
    if len(values) < 2 or len(baseline) < 2:
        return "too few runs"
    difference = statistics.fmean(values) - statistics.fmean(baseline)
    error = math.sqrt(statistics.variance(values) / len(values) + statistics.variance(baseline) / len(baseline))
    if abs(difference) > STANDARD_ERRORS * error:
        return "above" if difference > 0 else "below"
    return "no difference shown"


def seeds_needed(difference: float, std: float, baseline_std: float, power: float = DEFAULT_POWER) -> int | None:
    """Seeds per method for :func:`is_above` to decide a true ``difference`` with probability ``power`` (the formula
    is in ``opefo_trl.demo.power``); None when the difference is 0 (no number of seeds decides it)."""
    if difference == 0:
        return None
    z = STANDARD_ERRORS + statistics.NormalDist().inv_cdf(power)
    return max(2, math.ceil(z * z * (std * std + baseline_std * baseline_std) / (difference * difference)))


def versus_baseline(values: Sequence[float], baseline: Sequence[float]) -> tuple[str, int | None]:
    """:func:`is_above`'s verdict and the seeds the power analysis asks for it (the measured difference and spreads
    taken as true; at most ``PREREGISTERED_SEEDS``); a direction on fewer seeds becomes ``UNDERPOWERED``: a
    difference that few seeds can show is as likely a draw of the seeds as an effect."""
    verdict = is_above(values, baseline)
    if verdict not in ("above", "below"):
        return verdict, None
    difference = statistics.fmean(values) - statistics.fmean(baseline)
    needed = seeds_needed(difference, statistics.stdev(values), statistics.stdev(baseline))
    needed = PREREGISTERED_SEEDS if needed is None else min(needed, PREREGISTERED_SEEDS)
    if min(len(values), len(baseline)) < needed:
        return UNDERPOWERED, needed
    return verdict, needed


@dataclass
class Reading:
    """A pre-registered reading, its verdict in each numerics setting, and whether one verdict holds in all."""

    text: str
    verdicts: dict[str, str]  # numerics -> verdict ('yes', 'no', 'above', ...)
    details: dict[str, str] = field(default_factory=dict)  # numerics -> the figures behind the verdict

    @property
    def holds(self) -> str:
        """The verdict when every setting gave the same one, else 'differs between settings'."""
        distinct = set(self.verdicts.values())
        return distinct.pop() if len(distinct) == 1 else "differs between settings"

    def cell(self, numerics: str) -> str:
        if numerics not in self.verdicts:
            return "-"
        detail = self.details.get(numerics)
        return f"{self.verdicts[numerics]} ({detail})" if detail else self.verdicts[numerics]


def _yes(condition: bool) -> str:
    return "yes" if condition else "no"


def readings(
    summaries: Mapping[str, Mapping[str, MethodSummary]], pass_at_k: Sequence[int], pretrained: bool = False
) -> list[Reading]:
    """The README's pre-registered readings 1-4, each decided in every numerics setting; on a pretrained model
    (``pretrained``, docs/demo.md's "On a real pretrained model") readings a-d of the paper's regime instead of 1."""
    settings = list(summaries)
    methods = list(dict.fromkeys(m for by_method in summaries.values() for m in by_method))
    found: list[Reading] = []

    def add(text: str, decide) -> None:
        """``decide(by_method)`` returns None (not applicable), a verdict, or (verdict, detail)."""
        decided = {t: decide(summaries[t]) for t in settings}
        decided = {t: v if isinstance(v, tuple) else (v, "") for t, v in decided.items() if v is not None}
        found.append(Reading(text, {t: v for t, (v, _) in decided.items()}, {t: d for t, (_, d) in decided.items()}))

    if pretrained:
        _pretrained_readings(add)
    elif BASELINE in methods:

        def regime(by_method):
            grpo = by_method.get(BASELINE)
            if grpo is None:
                return None
            lam, ratio = grpo.all_runs["lambda_abs_mean"].mean, grpo.all_runs["entropy_ratio"].mean
            return _yes(lam <= REGIME_LAMBDA and ratio <= REGIME_ENTROPY_RATIO), f"|λ*| {lam:.3f}, {ratio:.2f}x"

        add(
            f"1. regime: GRPO's mean |λ*| ≤ {REGIME_LAMBDA:g} and final entropy ≤ {REGIME_ENTROPY_RATIO:g}x the start",
            regime,
        )
    for method in methods:

        def holds_entropy(by_method, method=method):
            s = by_method.get(method)
            if s is None:
                return None
            ratio = s.all_runs["entropy_ratio"].mean
            return _yes(not s.failures and ratio >= HOLDS_ENTROPY_RATIO), f"{ratio:.2f}x, {len(s.failures)} failed"

        add(f"2. {method} holds entropy (no failed run, final ≥ {HOLDS_ENTROPY_RATIO:g}x the start)", holds_entropy)
    for method in methods:

        def fails(by_method, method=method):
            s = by_method.get(method)
            return None if s is None else (_yes(bool(s.failures)), f"{len(s.failures)}/{len(s.seeds)}")

        add(f"3. {method} fails (≥ 1 failed run)", fails)
    compared = ["reward_final"] + ([f"pass@{k}" for k in sorted({min(pass_at_k), max(pass_at_k)})] if pass_at_k else [])
    for method in methods:
        if method == BASELINE or BASELINE not in methods:
            continue
        for figure in compared:

            def versus(by_method, method=method, figure=figure):
                s, grpo = by_method.get(method), by_method.get(BASELINE)
                if s is None or grpo is None or figure not in s.values or figure not in grpo.values:
                    return None
                mine, theirs = s.values[figure], grpo.values[figure]
                detail = f"{statistics.fmean(mine):.3f} vs {statistics.fmean(theirs):.3f}" if mine and theirs else ""
                verdict, needed = versus_baseline(mine, theirs)
                if verdict == UNDERPOWERED:
                    detail += f"; {min(len(mine), len(theirs))} seeds, {needed} needed"
                return verdict, detail

            add(f"4. {method} vs GRPO on {figure} (non-failed runs, > {STANDARD_ERRORS:g} standard errors)", versus)
    return [r for r in found if r.verdicts]


def _pretrained_readings(add) -> None:
    """Readings a-d: whether the paper's regime holds on the pretrained model (each None where a method is missing)."""

    def small_lambda(by_method):
        grpo = by_method.get(BASELINE)
        if grpo is None:
            return None
        lam = grpo.all_runs["lambda_abs_mean"].mean
        return _yes(lam <= PRETRAINED_LAMBDA), f"|λ*| {lam:.4f}"

    def decrease_outweighs(by_method):
        grpo = by_method.get(BASELINE)
        if grpo is None or grpo.all_runs["decrease_mean"].mean is None:
            return None
        n, p = grpo.all_runs["decrease_mean"].mean, grpo.all_runs["increase_mean"].mean
        return _yes(n > p), f"N {n:.3g} vs P {p:.3g}"

    def entropy_falls(by_method):
        grpo = by_method.get(BASELINE)
        if grpo is None:
            return None
        ratio = grpo.all_runs["entropy_ratio"].mean
        return _yes(ratio < 1), f"{ratio:.3f}x"

    def falls_less(by_method):
        opefo, grpo = by_method.get("opefo"), by_method.get(BASELINE)
        if opefo is None or grpo is None:
            return None
        mine, theirs = opefo.all_runs["entropy_ratio"], grpo.all_runs["entropy_ratio"]
        verdict, needed = versus_baseline(opefo.values["entropy_ratio"], grpo.values["entropy_ratio"])
        detail = f"{mine.mean:.3f}x vs {theirs.mean:.3f}x"
        if verdict == UNDERPOWERED:
            detail += f"; {min(mine.n, theirs.n)} seeds, {needed} needed"
        return {"above": "yes", "below": "no"}.get(verdict, verdict), detail

    add(f"a. λ* small: GRPO's mean |λ*| (`opefo` estimate) ≤ {PRETRAINED_LAMBDA:g} (paper: ~1e-3, 7B)", small_lambda)
    add("b. GRPO's decrease flow N outweighs its increase flow P (means over steps)", decrease_outweighs)
    add("c. GRPO's entropy falls over the run (mean final / first step < 1)", entropy_falls)
    add(
        f"d. OPEFO's entropy falls less than GRPO's (final / first step higher by > {STANDARD_ERRORS:g} standard "
        "errors)",
        falls_less,
    )


def _cell(summary: MethodSummary, figure: str, fmt: str) -> str:
    """All runs' mean ± std, and the non-failed runs' beside it when some run failed."""
    text = summary.all_runs[figure].format(fmt) if figure in summary.all_runs else "-"
    if summary.failures and text != "-" and figure in summary.non_failed:
        text += f" (non-failed: {summary.non_failed[figure].format(fmt)})"
    return text


def summary_markdown(
    results: Sequence[RunResult], settings: DemoSettings, warm_starts: Mapping[str, HeldOutResult | None]
) -> str:
    """The report as markdown: per numerics setting a training table and a held-out pass@k table, the failed runs;
    whether two settings gave identical runs; the readings with their verdict in every setting."""
    methods = demo_methods(settings.entropy_coef)
    task = TASKS[settings.task]
    summaries = summarize(results)
    ks = (settings.pass_at_k or []) if settings.pass_at_k_samples else []
    if task.pretrained_model is not None:
        model = (
            f"The pretrained SmolLM2-135M-Instruct ({settings.num_layers} layers, hidden {settings.hidden_size}; no "
            f"warm start), {settings.steps} strict on-policy RL steps of {settings.prompts_per_step} "
        )
        data = (
            f"Training problems: {len(task.train_targets)} of recipes/smollm2-135m-instruct's word problems; held out "
            f"(never trained on): {len(task.held_out_targets)}, the indices {task.held_out_targets}."
        )
    else:
        model = (
            f"Tiny Qwen2 (hidden {settings.hidden_size}, {settings.num_layers} layers), {settings.warm_start_steps} "
            f"supervised warm-start steps, then {settings.steps} strict on-policy RL steps of "
            f"{settings.prompts_per_step} "
        )
        data = (
            f"Training targets {task.train_targets[0]}..{task.train_targets[-1]} without the held-out "
            f"{task.held_out_targets}."
        )
    lines = [
        f"# OPEFO demo: {task.description}",
        "",
        model + f"prompts x {settings.num_generations} samples, lr {settings.learning_rate:g}, temperature "
        f"{settings.temperature:g}; seeds {sorted({r.seed for r in results})}; numerics settings "
        f"{', '.join(f'{n} ({NUMERICS[n].description})' for n in summaries)}. {data}",
        "",
        f"Values are mean ± std over seeds; where a run failed, the non-failed runs' figure follows in brackets. "
        f"'final' = mean of the last {FINAL_WINDOW} logged steps. A run *failed* if its final reward ≤ "
        f"{FAILED_REWARD:g}, its final entropy > {FAILED_ENTROPY_RATIO:g}x its first step's, or either is not finite. "
        "Entropy is TRL's mean token entropy (nats) of the sampled completions. |λ*| = mean over steps of |net| / "
        "gross first-order flow of the run's own estimate, named in brackets (`opefo` for GRPO and Entropy-Reg too). "
        "ΔH = change of the batch's mean token entropy that one update made (re-scored after it): signed mean and "
        "mean |ΔH| per step; 'predicted' is the `param` estimate's first-order prediction.",
    ]
    for numerics, by_method in summaries.items():
        lines += [
            "",
            f"## numerics = {numerics}",
            "",
            "| method | failed / runs | entropy start → final (min) | reward start → final | "
            "mean \\|λ*\\| (estimate) | ΔH / step | mean \\|ΔH\\| / step | predicted ΔH / step | s / run (CPU s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, s in by_method.items():
            cells = [
                f"{name} ({methods[name].description})",
                f"{len(s.failures)} / {len(s.seeds)}",
                f"{s.all_runs['entropy_start'].format('.3f')} → {_cell(s, 'entropy_final', '.3f')} "
                f"(min {s.all_runs['entropy_min'].format('.3f')})",
                f"{s.all_runs['reward_start'].format('.2f')} → {_cell(s, 'reward_final', '.2f')}",
                f"{s.all_runs['lambda_abs_mean'].format('.3f')} (`{methods[name].flow_estimate}`)",
                _cell(s, "measured_delta_mean", "+.2e"),
                _cell(s, "measured_abs_delta_mean", ".2e"),
                _cell(s, "predicted_delta_mean", "+.2e"),
                f"{s.all_runs['seconds'].format('.0f')} ({s.all_runs['cpu_seconds'].format('.0f')})",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        if ks:
            n = settings.pass_at_k_samples
            lines += [
                "",
                f"Held-out targets {task.held_out_targets}, {n} samples each (temperature {settings.temperature:g}); "
                "exact answers; unbiased "
                "pass@k averaged over the targets:",
                "",
                "| method | " + " | ".join(f"pass@{k}" for k in ks) + " | distinct right answers / target |",
                "|---|" + "---|" * (len(ks) + 1),
            ]
            warm = warm_starts.get(numerics)
            if warm is not None:
                cells = [f"{warm.pass_at_k[f'pass@{k}']:.3f}" for k in ks] + [f"{warm.distinct_correct_per_target:.2f}"]
                lines.append(f"| {task.start_label} | " + " | ".join(cells) + " |")
            for name, s in by_method.items():
                cells = [_cell(s, f"pass@{k}", ".3f") for k in ks] + [_cell(s, "distinct_correct_per_target", ".2f")]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        if any(s.values.get("task_entropy_final") for s in by_method.values()):
            lines += [
                "",
                "Where the entropy sits: on the held-out prompts' completions (16 per target, sampled from the policy "
                "at the start and at the end), the probability of tokens the task never rewards (other than "
                f"{task.answer_characters!r}) and the entropy of the policy renormalised over the task's tokens; and "
                "the share of the update's increase flow carried by sampled tokens outside them (the run's own "
                f"estimate, last {FINAL_WINDOW} steps):",
                "",
                "| method | off-task probability start → final | task-token entropy start → final | off-task share "
                "of the increase flow |",
                "|---|---|---|---|",
            ]
            for name, s in by_method.items():
                cells = [
                    f"{s.all_runs['off_task_probability_start'].format('.4f')} → "
                    f"{_cell(s, 'off_task_probability_final', '.4f')}",
                    f"{s.all_runs['task_entropy_start'].format('.3f')} → {_cell(s, 'task_entropy_final', '.3f')}",
                    _cell(s, "off_task_increase_share_final", ".3f"),
                ]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        failed = [(name, seed, reason) for name, s in by_method.items() for seed, reason in s.failures.items()]
        lines += ["", "Failed runs: " + ("; ".join(f"{m} seed {k} ({why})" for m, k, why in failed) or "none") + "."]
        warned = [f"{r.method} seed {r.seed}" for r in results if r.numerics == numerics and r.regime_warning]
        lines.append(f"Regime guard fired for: {', '.join(warned) if warned else 'no run'}.")
    for (a, b), (same, common) in identical_runs(results).items():
        verdict = " They are one setting on this machine, not two." if same == common else ""
        lines += ["", f"Numerics {a} and {b}: {same} of {common} runs gave identical logs.{verdict}"]
    found = readings(summaries, ks, pretrained=task.pretrained_model is not None)
    if found:
        header = " | ".join(f"{n}" for n in summaries)
        lines += [
            "",
            "## Pre-registered readings",
            "",
            f"| reading | {header} | in every setting |",
            "|---|" + "---|" * (len(summaries) + 1),
        ]
        for r in found:
            cells = [r.cell(t) for t in summaries]
            holds = r.holds if len(r.verdicts) == len(summaries) else "not run in every setting"
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in [r.text, *cells, holds]) + " |")
        if any(UNDERPOWERED in r.verdicts.values() for r in found):
            lines += [
                "",
                f"{UNDERPOWERED}: the means differ by more than {STANDARD_ERRORS:g} standard errors, but at the "
                f"spreads measured here the rule needs more seeds than were run to decide such a difference with "
                f"probability {DEFAULT_POWER:g} (`python -m opefo_trl.demo.power summary.json`; at most the "
                f"{PREREGISTERED_SEEDS} of `make demo-full`), so no direction is stated. Rerun with `--seeds` as "
                "many as the reading says are needed.",
            ]
    lines += [
        "",
        "Curves: `curves.png` (mean ± std over seeds and settings); per setting `curves-<numerics>.png` when there "
        "are several. Per-run logs: `runs/<numerics>/<method>-seed<k>/trainer_state.json`.",
    ]
    return "\n".join(lines) + "\n"


def summary_dict(
    results: Sequence[RunResult], settings: DemoSettings, warm_starts: Mapping[str, HeldOutResult | None]
) -> dict:
    """Everything ``summary.json`` holds: settings, the warm starts' held-out results, every run, the per-method
    summaries per numerics setting, identical runs between settings and the readings."""
    summaries = summarize(results)
    ks = (settings.pass_at_k or []) if settings.pass_at_k_samples else []
    return {
        "settings": asdict(settings),
        "criteria": {
            "failed_reward_at_most": FAILED_REWARD,
            "failed_entropy_ratio_above": FAILED_ENTROPY_RATIO,
            "holds_entropy_ratio_at_least": HOLDS_ENTROPY_RATIO,
            "regime_lambda_at_most": REGIME_LAMBDA,
            "regime_entropy_ratio_at_most": REGIME_ENTROPY_RATIO,
            "pretrained_lambda_at_most": PRETRAINED_LAMBDA,
            "comparison_standard_errors": STANDARD_ERRORS,
        },
        "held_out_targets": TASKS[settings.task].held_out_targets,
        "warm_start": {n: asdict(w) if w else None for n, w in warm_starts.items()},
        "runs": [asdict(r) | {"failure": failure_reason(r)} for r in results],
        "identical_runs": [
            {"settings": [a, b], "identical": same, "runs": common}
            for (a, b), (same, common) in identical_runs(results).items()
        ],
        "summary": {
            n: {
                m: {
                    "failures": {str(k): v for k, v in s.failures.items()},
                    "runs": len(s.seeds),
                    "all_runs": {k: asdict(v) for k, v in s.all_runs.items()},
                    "non_failed": {k: asdict(v) for k, v in s.non_failed.items()},
                }
                for m, s in by_method.items()
            }
            for n, by_method in summaries.items()
        },
        "readings": [
            {"reading": r.text, "verdicts": {n: r.cell(n) for n in r.verdicts}, "holds": r.holds}
            for r in readings(summaries, ks, pretrained=TASKS[settings.task].pretrained_model is not None)
        ],
    }
