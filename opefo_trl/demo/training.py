"""One RL run of the demo: its ``OPEFOConfig``, the training, and the figures the report needs from its log."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import TypedDict

from opefo_trl.demo.evaluate import HeldOutResult, evaluate_held_out
from opefo_trl.demo.placement import PREFIX, PlacementCallback, measure_placement
from opefo_trl.demo.settings import START_ENTROPY, DemoMethod, DemoSettings
from opefo_trl.demo.tasks import TASKS
from opefo_trl.methods import REGIME_GUARD

#: The metrics every run must log; the demo checks them after each run instead of plotting empty panels.
REQUIRED_METRICS = (
    "entropy",
    "reward",
    "entropy_flow/lambda",
    "entropy_flow/increase",
    "entropy_flow/decrease",
    "entropy_flow/net",
    "entropy_flow/measured_delta",
)


def build_config(
    method: DemoMethod,
    seed: int,
    run_dir: str,
    settings: DemoSettings,
    task_tokens: list[int] | None = None,
    start_entropy: float = 1.0,
):
    """The ``OPEFOConfig`` of one run: identical budget for every method, the method's own fields on top; every
    step audited (the measured entropy change of the update). ``task_tokens``: the task's answer tokens (the
    diagnostics' off-task shares); ``start_entropy``: the warm start's mean token entropy, for the fields the method
    sets to ``START_ENTROPY`` (an entropy target)."""
    from opefo_trl import OPEFOConfig

    # DemoSettings.__post_init__ fills the settings left at None:
    assert settings.prompts_per_step is not None and settings.num_generations is not None
    completions = settings.prompts_per_step * settings.num_generations
    micro_batch = settings.micro_batch_size or completions
    fields = {k: start_entropy if v == START_ENTROPY else v for k, v in method.config.items()}
    return OPEFOConfig(
        output_dir=run_dir,
        seed=seed,
        data_seed=seed,
        max_steps=settings.steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=completions // micro_batch,  # one rollout batch per optimizer step
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=settings.warmup_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        activation_checkpointing=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        entropy_flow_audit_steps=1,
        entropy_flow_task_tokens=task_tokens,
        **fields,
    )


def _progress_callback(label: str, total_steps: int, log):
    from transformers import TrainerCallback

    every = max(1, total_steps // 4)

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            step = state.global_step
            if "entropy" not in logs or (step % every and step != total_steps):
                return
            log(
                f"  {label} step {step:>3}/{total_steps}: entropy {logs['entropy']:.3f}  reward "
                f"{logs.get('reward', float('nan')):.2f}  lambda* {logs.get('entropy_flow/lambda', float('nan')):+.3f}"
            )

    return Progress()


@dataclass
class RunResult:
    """What the report needs from one run (``numerics``: the floating-point setting it ran under)."""

    method: str
    seed: int
    numerics: str
    run_dir: str
    flow_estimate: str  # the estimate of the logged entropy_flow/lambda (the run's own)
    steps: int
    seconds: float  # wall time of the training (no evaluation)
    cpu_seconds: float  # CPU time of this process over the same span: what a quiet machine's wall time would be
    entropy_start: float
    entropy_final: float
    entropy_min: float
    reward_start: float
    reward_final: float
    lambda_mean: float
    lambda_abs_mean: float
    net_over_gross_mean: float
    measured_delta_mean: float
    measured_abs_delta_mean: float
    predicted_delta_mean: float | None = None
    #: Mean over steps of the first-order increase flow P and decrease flow N (both >= 0; the run's own estimate).
    increase_mean: float | None = None
    decrease_mean: float | None = None
    step_first_order_mean: float | None = None
    regime_warning: str | None = None
    held_out: HeldOutResult | None = None
    #: Where the entropy sits (``opefo_trl.demo.placement``), on the held-out prompts at the start and at the end.
    task_entropy_start: float | None = None
    task_entropy_final: float | None = None
    off_task_probability_start: float | None = None
    off_task_probability_final: float | None = None
    #: The share of the increase flow carried by sampled tokens outside the task's (mean of the last steps).
    off_task_increase_share_final: float | None = None
    #: sha256 of the logged FINGERPRINT_METRICS: equal for two runs whose logs are identical
    log_fingerprint: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> RunResult:
        """The inverse of ``dataclasses.asdict`` (extra keys, such as the report's ``failure``, are ignored)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        if values.get("held_out") is not None:
            values["held_out"] = HeldOutResult(**values["held_out"])
        return cls(**values)


#: What two runs must agree in, step for step, to count as identical (``log_fingerprint``, ``demo.diagnose``).
FINGERPRINT_METRICS = ("entropy", "reward", "entropy_flow/lambda", "entropy_flow/measured_delta", "grad_norm")


def log_fingerprint(history: list[dict]) -> str:
    """sha256 of every logged step's ``FINGERPRINT_METRICS`` (NaN included)."""
    rows = [[row.get("step")] + [repr(row.get(k)) for k in FINGERPRINT_METRICS] for row in history if "entropy" in row]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _metric(history: list[dict], key: str, finite: bool = True) -> list[float]:
    """The logged values of ``key`` in step order; with ``finite=False`` NaN and inf are kept (a diverged run)."""
    logged = [row.get(key) for row in history if "step" in row]
    values = [v for v in logged if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return [v for v in values if math.isfinite(v)] if finite else values


def _mean_or_none(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


#: "final" values in the summary are means over this many last logged steps (single steps are noisy).
FINAL_WINDOW = 5


class HistorySummary(TypedDict):
    """What ``summarize_history`` takes from a run's log (fields of ``RunResult``)."""

    entropy_start: float
    entropy_final: float
    entropy_min: float
    reward_start: float
    reward_final: float
    lambda_mean: float
    lambda_abs_mean: float
    net_over_gross_mean: float
    measured_delta_mean: float
    measured_abs_delta_mean: float
    predicted_delta_mean: float | None
    step_first_order_mean: float | None
    increase_mean: float | None
    decrease_mean: float | None
    task_entropy_start: float | None
    task_entropy_final: float | None
    off_task_probability_start: float | None
    off_task_probability_final: float | None
    off_task_increase_share_final: float | None


def _first_and_last(history: list[dict], key: str) -> tuple[float | None, float | None]:
    values = _metric(history, key)
    return (values[0], values[-1]) if values else (None, None)


def summarize_history(history: list[dict]) -> HistorySummary:
    """Start/final/min entropy, start/final reward, mean lambda* (and of |lambda*|, = mean |net| / gross), and the
    mean measured (signed and absolute) and predicted entropy change per step of one run's ``log_history``.

    "final" is the mean of the last ``FINAL_WINDOW`` logged values, non-finite ones included: a run that diverged
    to NaN reads NaN, not the mean of what came before.
    """
    missing = [k for k in REQUIRED_METRICS if not _metric(history, k)]
    if missing:
        raise RuntimeError(
            f"The run logged no {missing}; OPEFOTrainer should log them every step with entropy_flow_diagnostics=True "
            "and entropy_flow_audit_steps=1."
        )
    entropy, reward = _metric(history, "entropy"), _metric(history, "reward")
    rows = [r for r in history if "entropy_flow/net" in r]
    net_over_gross = [
        abs(r["entropy_flow/net"]) / (r["entropy_flow/increase"] + r["entropy_flow/decrease"])
        for r in rows
        if r["entropy_flow/increase"] + r["entropy_flow/decrease"] > 0
    ]
    lambdas, measured = _metric(history, "entropy_flow/lambda"), _metric(history, "entropy_flow/measured_delta")
    task_entropy = _first_and_last(history, PREFIX + "task_entropy")
    off_task = _first_and_last(history, PREFIX + "off_task_probability")
    off_task_share = _metric(history, "entropy_flow/off_task_increase_share")
    return {
        "entropy_start": entropy[0],
        "entropy_final": statistics.fmean(_metric(history, "entropy", finite=False)[-FINAL_WINDOW:]),
        "entropy_min": min(entropy),
        "reward_start": reward[0],
        "reward_final": statistics.fmean(_metric(history, "reward", finite=False)[-FINAL_WINDOW:]),
        "lambda_mean": statistics.fmean(lambdas),
        "lambda_abs_mean": statistics.fmean(abs(x) for x in lambdas),
        "net_over_gross_mean": statistics.fmean(net_over_gross) if net_over_gross else 0.0,
        "measured_delta_mean": statistics.fmean(measured),
        "measured_abs_delta_mean": statistics.fmean(abs(x) for x in measured),
        "predicted_delta_mean": _mean_or_none(_metric(history, "entropy_flow/predicted_delta")),
        "step_first_order_mean": _mean_or_none(_metric(history, "entropy_flow/step_first_order")),
        "increase_mean": _mean_or_none(_metric(history, "entropy_flow/increase")),
        "decrease_mean": _mean_or_none(_metric(history, "entropy_flow/decrease")),
        "task_entropy_start": task_entropy[0],
        "task_entropy_final": task_entropy[1],
        "off_task_probability_start": off_task[0],
        "off_task_probability_final": off_task[1],
        "off_task_increase_share_final": _mean_or_none(off_task_share[-FINAL_WINDOW:]),
    }


#: Completions per held-out prompt of each placement measurement, and the measurements over a run (plus the start).
PLACEMENT_SAMPLES = 16
PLACEMENT_POINTS = 12


def _start_entropy(model_path: str, tokenizer, task, task_tokens: list[int], measure: dict) -> float:
    """The warm start's mean token entropy on the training prompts (the level a setpoint method holds), measured the
    way the placement is, with seed 0: the same for every run of a numerics setting."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    prompts = [task.prompt(t) for t in task.train_targets]
    return measure_placement(model, tokenizer, prompts, torch.tensor(task_tokens), seed=0, **measure)["entropy"]


def train_one(
    method: DemoMethod,
    seed: int,
    numerics: str,
    model_path: str,
    run_dir: str,
    settings: DemoSettings,
    log=print,
    trainer_class=None,
) -> RunResult:
    """Train one method for one seed from ``model_path`` (under the numerics setting ``numerics``, set up by the
    caller);
    save ``trainer_state.json`` in ``run_dir``; evaluate the trained policy on the held-out targets.

    ``trainer_class`` (default ``OPEFOTrainer``) lets a diagnostic subclass run the very same code path.
    """
    import warnings

    import torch
    from transformers import AutoTokenizer, PrinterCallback

    from opefo_trl import OPEFOTrainer

    # DemoSettings.__post_init__ fills the settings left at None:
    assert settings.steps is not None and settings.max_completion_length is not None
    assert settings.pass_at_k is not None and settings.temperature is not None
    task = TASKS[settings.task]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    task_tokens = task.task_token_ids(tokenizer)
    measure = dict(
        samples=PLACEMENT_SAMPLES, max_new_tokens=settings.max_completion_length, temperature=settings.temperature
    )
    start_entropy = 1.0
    if any(value == START_ENTROPY for value in method.config.values()):
        start_entropy = _start_entropy(model_path, tokenizer, task, task_tokens, measure)
    args = build_config(method, seed, run_dir, settings, task_tokens, start_entropy)
    label = f"{method.name} seed {seed}" + (f" {numerics}" if len(settings.numerics) > 1 else "")
    start, cpu_start = time.perf_counter(), time.process_time()
    callbacks = [_progress_callback(label, settings.steps, log)]
    if task.measure_placement:
        placement = PlacementCallback(
            tokenizer,
            [task.prompt(t) for t in task.held_out_targets],
            torch.tensor(task_tokens),
            every=max(1, settings.steps // PLACEMENT_POINTS),
            seed=seed,
            **measure,
        )
        callbacks.append(placement)
    trainer = (trainer_class or OPEFOTrainer)(
        model=model_path,
        reward_funcs=task.reward,
        args=args,
        train_dataset=task.train_dataset(),
        callbacks=callbacks,
    )
    # With disable_tqdm the Trainer prints every log dict; our progress lines replace both.
    trainer.remove_callback(PrinterCallback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    guard = next((str(w.message) for w in caught if str(w.message).startswith(REGIME_GUARD)), None)
    if guard:
        log(f"  {label}: regime guard: {guard}")
    trainer.save_state()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    result = RunResult(
        method=method.name,
        seed=seed,
        numerics=numerics,
        run_dir=run_dir,
        flow_estimate=method.flow_estimate,
        steps=trainer.state.global_step,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        regime_warning=guard,
        log_fingerprint=log_fingerprint(trainer.state.log_history),
        **summarize_history(trainer.state.log_history),
    )
    if settings.pass_at_k_samples:
        result.held_out = evaluate_held_out(
            trainer.model,
            trainer.processing_class,
            task,
            settings.pass_at_k_samples,
            settings.pass_at_k,
            settings.max_completion_length,
            seed=seed,
            temperature=settings.temperature,
        )
    return result
