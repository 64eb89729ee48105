"""The whole demo: per thread setting a warm start, every method x seed, the held-out evaluation; then the figures,
``summary.md`` and ``summary.json``. ``main`` is ``python -m opefo_trl.demo``."""

from __future__ import annotations

import json
import os
import sys
import time

from opefo_trl.demo.evaluate import HeldOutResult, evaluate_held_out
from opefo_trl.demo.report import summary_dict, summary_markdown
from opefo_trl.demo.settings import DemoMethod, DemoSettings, demo_methods
from opefo_trl.demo.tasks import TASKS
from opefo_trl.demo.training import RunResult, build_config, train_one
from opefo_trl.demo.warm_start import warm_start

#: Environment the demo runs with, set by ``main`` (before torch is imported) unless already set. OpenMP threads
#: that wait passively instead of spinning keep a second torch thread from crawling on busy, shared cores.
ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
}


def run_dir(output_dir: str, threads: int, method: str, seed: int) -> str:
    return os.path.join(output_dir, "runs", f"threads{threads}", f"{method}-seed{seed}")


def run_demo(output_dir: str, settings: DemoSettings, log=print) -> dict[str, str]:
    """Run the whole demo; return the paths of the figure, the markdown summary and the json summary.

    Settings and every run's ``OPEFOConfig`` are checked before the first warm start. torch's thread count is set to
    each of ``settings.threads`` in turn and restored afterwards.
    """
    import torch

    settings.validate()
    methods = demo_methods(settings.entropy_coef)
    for name in settings.methods:
        build_config(methods[name], settings.seeds[0], os.path.join(output_dir, "runs", "_check"), settings)
    os.makedirs(output_dir, exist_ok=True)
    previous_threads = torch.get_num_threads()
    try:
        return _run_demo(output_dir, settings, methods, log)
    finally:
        torch.set_num_threads(previous_threads)


def _evaluate_warm_start(model_path: str, settings: DemoSettings, log) -> HeldOutResult | None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not settings.pass_at_k_samples:
        return None
    task = TASKS[settings.task]
    result = evaluate_held_out(
        AutoModelForCausalLM.from_pretrained(model_path),
        AutoTokenizer.from_pretrained(model_path),
        task,
        settings.pass_at_k_samples,
        settings.pass_at_k,
        settings.max_completion_length,
        seed=0,
    )
    log(f"warm-start policy on the held-out targets: {_held_out_line(result)}")
    return result


def _held_out_line(result: HeldOutResult) -> str:
    passes = ", ".join(f"{k} {v:.3f}" for k, v in result.pass_at_k.items())
    return f"{passes}; {result.distinct_correct_per_target:.2f} distinct right answers per target"


def _run_demo(output_dir: str, settings: DemoSettings, methods: dict[str, DemoMethod], log) -> dict[str, str]:
    import torch

    total_start = time.perf_counter()
    results: list[RunResult] = []
    warm_starts: dict[int, HeldOutResult | None] = {}
    total = len(settings.threads) * len(settings.methods) * len(settings.seeds)
    for threads in settings.threads:
        torch.set_num_threads(threads)
        model_path = warm_start(output_dir, settings, threads, log=log)
        warm_starts[threads] = _evaluate_warm_start(model_path, settings, log)
        for seed in settings.seeds:
            for name in settings.methods:
                log(
                    f"[{len(results) + 1}/{total}] {name} ({methods[name].description}), seed {seed}, "
                    f"{settings.steps} steps, {threads} thread(s)"
                )
                path = run_dir(output_dir, threads, name, seed)
                result = train_one(methods[name], seed, threads, model_path, path, settings, log=log)
                results.append(result)
                extra = f"; held out: {_held_out_line(result.held_out)}" if result.held_out else ""
                log(
                    f"[{len(results)}/{total}] {name} seed {seed} done in {result.seconds:.0f} s: entropy "
                    f"{result.entropy_start:.3f} -> {result.entropy_final:.3f} (min {result.entropy_min:.3f}), reward "
                    f"{result.reward_start:.2f} -> {result.reward_final:.2f}, mean |lambda*| "
                    f"{result.lambda_abs_mean:.4f}, measured dH/step {result.measured_delta_mean:+.2e}{extra}"
                )
    figure = plot_demo(output_dir, results, settings, warm_starts)
    summary_md = os.path.join(output_dir, "summary.md")
    with open(summary_md, "w") as f:
        f.write(summary_markdown(results, settings, warm_starts))
    summary_json = os.path.join(output_dir, "summary.json")
    with open(summary_json, "w") as f:
        json.dump(
            summary_dict(results, settings, warm_starts) | {"total_seconds": time.perf_counter() - total_start},
            f,
            indent=2,
        )
    return {"figure": figure, "summary_md": summary_md, "summary_json": summary_json}


def plot_demo(
    output_dir: str, results: list[RunResult], settings: DemoSettings, warm_starts: dict[int, HeldOutResult | None]
) -> str:
    """``curves.png`` over every run (grouped by method: mean ± std over seeds and thread settings), with the pass@k
    panel; with several thread settings also ``curves-threads<t>.png`` for each. Returns the path of ``curves.png``."""
    from opefo_trl.plotting import load_runs, plot_runs

    task = TASKS[settings.task]

    def draw(path: str, chosen: list[RunResult], threads: list[int]) -> None:
        runs = load_runs([r.run_dir for r in chosen])
        groups = {run.label: r.method for run, r in zip(runs, chosen, strict=True)}
        curves: dict[str, list[dict[int, float]]] = {}
        for r in chosen:
            if r.held_out is not None:
                curves.setdefault(r.method, []).append(_by_k(r.held_out))
        warm = [_by_k(warm_starts[t]) for t in threads if warm_starts.get(t) is not None]
        plot_runs(
            runs,
            path,
            groups=groups,
            smoothing=0.6,
            title=f"{task.name} task, tiny Qwen2, {len(settings.seeds)} seed(s), torch threads "
            f"{' and '.join(map(str, threads))} "
            "(EMA-smoothed 0.6; band: ±1 std)",
            pass_at_k=({"warm start": warm} if warm else {}) | curves,
        )

    figure = os.path.join(output_dir, "curves.png")
    draw(figure, results, settings.threads)
    if len(settings.threads) > 1:
        for t in settings.threads:
            draw(os.path.join(output_dir, f"curves-threads{t}.png"), [r for r in results if r.threads == t], [t])
    return figure


def _by_k(result: HeldOutResult) -> dict[int, float]:
    return {int(name.removeprefix("pass@")): value for name, value in result.pass_at_k.items()}


def main(argv: list[str] | None = None) -> int:
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error

    parser = build_parser(
        [DemoSettings],
        prog="python -m opefo_trl.demo",
        description="Train strict on-policy GRPO, OPEFO and baselines on a synthetic task on CPU; plot and tabulate "
        "token entropy, reward, the entropy flow, the measured entropy change of every update and pass@k on held-out "
        "targets, with failed runs counted and the readings checked in every torch thread setting.",
    )
    try:
        (settings,) = parse_options(parser, argv)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    # Keep the console to the demo's progress lines: transformers' per-load progress bars and deprecation notices
    # raised inside TRL/transformers say nothing about the demo.
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    start = time.perf_counter()
    paths = run_demo(settings.output_dir, settings, log=lambda msg: print(msg, flush=True))
    print(f"\nDone in {time.perf_counter() - start:.0f} s.")
    with open(paths["summary_md"]) as f:
        print(f.read())
    print(f"figure:  {paths['figure']}\nsummary: {paths['summary_md']}\nper-run: {paths['summary_json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
