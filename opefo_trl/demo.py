"""GRPO vs OPEFO (and baselines) side by side on a laptop CPU: entropy collapse, entropy-flow balance, and what the
updates really did to entropy.

Runs offline, with nothing downloaded:

1. builds a tiny Qwen2-shaped model with the arithmetic tokenizer of ``opefo_trl.tiny``;
2. warm-starts it with supervised steps on a synthetic task, so that the RL start policy is partly right and spreads
   its probability over many right answers; the result is cached in ``OUTPUT_DIR/models/warm_start-<task>`` and
   shared by every run;
3. trains each method for each seed from those weights with ``OPEFOTrainer`` (TRL's GRPO code path), identical
   budgets, auditing every step (``entropy_flow_audit_steps=1``: the batch is re-scored after the update and the
   measured change of its mean token entropy logged), writing ``OUTPUT_DIR/runs/<method>-seed<k>/``;
4. samples each trained policy and counts the distinct right answers it gives per prompt (diversity);
5. writes ``OUTPUT_DIR/curves.png`` (entropy, reward, lambda*, measured vs predicted entropy change, entropy flows;
   mean +- std over seeds), ``OUTPUT_DIR/summary.md`` (a table) and ``OUTPUT_DIR/summary.json``.

Tasks (``--task``):

- ``digit_sum`` (default; ``opefo_trl.digit_sum``): "Write 24 digits that add up to t", graded by how close the
  digit sum is. No single token decides the reward, so a GRPO batch's entropy flow nearly cancels (|lambda*| a few
  hundredths: the paper's regime, within what a CPU batch allows) while GRPO's entropy still falls.
- ``sum`` (``opefo_trl.synthetic``): "Solve t = ? + ?". The decisive second addend dominates the flow, lambda* is
  ~0.7: far outside the paper's regime (kept as the documented out-of-regime case; the regime guard fires there).

Usage:
    python -m opefo_trl.demo --output_dir runs/demo                    # digit_sum: 4 methods x 3 seeds
    python -m opefo_trl.demo --output_dir runs/demo-quick --quick      # 1 seed, fewer steps (CI)
    python -m opefo_trl.demo --output_dir runs/demo-sum --task sum     # the out-of-regime task
    python -m opefo_trl.demo --output_dir runs/x --methods grpo opefo clip_cov par --seeds 0 1 2 3 4

Methods: ``grpo`` (strict on-policy GRPO), ``opefo`` (the paper's estimate), ``opefo_param`` (OPEFO with the exact
parameter-space flow), ``opefo_param_step`` (the same, balancing the whole AdamW step, momentum included),
``entropy_reg`` (GRPO + TRL's ``entropy_coef``), ``opefo_full``, ``clip_cov``, ``par``.
Every run logs the entropy-flow diagnostics (the lambda* OPEFO would use), so the lambda* panel is meaningful for
the baselines too.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from opefo_trl import digit_sum, synthetic  # noqa: E402
from opefo_trl.model_io import render_prompts  # noqa: E402

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


# ---------------------------------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoTask:
    """A synthetic verifiable task: its data, reward, warm-start answers, a right-answer check, and the settings that
    fit it (model size, budget) where they differ from ``DemoSettings``'s defaults."""

    name: str
    description: str
    targets: Callable[[], list[int]]
    prompt: Callable[[int], list[dict]]
    dataset: Callable[[], object]
    reward: Callable
    warm_start_answers: Callable[[int, int], list[tuple[int, str]]]  # (count, seed) -> [(target, answer)]
    answer_key: Callable[[str, int], Hashable | None]  # a right answer's identity (distinct answers), else None
    defaults: dict = field(default_factory=dict)


def _sum_answer(text: str, target: int):
    return synthetic.parse_sum(text) if synthetic.is_correct_sum(text, target) else None


def _digit_sum_answer(text: str, target: int):
    digits = digit_sum.answer_digits(text)
    exact = len(digits) == digit_sum.DEFAULT_NUM_DIGITS and sum(digits) == target
    return tuple(digits) if exact else None


TASKS = {
    "digit_sum": DemoTask(
        name="digit_sum",
        description="Write 24 digits that add up to t (graded by how close the sum is): in the paper's regime",
        targets=digit_sum.default_targets,
        prompt=digit_sum.digit_sum_prompt,
        dataset=digit_sum.build_digit_sum_dataset,
        reward=digit_sum.digit_sum_reward,
        warm_start_answers=lambda n, seed: [
            (e.target, e.answer) for e in digit_sum.sample_warm_start_examples(n, seed=seed)
        ],
        answer_key=_digit_sum_answer,
        # 128 completions x 24 tokens per step keep the flow's sampling noise below |lambda*| ~ 0.05; the smaller
        # model keeps that batch inside the CPU budget.
        defaults=dict(
            hidden_size=64,
            num_layers=2,
            warm_start_steps=400,
            steps=60,
            prompts_per_step=16,
            learning_rate=2e-3,
            max_completion_length=digit_sum.DEFAULT_NUM_DIGITS,
        ),  # fmt: skip
    ),
    "sum": DemoTask(
        name="sum",
        description="Solve t = ? + ? (one decisive token): far outside the paper's regime",
        targets=lambda: synthetic.default_targets(6, 15),
        prompt=synthetic.sum_prompt,
        dataset=lambda: synthetic.build_sum_dataset(synthetic.default_targets(6, 15)),
        reward=synthetic.correct_sum_reward,
        warm_start_answers=lambda n, seed: [
            (e.target, e.answer)
            for e in synthetic.sample_warm_start_examples(
                n, targets=synthetic.default_targets(6, 15), wrong_fraction=0.0, seed=seed
            )
        ],
        answer_key=_sum_answer,
        defaults=dict(
            hidden_size=128,
            num_layers=4,
            warm_start_steps=300,
            steps=120,
            prompts_per_step=8,
            learning_rate=3e-4,
            max_completion_length=6,
        ),  # fmt: skip
    ),
}


# ---------------------------------------------------------------------------------------------------------------------
# Methods and settings
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoMethod:
    """A method of the comparison: a name for folders and tables, and the ``OPEFOConfig`` fields that make it."""

    name: str
    description: str
    config: dict


def demo_methods(entropy_coef: float) -> dict[str, DemoMethod]:
    """The methods the demo can run (``entropy_coef`` is Entropy-Reg's bonus coefficient)."""
    return {
        m.name: m
        for m in (
            DemoMethod("grpo", "strict on-policy GRPO", {"method": "grpo"}),
            DemoMethod("opefo", "OPEFO, the paper's `opefo` estimate", {"method": "opefo"}),
            DemoMethod(
                "opefo_param",
                "OPEFO, exact parameter-space flow (`param`)",
                {"method": "opefo", "entropy_flow_estimate": "param"},
            ),
            DemoMethod(
                "opefo_param_step",
                "OPEFO, `param`, whole AdamW step balanced (`opefo_balance='step'`)",
                {"method": "opefo", "entropy_flow_estimate": "param", "opefo_balance": "step"},
            ),
            DemoMethod(
                "entropy_reg",
                f"GRPO + entropy bonus (entropy_coef={entropy_coef:g})",
                {"method": "grpo", "entropy_coef": entropy_coef},
            ),
            DemoMethod(
                "opefo_full",
                "OPEFO, exact tabular estimate (`full`)",
                {"method": "opefo", "entropy_flow_estimate": "full"},
            ),
            DemoMethod("clip_cov", "Clip-Cov", {"method": "clip_cov"}),
            DemoMethod("par", "PAR (entropy-guided positive-advantage reweighting)", {"method": "par"}),
        )
    }


METHOD_NAMES = tuple(demo_methods(0.0))


def _setting(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


def _task_setting(help: str):
    return field(default=None, metadata={"help": f"{help} Default: the task's (see TASKS)."})


@dataclass
class DemoSettings:
    """Everything that determines the demo's results (saved to ``summary.json``); ``python -m opefo_trl.demo --help``
    lists them. Settings left at None take the task's value (``TASKS[task].defaults``).

    Example:
        >>> settings = DemoSettings(methods=["grpo", "opefo"], seeds=[0, 1], steps=30)
        >>> settings.hidden_size, settings.steps, DemoSettings(quick=True).seeds, DemoSettings(quick=True).steps
        (64, 30, [0], 20)
    """

    output_dir: str = _setting("runs/demo", "Where models, runs, curves.png and summary.md go.")
    task: str = _setting("digit_sum", f"Synthetic task: {', '.join(TASKS)}.")
    quick: bool = _setting(
        False,
        "CI mode: by default one seed, half the task's warm start and a third of its RL steps (values given "
        "explicitly are kept).",
    )
    methods: list[str] = field(
        default_factory=lambda: ["grpo", "opefo", "opefo_param", "entropy_reg"],
        metadata={"help": f"Methods to compare, among {list(METHOD_NAMES)}."},
    )
    seeds: list[int] | None = field(
        default=None,
        metadata={"help": "RL seeds; every method runs with each of them. Default: 0 1 2 (0 with --quick)."},
    )
    hidden_size: int | None = _task_setting("Hidden size of the tiny Qwen2 model.")
    num_layers: int | None = _task_setting("Layers of the tiny Qwen2 model.")
    warm_start_steps: int | None = _task_setting("Supervised warm-start steps (AdamW, linear decay).")
    warm_start_batch_size: int = _setting(64, "Examples per warm-start step.")
    warm_start_learning_rate: float = _setting(3e-3, "Peak learning rate of the warm start.")
    warm_start_seed: int = _setting(0, "Seed of the random model and of the warm-start data (shared by all runs).")
    steps: int | None = _task_setting("RL optimizer steps per run (each on a fresh rollout batch: strict on-policy).")
    prompts_per_step: int | None = _task_setting("Prompts per RL step.")
    num_generations: int = _setting(8, "Sampled completions per prompt (GRPO group size).")
    max_completion_length: int | None = _task_setting("Completion token limit.")
    learning_rate: float | None = _task_setting("RL learning rate (constant after warm-up), the same for every method.")
    warmup_steps: int = _setting(10, "RL learning-rate warm-up steps.")
    temperature: float = _setting(1.0, "Sampling temperature of the rollouts.")
    entropy_coef: float = _setting(0.01, "Entropy bonus coefficient of the `entropy_reg` method (TRL's entropy_coef).")
    eval_samples_per_prompt: int = _setting(
        16, "Samples per prompt drawn from each trained policy to count distinct right answers (0 skips it)."
    )
    threads: int = _setting(
        1,
        "torch CPU threads. The matrices are tiny, so a second thread gains little, and on shared cores two OpenMP "
        "threads were measured about 20x slower than one (6 RL steps: 38 s vs 1.6 s).",
    )

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"Unknown task {self.task!r}; choose one of {list(TASKS)}.")
        defaults = {**TASKS[self.task].defaults, "seeds": [0, 1, 2]}
        if self.quick:
            defaults.update(
                seeds=[0], warm_start_steps=defaults["warm_start_steps"] // 2, steps=max(2, defaults["steps"] // 3)
            )
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for a setting that cannot work, before any model is built or trained."""
        unknown = [m for m in self.methods if m not in METHOD_NAMES]
        if unknown:
            raise ValueError(f"Unknown method(s) {unknown}; choose from {list(METHOD_NAMES)}.")
        if not self.methods:
            raise ValueError("No methods given; e.g. --methods grpo opefo.")
        if not self.seeds:
            raise ValueError("No seeds given; e.g. --seeds 0 1 2.")
        for name in ("methods", "seeds"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"--{name} has duplicates: {values}.")
        positive = (
            "steps", "warm_start_batch_size", "prompts_per_step", "max_completion_length", "hidden_size",
            "num_layers", "threads",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.warm_start_steps < 0 or self.eval_samples_per_prompt < 0:
            raise ValueError("warm_start_steps and eval_samples_per_prompt must be >= 0.")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (GRPO needs a group to compare), got {self.num_generations}."
            )
        targets = len(TASKS[self.task].targets())
        if self.prompts_per_step > targets:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) exceeds the {targets} prompts of task {self.task!r}: "
                "TRL draws distinct prompts within a step."
            )


# ---------------------------------------------------------------------------------------------------------------------
# Tiny model and supervised warm start
# ---------------------------------------------------------------------------------------------------------------------

WARM_START_MARKER = "demo_warm_start.json"
_WARM_START_KEYS = (
    "task", "hidden_size", "num_layers", "warm_start_steps", "warm_start_batch_size", "warm_start_learning_rate",
    "warm_start_seed",
)  # fmt: skip


def warm_start(output_dir: str, settings: DemoSettings, log=print) -> str:
    """Build the tiny model and fit it to the task for ``warm_start_steps`` supervised steps; return its path.

    The loss is the completion tokens' cross-entropy (prompt tokens masked; the answer followed by the end-of-turn
    token, as TRL generates), AdamW with a short warm-up and a linear decay. A finished warm start with the same
    settings in ``output_dir/models/warm_start-<task>`` is reused.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opefo_trl.tiny import build_tiny_model

    task = TASKS[settings.task]
    path = os.path.join(output_dir, "models", f"warm_start-{task.name}")
    marker = os.path.join(path, WARM_START_MARKER)
    key = {k: getattr(settings, k) for k in _WARM_START_KEYS}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f).get("settings") == key:
                log(f"warm start: reusing {path}")
                return path

    base = build_tiny_model(
        os.path.join(output_dir, "models", f"base-{settings.hidden_size}x{settings.num_layers}"),
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        seed=settings.warm_start_seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(settings.warm_start_seed)
    steps, batch_size = settings.warm_start_steps, settings.warm_start_batch_size
    examples = task.warm_start_answers(steps * batch_size, settings.warm_start_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.warm_start_learning_rate, weight_decay=0.0)
    warmup = max(1, steps // 15)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1.0 - s / max(1, steps))
    )
    log(f"warm start: {steps} supervised steps x {batch_size} examples on the {task.name} task ...")
    start, loss_value = time.perf_counter(), float("nan")
    model.train()
    for step in range(steps):
        batch = examples[step * batch_size : (step + 1) * batch_size]
        prompts = render_prompts(tokenizer, [task.prompt(target) for target, _ in batch])
        answers = [
            tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, answer in batch
        ]
        length = max(len(p) + len(c) for p, c in zip(prompts, answers, strict=True))
        input_ids = torch.full((len(batch), length), tokenizer.pad_token_id)
        labels = torch.full((len(batch), length), -100)
        attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
        for i, (p, c) in enumerate(zip(prompts, answers, strict=True)):
            input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            attention_mask[i, : len(p) + len(c)] = 1
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"  warm-start step {step + 1}/{steps}: loss {loss_value:.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(marker, "w") as f:
        json.dump({"settings": key, "final_loss": loss_value, "seconds": time.perf_counter() - start}, f)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Diversity of a policy: distinct right answers per prompt
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class SampleStats:
    """Accuracy and answer diversity of a policy sampled ``samples_per_prompt`` times per prompt (temperature 1)."""

    accuracy: float
    distinct_correct_per_prompt: float
    samples_per_prompt: int


def sample_policy(model, tokenizer, task: DemoTask, samples_per_prompt: int, max_new_tokens: int, seed: int):
    """Sample the policy on every prompt of the task; the fraction of right answers and distinct right answers."""
    import torch

    targets = task.targets()
    prompt_ids = render_prompts(tokenizer, [task.prompt(t) for t in targets])
    batch = tokenizer.pad({"input_ids": prompt_ids}, padding=True, padding_side="left", return_tensors="pt")
    batch = {k: v.to(model.device) for k, v in batch.items()}
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        output = model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=samples_per_prompt,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    model.train(was_training)
    answers = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    correct, distinct = 0, []
    for i, target in enumerate(targets):
        keys = [task.answer_key(a, target) for a in answers[i * samples_per_prompt : (i + 1) * samples_per_prompt]]
        right = [k for k in keys if k is not None]
        correct += len(right)
        distinct.append(len(set(right)))
    return SampleStats(
        accuracy=correct / len(answers),
        distinct_correct_per_prompt=sum(distinct) / len(distinct),
        samples_per_prompt=samples_per_prompt,
    )


# ---------------------------------------------------------------------------------------------------------------------
# One RL run
# ---------------------------------------------------------------------------------------------------------------------


def build_config(method: DemoMethod, seed: int, run_dir: str, settings: DemoSettings):
    """The ``OPEFOConfig`` of one run: identical budget for every method, the method's own fields on top; every
    step audited (the measured entropy change of the update)."""
    from opefo_trl import OPEFOConfig

    return OPEFOConfig(
        output_dir=run_dir,
        seed=seed,
        data_seed=seed,
        max_steps=settings.steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        gradient_accumulation_steps=1,
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
        **method.config,
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
    """What the summary needs from one run."""

    method: str
    seed: int
    run_dir: str
    steps: int
    seconds: float
    entropy_start: float
    entropy_final: float
    entropy_min: float
    reward_start: float
    reward_final: float
    lambda_mean: float
    lambda_abs_mean: float
    net_over_gross_mean: float
    measured_delta_mean: float
    predicted_delta_mean: float | None = None
    regime_warning: str | None = None
    accuracy: float | None = None
    distinct_correct_per_prompt: float | None = None


def _metric(history: list[dict], key: str) -> list[float]:
    values = [row.get(key) for row in history]
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


#: "final" values in the summary are means over this many last logged steps (single steps are noisy).
FINAL_WINDOW = 5


def summarize_history(history: list[dict]) -> dict[str, float]:
    """Start/final/min entropy, start/final reward, mean lambda* (and of |lambda*|, = mean |net| / gross), and the
    mean measured (and predicted) entropy change per step of one run's ``log_history``."""
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
    predicted = _metric(history, "entropy_flow/predicted_delta")
    return {
        "entropy_start": entropy[0],
        "entropy_final": statistics.fmean(entropy[-FINAL_WINDOW:]),
        "entropy_min": min(entropy),
        "reward_start": reward[0],
        "reward_final": statistics.fmean(reward[-FINAL_WINDOW:]),
        "lambda_mean": statistics.fmean(_metric(history, "entropy_flow/lambda")),
        "lambda_abs_mean": statistics.fmean(abs(x) for x in _metric(history, "entropy_flow/lambda")),
        "net_over_gross_mean": statistics.fmean(net_over_gross) if net_over_gross else 0.0,
        "measured_delta_mean": statistics.fmean(_metric(history, "entropy_flow/measured_delta")),
        "predicted_delta_mean": statistics.fmean(predicted) if predicted else None,
    }


def train_one(
    method: DemoMethod, seed: int, model_path: str, run_dir: str, settings: DemoSettings, log=print
) -> RunResult:
    """Train one method for one seed from ``model_path``; save ``trainer_state.json`` in ``run_dir``."""
    import warnings

    from transformers import PrinterCallback

    from opefo_trl import OPEFOTrainer

    task = TASKS[settings.task]
    args = build_config(method, seed, run_dir, settings)
    label = f"{method.name} seed {seed}"
    start = time.perf_counter()
    trainer = OPEFOTrainer(
        model=model_path,
        reward_funcs=task.reward,
        args=args,
        train_dataset=task.dataset(),
        callbacks=[_progress_callback(label, settings.steps, log)],
    )
    # With disable_tqdm the Trainer prints every log dict; our progress lines replace both.
    trainer.remove_callback(PrinterCallback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    guard = next((str(w.message) for w in caught if "averaged over the last" in str(w.message)), None)
    if guard:
        log(f"  {label}: regime guard: {guard}")
    trainer.save_state()
    seconds = time.perf_counter() - start
    result = RunResult(
        method=method.name,
        seed=seed,
        run_dir=run_dir,
        steps=trainer.state.global_step,
        seconds=seconds,
        regime_warning=guard,
        **summarize_history(trainer.state.log_history),
    )
    if settings.eval_samples_per_prompt:
        stats = sample_policy(
            trainer.model,
            trainer.processing_class,
            task,
            settings.eval_samples_per_prompt,
            settings.max_completion_length,
            seed=seed,
        )
        result.accuracy = stats.accuracy
        result.distinct_correct_per_prompt = stats.distinct_correct_per_prompt
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Summary table
# ---------------------------------------------------------------------------------------------------------------------


def _mean_std(values: Sequence[float | None], fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    spread_fmt = fmt.lstrip("+")  # a spread has no sign
    return f"{format(statistics.fmean(values), fmt)} ± {format(statistics.stdev(values), spread_fmt)}"


def summary_markdown(results: Sequence[RunResult], settings: DemoSettings, baseline: SampleStats | None) -> str:
    """A markdown table, one row per method, mean ± sample std over seeds."""
    methods = demo_methods(settings.entropy_coef)
    task = TASKS[settings.task]
    seeds = sorted({r.seed for r in results})
    lines = [
        f"# OPEFO demo: {task.description}",
        "",
        f"Tiny Qwen2 (hidden {settings.hidden_size}, {settings.num_layers} layers), {settings.warm_start_steps} "
        f"supervised warm-start steps, then {settings.steps} strict on-policy RL steps of {settings.prompts_per_step} "
        f"prompts x {settings.num_generations} samples, lr {settings.learning_rate:g}, temperature "
        f"{settings.temperature:g}; seeds {seeds}. Values are mean ± std over seeds. 'final' = mean of the last "
        f"{FINAL_WINDOW} logged steps. Entropy is TRL's mean token entropy (nats) of the sampled completions. "
        "|λ*| = mean over steps of |net| / gross first-order flow (the `opefo` estimate, or the run's own). "
        "'measured ΔH' = mean over steps of the change of the batch's mean token entropy that the update made "
        "(re-scored after it). 'right answers' = fraction of right answers and distinct right answers per prompt "
        f"among {settings.eval_samples_per_prompt} samples of the trained policy (temperature 1).",
        "",
        "| method | entropy start → final (min) | reward start → final | mean λ* | mean \\|λ*\\| | "
        "measured ΔH / step | predicted ΔH / step | right answers (sampled) | distinct right | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    if baseline is not None:
        lines.append(
            f"| warm start (before RL) | | | | | | | {baseline.accuracy:.3f} | "
            f"{baseline.distinct_correct_per_prompt:.2f} | |"
        )
    for name in dict.fromkeys(r.method for r in results):
        rows = [r for r in results if r.method == name]

        def spread(attribute: str, fmt: str) -> str:
            return _mean_std([getattr(r, attribute) for r in rows], fmt)  # noqa: B023 (used within the iteration)

        cells = [
            f"{name} ({methods[name].description})",
            f"{spread('entropy_start', '.3f')} → {spread('entropy_final', '.3f')} ({spread('entropy_min', '.3f')})",
            f"{spread('reward_start', '.2f')} → {spread('reward_final', '.2f')}",
            _mean_std([r.lambda_mean for r in rows], "+.3f"),
            _mean_std([r.lambda_abs_mean for r in rows], ".3f"),
            _mean_std([r.measured_delta_mean for r in rows], "+.2e"),
            _mean_std([r.predicted_delta_mean for r in rows], "+.2e"),
            _mean_std([r.accuracy for r in rows], ".3f"),
            _mean_std([r.distinct_correct_per_prompt for r in rows], ".2f"),
            _mean_std([r.seconds for r in rows], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    warned = sorted({r.method for r in results if r.regime_warning})
    lines += [
        "",
        f"Regime guard (|λ*| averaged over 20 steps > 0.1) fired for: {', '.join(warned) if warned else 'no run'}.",
        "",
        "Curves: `curves.png` (mean ± std over seeds). Per-run logs: `runs/<method>-seed<k>/trainer_state.json`.",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------------


def run_demo(output_dir: str, settings: DemoSettings, log=print) -> dict[str, str]:
    """Run the whole demo; return the paths of the figure, the markdown summary and the json summary.

    Settings and every run's ``OPEFOConfig`` are checked before the warm start. torch's thread count is set to
    ``settings.threads`` for the demo and restored afterwards.
    """
    import torch

    settings.validate()
    methods = demo_methods(settings.entropy_coef)
    for name in settings.methods:
        build_config(methods[name], settings.seeds[0], os.path.join(output_dir, "runs", "_check"), settings)
    os.makedirs(output_dir, exist_ok=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return _run_demo(output_dir, settings, methods, log)
    finally:
        torch.set_num_threads(previous_threads)


def _run_demo(output_dir: str, settings: DemoSettings, methods: dict[str, DemoMethod], log) -> dict[str, str]:
    from opefo_trl.plotting import load_runs, plot_runs

    task = TASKS[settings.task]
    total_start = time.perf_counter()
    model_path = warm_start(output_dir, settings, log=log)
    baseline = None
    if settings.eval_samples_per_prompt:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        baseline = sample_policy(
            AutoModelForCausalLM.from_pretrained(model_path),
            AutoTokenizer.from_pretrained(model_path),
            task,
            settings.eval_samples_per_prompt,
            settings.max_completion_length,
            seed=0,
        )
        log(
            f"warm-start policy: {baseline.accuracy:.3f} right answers, {baseline.distinct_correct_per_prompt:.2f} "
            f"distinct right answers per prompt (of {baseline.samples_per_prompt} samples)"
        )

    results: list[RunResult] = []
    total = len(settings.methods) * len(settings.seeds)
    for seed in settings.seeds:
        for name in settings.methods:
            run_dir = os.path.join(output_dir, "runs", f"{name}-seed{seed}")
            description = methods[name].description
            log(f"[{len(results) + 1}/{total}] {name} ({description}), seed {seed}, {settings.steps} steps")
            result = train_one(methods[name], seed, model_path, run_dir, settings, log=log)
            results.append(result)
            extra = ""
            if result.distinct_correct_per_prompt is not None:
                extra = f", {result.distinct_correct_per_prompt:.2f} distinct right answers/prompt"
            log(
                f"[{len(results)}/{total}] {name} seed {seed} done in {result.seconds:.0f} s: entropy "
                f"{result.entropy_start:.3f} -> {result.entropy_final:.3f} (min {result.entropy_min:.3f}), reward "
                f"{result.reward_start:.2f} -> {result.reward_final:.2f}, mean |lambda*| {result.lambda_abs_mean:.4f}, "
                f"measured dH/step {result.measured_delta_mean:+.2e}{extra}"
            )

    runs = load_runs([r.run_dir for r in results])
    groups = {run.label: result.method for run, result in zip(runs, results, strict=True)}
    figure = plot_runs(
        runs,
        os.path.join(output_dir, "curves.png"),
        groups=groups,
        smoothing=0.6,
        title=f"{task.name} task, tiny Qwen2, {len(settings.seeds)} seed(s) (EMA-smoothed 0.6; band: ±1 std)",
    )
    summary_md = os.path.join(output_dir, "summary.md")
    with open(summary_md, "w") as f:
        f.write(summary_markdown(results, settings, baseline))
    summary_json = os.path.join(output_dir, "summary.json")
    with open(summary_json, "w") as f:
        json.dump(
            {
                "settings": asdict(settings),
                "warm_start": asdict(baseline) if baseline else None,
                "runs": [asdict(r) for r in results],
                "total_seconds": time.perf_counter() - total_start,
            },
            f,
            indent=2,
        )
    return {"figure": figure.path, "summary_md": summary_md, "summary_json": summary_json}


def main(argv: list[str] | None = None) -> int:
    from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error

    parser = build_parser(
        [DemoSettings],
        prog="python -m opefo_trl.demo",
        description="Train strict on-policy GRPO, OPEFO and baselines on a synthetic task on CPU; plot and tabulate "
        "token entropy, reward, the entropy flow and the measured entropy change of every update.",
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
