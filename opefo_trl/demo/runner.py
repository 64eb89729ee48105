"""The whole demo: per numerics setting a warm start, every method x seed, the held-out evaluation; then the figures,
``summary.md`` and ``summary.json``. ``main`` is ``python -m opefo_trl.demo``."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

from opefo_trl._extras import require_extra
from opefo_trl.demo.evaluate import HeldOutResult, evaluate_held_out
from opefo_trl.demo.report import summary_dict, summary_markdown
from opefo_trl.demo.settings import NUMERICS, NUMERICS_VARIABLES, DemoMethod, DemoSettings, Numerics, demo_methods
from opefo_trl.demo.tasks import TASKS
from opefo_trl.demo.training import RunResult, build_config, train_one
from opefo_trl.demo.warm_start import warm_start
from opefo_trl.real_model import RealModelError
from opefo_trl.runs.files import RunFolderBusy, RunFolderError, write_json_atomically, write_text_atomically
from opefo_trl.runs.folder import RunLock, lock_holder

#: Environment the demo runs with, set by ``main`` (before torch is imported) unless already set. OpenMP threads
#: that wait passively instead of spinning keep a second torch thread from crawling on busy, shared cores.
ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
}


#: Each setting's runs and warm-start evaluation, in ``runs/<numerics>/`` (read back when it ran in its own process).
RESULTS_FILE = "results.json"
#: What two demos in one output folder would mix (the end of the message the second one gets).
DEMO_MIXES = "their warm starts, runs and summaries"
#: The arguments of one ``train_one`` call: method, seed, numerics, model_path, run_dir, settings.
TrainJob = tuple[DemoMethod, int, str, str, str, DemoSettings]


def run_dir(output_dir: str, numerics: str, method: str, seed: int) -> str:
    return os.path.join(output_dir, "runs", numerics, f"{method}-seed{seed}")


def needs_own_process(numerics: Numerics) -> bool:
    """Whether this process was started with other values of the variables the math libraries read at start-up."""
    return any(os.environ.get(k) != numerics.environment.get(k) for k in NUMERICS_VARIABLES)


def settings_flags(settings: DemoSettings) -> list[str]:
    """Command-line flags that rebuild ``settings`` (every field given explicitly)."""
    flags = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        flags += [f"--{f.name}", *(str(v).lower() if isinstance(v, bool) else str(v) for v in values)]
    return flags


def check_demo(output_dir: str, settings: DemoSettings) -> None:
    """Refuse settings the demo cannot run, before any work: the settings' own checks, and those the trainer makes of
    every run's ``OPEFOConfig`` (`opefo_trl.trainer.checks.check_training_values`)."""
    from opefo_trl.trainer.checks import check_training_values

    require_extra("plot", "matplotlib", "The demo (its curves)")
    settings.validate()
    TASKS[settings.task].check_installed()
    assert settings.seeds is not None  # DemoSettings.__post_init__ fills the settings left at None
    methods = demo_methods(settings.entropy_coef)
    for name in settings.methods:
        check_dir = os.path.join(output_dir, "runs", "_check")
        # The task's tokens and the warm start's entropy are known after the warm start: stand-ins of their kind here.
        check_training_values(
            build_config(methods[name], settings.seeds[0], check_dir, settings, task_tokens=list(range(10)))
        )


def run_demo(output_dir: str, settings: DemoSettings, log=print) -> dict[str, str]:
    """Run the whole demo; return the paths of the figure, the markdown summary and the json summary.

    Settings and every run's ``OPEFOConfig`` are checked before the first warm start (:func:`check_demo`). Each
    setting of ``settings.numerics`` runs in this process (torch's thread count set for it, restored afterwards) or,
    when it needs environment variables this process was not started with, in a process of its own. One demo writes
    into ``output_dir`` at a time: it holds the folder's lock (``opefo_trl.runs.RunLock``, as ``opefo-train`` does),
    and a second is refused at once (``RunFolderBusy``).
    """
    check_demo(output_dir, settings)
    lock = _lock_output_dir(output_dir)
    try:
        return _run_demo(output_dir, settings, log)
    finally:
        if lock is not None:
            lock.release()


def _lock_output_dir(output_dir: str) -> RunLock | None:
    """The lock of ``output_dir``, taken; None in a setting's own process, whose parent demo holds it."""
    try:
        return RunLock(output_dir, mixes=DEMO_MIXES).acquire()
    except RunFolderBusy:
        holder = lock_holder(output_dir) or {}
        if holder.get("pid") == os.getppid() and holder.get("host") == socket.gethostname():
            return None
        raise


def _run_demo(output_dir: str, settings: DemoSettings, log) -> dict[str, str]:
    methods = demo_methods(settings.entropy_coef)
    total_start = time.perf_counter()
    results: list[RunResult] = []
    warm_starts: dict[str, HeldOutResult | None] = {}
    for name in settings.numerics:
        if needs_own_process(NUMERICS[name]):
            runs, warm = _run_setting_in_own_process(output_dir, settings, name, log)
        else:
            runs, warm = _run_setting(output_dir, settings, name, methods, log)
        results += runs
        warm_starts[name] = warm
    figure = plot_demo(output_dir, results, settings, warm_starts)
    summary_md = os.path.join(output_dir, "summary.md")
    write_text_atomically(summary_md, summary_markdown(results, settings, warm_starts))
    summary_json = os.path.join(output_dir, "summary.json")
    write_json_atomically(
        summary_json,
        summary_dict(results, settings, warm_starts) | {"total_seconds": time.perf_counter() - total_start},
        indent=2,
    )
    return {"figure": figure, "summary_md": summary_md, "summary_json": summary_json}


def _evaluate_warm_start(model_path: str, settings: DemoSettings, log) -> HeldOutResult | None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not settings.pass_at_k_samples:
        return None
    # DemoSettings.__post_init__ fills the settings left at None:
    assert settings.max_completion_length is not None and settings.pass_at_k is not None
    assert settings.temperature is not None
    task = TASKS[settings.task]
    result = evaluate_held_out(
        AutoModelForCausalLM.from_pretrained(model_path),
        AutoTokenizer.from_pretrained(model_path),
        task,
        settings.pass_at_k_samples,
        settings.pass_at_k,
        settings.max_completion_length,
        seed=0,
        temperature=settings.temperature,
    )
    log(f"{task.start_label} on the held-out targets: {_held_out_line(result)}")
    return result


def _held_out_line(result: HeldOutResult) -> str:
    passes = ", ".join(f"{k} {v:.3f}" for k, v in result.pass_at_k.items())
    return f"{passes}; {result.distinct_correct_per_target:.2f} distinct right answers per target"


def _run_setting(
    output_dir: str, settings: DemoSettings, name: str, methods: dict[str, DemoMethod], log
) -> tuple[list[RunResult], HeldOutResult | None]:
    """Warm start, every method x seed and the held-out evaluations under the setting ``name``, in this process."""
    import torch

    assert settings.seeds is not None  # DemoSettings.__post_init__ fills the settings left at None
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(NUMERICS[name].threads)
    try:
        task = TASKS[settings.task]
        if task.pretrained_model is not None:
            model_path = task.pretrained_model()
            log(f"pretrained model (no warm start): {model_path}")
        else:
            model_path = warm_start(output_dir, settings, name, log=log)
        warm = _evaluate_warm_start(model_path, settings, log)
        jobs: list[TrainJob] = [
            (methods[method], seed, name, model_path, run_dir(output_dir, name, method, seed), settings)
            for seed in settings.seeds
            for method in settings.methods
        ]
        results: list[RunResult] = []
        for result in _train_all(jobs, settings.workers, NUMERICS[name].threads, log):
            results.append(result)
            extra = f"; held out: {_held_out_line(result.held_out)}" if result.held_out else ""
            log(
                f"[{len(results)}/{len(jobs)}] {result.method} seed {result.seed} done in {result.seconds:.0f} s: "
                f"entropy {result.entropy_start:.3f} -> {result.entropy_final:.3f} (min {result.entropy_min:.3f}), "
                f"reward {result.reward_start:.2f} -> {result.reward_final:.2f}, mean |lambda*| "
                f"{result.lambda_abs_mean:.4f}, measured dH/step {result.measured_delta_mean:+.2e}{extra}"
            )
    finally:
        torch.set_num_threads(previous_threads)
    write_json_atomically(
        os.path.join(output_dir, "runs", name, RESULTS_FILE),
        {
            "numerics": name,
            "environment": {k: os.environ.get(k) for k in NUMERICS_VARIABLES},
            "torch_threads": NUMERICS[name].threads,
            "warm_start": dataclasses.asdict(warm) if warm else None,
            "runs": [dataclasses.asdict(r) for r in results],
        },
        indent=2,
    )
    return results, warm


def _train_all(jobs: list[TrainJob], workers: int, threads: int, log):
    """``train_one(*job)`` for every job, in order: here, or in ``workers`` processes side by side (spawned, each with
    ``threads`` torch threads; a run's numbers do not depend on the process it runs in)."""
    if workers == 1 or len(jobs) == 1:
        for i, job in enumerate(jobs):
            method, seed = job[0], job[1]
            log(f"[{i + 1}/{len(jobs)}] {method.name} ({method.description}), seed {seed}, numerics {job[2]}")
            yield train_one(*job, log=log)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    log(f"training {len(jobs)} runs in {workers} processes side by side")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(threads,)) as pool:
        try:
            futures = [pool.submit(train_one, *job, log=print) for job in jobs]
            for future in futures:
                yield future.result()
        except BaseException:  # SIGTERM (see `main`), Ctrl-C, a failed run, the caller closing this generator
            _stop_workers(pool)
            raise


def _stop_workers(pool) -> None:
    """End the pool's workers now: leaving the pool waits for the runs they are in (minutes), and a parent that
    exits without them leaves them training, orphaned."""
    workers = list((pool._processes or {}).values())  # no public way to stop them before Python 3.14; shutdown
    pool.shutdown(wait=False, cancel_futures=True)  # forgets them
    for process in workers:
        process.terminate()
    for process in workers:
        process.join(timeout=30)


def _start_worker(threads: int) -> None:
    """A worker process of ``_train_all``: the demo's environment, thread count and quiet console."""
    import warnings

    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    assert isinstance(sys.stdout, io.TextIOWrapper)  # a spawned process's own stdout
    sys.stdout.reconfigure(line_buffering=True)


def _run_setting_in_own_process(
    output_dir: str, settings: DemoSettings, name: str, log
) -> tuple[list[RunResult], HeldOutResult | None]:
    """The setting ``name`` as a demo of its own (``python -m opefo_trl.demo --numerics name``, same output folder)
    in a process started with its environment; its results are read back from ``runs/<name>/results.json``."""
    environment = {k: v for k, v in os.environ.items() if k not in NUMERICS_VARIABLES} | NUMERICS[name].environment
    command = [sys.executable, "-m", "opefo_trl.demo", *settings_flags(replace(settings, numerics=[name]))]
    variables = " ".join(f"{k}={v}" for k, v in NUMERICS[name].environment.items()) or "none of " + str(
        NUMERICS_VARIABLES
    )
    log(f"numerics {name}: in a process of its own, started with {variables}")
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None  # stdout=PIPE
    try:
        for line in process.stdout:
            log(f"[{name}] {line.rstrip()}")
        process.wait()
    except BaseException:  # SIGTERM or Ctrl-C here: the setting's own demo (which stops its workers) ends too
        process.terminate()
        process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"The demo under numerics {name!r} failed (exit code {process.returncode}); see its output.")
    with open(os.path.join(output_dir, "runs", name, RESULTS_FILE)) as f:
        data = json.load(f)
    warm = data["warm_start"]
    return [RunResult.from_dict(r) for r in data["runs"]], HeldOutResult(**warm) if warm else None


def plot_demo(
    output_dir: str, results: list[RunResult], settings: DemoSettings, warm_starts: dict[str, HeldOutResult | None]
) -> str:
    """``curves.png`` over every run (grouped by method: mean ± std over seeds and numerics settings), with the pass@k
    panel; with several settings also ``curves-<numerics>.png`` for each. Returns the path of ``curves.png``."""
    from opefo_trl.plotting import DEFAULT_PANELS, Panel, load_runs, plot_runs

    task = TASKS[settings.task]
    placement_panels = (
        Panel(
            f"Where the entropy sits: probability off {task.answer_characters!r} (held-out)",
            "off-task probability",
            ("placement/off_task_probability",),
            optional=True,
        ),
        Panel("Entropy over the task's tokens (held-out)", "nats", ("placement/task_entropy",), optional=True),
        Panel(
            "Share of the increase flow on off-task tokens",
            "share of P",
            ("entropy_flow/off_task_increase_share",),
            optional=True,
        ),
    )

    def draw(path: str, chosen: list[RunResult], numerics: list[str]) -> None:
        assert settings.seeds is not None  # DemoSettings.__post_init__ fills the settings left at None
        runs = load_runs([r.run_dir for r in chosen])
        groups = {run.label: r.method for run, r in zip(runs, chosen, strict=True)}
        curves: dict[str, list[dict[int, float]]] = {}
        for r in chosen:
            if r.held_out is not None:
                curves.setdefault(r.method, []).append(_by_k(r.held_out))
        warm = [_by_k(w) for n in numerics if (w := warm_starts.get(n)) is not None]
        plot_runs(
            runs,
            path,
            groups=groups,
            smoothing=0.6,
            title=f"{task.name} task, {model}, {len(settings.seeds)} seed(s), numerics {' and '.join(numerics)} "
            "(EMA-smoothed 0.6; band: ±1 std)",
            pass_at_k=({start: warm} if warm else {}) | curves,
            panels=(*DEFAULT_PANELS, *placement_panels),
        )

    model = "SmolLM2-135M-Instruct" if task.pretrained_model else "tiny Qwen2"
    start = "base model" if task.pretrained_model else "warm start"
    figure = os.path.join(output_dir, "curves.png")
    draw(figure, results, settings.numerics)
    if len(settings.numerics) > 1:
        for name in settings.numerics:
            draw(os.path.join(output_dir, f"curves-{name}.png"), [r for r in results if r.numerics == name], [name])
    return figure


def _by_k(result: HeldOutResult) -> dict[int, float]:
    return {int(name.removeprefix("pass@")): value for name, value in result.pass_at_k.items()}


def _exit_on_sigterm(signum: int, frame) -> None:
    """SIGTERM (``kill PID``) as an exception, so that the demo's workers and child processes are ended with it, as
    they are on Ctrl-C; the default action would end the main process alone."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """``python -m opefo_trl.demo``: parse and check the settings, run the demo, print the summary; return the exit
    status (2 for bad input; a SIGTERM ends it with SystemExit(143))."""
    main_thread = threading.current_thread() is threading.main_thread()  # where Python delivers signals
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        return _main(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error

    parser = build_parser(
        [DemoSettings],
        prog="python -m opefo_trl.demo",
        description="Train strict on-policy GRPO, OPEFO and baselines on a synthetic task on CPU; plot and tabulate "
        "token entropy, reward, the entropy flow, the measured entropy change of every update and pass@k on held-out "
        "targets, with failed runs counted and the readings checked in every numerics setting.",
    )
    try:
        (settings,) = parse_options(parser, argv)
        check_demo(settings.output_dir, settings)  # before the warm start
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    # Keep the console to the demo's progress lines: transformers' per-load progress bars and deprecation notices
    # raised inside TRL/transformers say nothing about the demo.
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    start = time.perf_counter()
    try:
        paths = run_demo(settings.output_dir, settings, log=lambda msg: print(msg, flush=True))
    except (RunFolderError, RealModelError) as err:  # another demo in the folder; a model folder it cannot build
        return report_error(parser.prog, err)
    print(f"\nDone in {time.perf_counter() - start:.0f} s.")
    with open(paths["summary_md"]) as f:
        print(f.read())
    print(f"figure:  {paths['figure']}\nsummary: {paths['summary_md']}\nper-run: {paths['summary_json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
