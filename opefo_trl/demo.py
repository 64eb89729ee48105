"""GRPO vs OPEFO (and baselines) side by side on a laptop CPU: entropy collapse and entropy-flow balance.

Runs offline, with nothing downloaded:

1. builds a tiny Qwen2-shaped model with the arithmetic tokenizer of ``opefo_trl.tiny``;
2. warm-starts it with a few hundred supervised steps on the synthetic sum task of ``opefo_trl.synthetic``
   ("Solve 17 = ? + ?": many correct answers per prompt), so the RL start policy is partly right and spreads its
   probability over many answers; the result is cached in ``OUTPUT_DIR/models/warm_start`` and shared by every run;
3. trains each method for each seed from those weights with ``OPEFOTrainer`` (TRL's GRPO code path), with identical
   budgets, writing ``OUTPUT_DIR/runs/<method>-seed<k>/trainer_state.json``;
4. samples each trained policy and counts the distinct correct answers it gives per prompt (diversity);
5. writes ``OUTPUT_DIR/curves.png`` (entropy, reward, lambda*, entropy flows; mean +- std over seeds),
   ``OUTPUT_DIR/summary.md`` (a table) and ``OUTPUT_DIR/summary.json``.

Usage:
    python -m opefo_trl.demo --output-dir runs/demo                 # 3 methods x 3 seeds (about 5-6 min on 2 cores)
    python -m opefo_trl.demo --output-dir runs/demo-quick --quick   # 1 seed, fewer steps (about 1 min)
    python -m opefo_trl.demo --output-dir runs/x --methods grpo opefo clip_cov par --seeds 0 1 2 3 4

Methods: ``grpo`` (strict on-policy GRPO), ``opefo``, ``entropy_reg`` (GRPO + TRL's ``entropy_coef``),
``opefo_full`` (OPEFO with ``entropy_flow_estimate="full"``), ``clip_cov``, ``par`` (entropy-guided
positive-advantage reweighting). Every run logs the entropy-flow diagnostics (the lambda* OPEFO would use), so the
lambda* panel is meaningful for the baselines too.

On this tiny model lambda* is large (about +0.6 to +0.9, against the paper's ~1e-3 on a 7B model), so OPEFO's
reweighting is far from a small correction here; see the README for what the demo shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from opefo_trl.model_io import render_prompts  # noqa: E402
from opefo_trl.synthetic import (  # noqa: E402
    build_sum_dataset,
    correct_sum_reward,
    default_targets,
    is_correct_sum,
    parse_sum,
    sample_warm_start_examples,
    sum_prompt,
)

#: The metrics every run must log; the demo checks them after each run instead of plotting empty panels.
REQUIRED_METRICS = (
    "entropy",
    "reward",
    "entropy_flow/lambda",
    "entropy_flow/increase",
    "entropy_flow/decrease",
    "entropy_flow/net",
)


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
            DemoMethod("opefo", "OPEFO (entropy-flow balancing, lambda*)", {"method": "opefo"}),
            DemoMethod(
                "entropy_reg",
                f"GRPO + entropy bonus (entropy_coef={entropy_coef:g})",
                {"method": "grpo", "entropy_coef": entropy_coef},
            ),
            DemoMethod(
                "opefo_full",
                "OPEFO with the exact first-order flow estimate",
                {"method": "opefo", "entropy_flow_estimate": "full"},
            ),
            DemoMethod("clip_cov", "Clip-Cov", {"method": "clip_cov"}),
            DemoMethod("par", "PAR (entropy-guided positive-advantage reweighting)", {"method": "par"}),
        )
    }


METHOD_NAMES = tuple(demo_methods(0.0))


def _setting(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class DemoSettings:
    """Everything that determines the demo's results (saved to ``summary.json``).

    Example:
        >>> settings = DemoSettings(methods=["grpo", "opefo"], seeds=[0, 1], steps=60)
        >>> settings.validate()
        >>> DemoSettings.quick().seeds
        [0]
    """

    methods: list[str] = field(
        default_factory=lambda: ["grpo", "opefo", "entropy_reg"],
        metadata={"help": "Methods to compare (names of `demo_methods`)."},
    )
    seeds: list[int] = field(
        default_factory=lambda: [0, 1, 2], metadata={"help": "RL seeds; every method runs with each of them."}
    )
    min_target: int = _setting(6, "Smallest target t of 'Solve t = ? + ?' (t - 1 correct answers).")
    max_target: int = _setting(15, "Largest target t.")
    hidden_size: int = _setting(128, "Hidden size of the tiny Qwen2 model.")
    num_layers: int = _setting(4, "Layers of the tiny Qwen2 model.")
    warm_start_steps: int = _setting(300, "Supervised warm-start steps (AdamW, linear decay).")
    warm_start_batch_size: int = _setting(64, "Examples per warm-start step.")
    warm_start_learning_rate: float = _setting(3e-3, "Peak learning rate of the warm start.")
    warm_start_wrong_fraction: float = _setting(
        0.0, "Fraction of warm-start answers whose second addend is deliberately off by 1-3."
    )
    warm_start_seed: int = _setting(0, "Seed of the random model and of the warm-start data (shared by all runs).")
    steps: int = _setting(120, "RL optimizer steps per run (each on a fresh rollout batch: strict on-policy).")
    prompts_per_step: int = _setting(8, "Prompts per RL step.")
    num_generations: int = _setting(8, "Sampled completions per prompt (GRPO group size).")
    max_completion_length: int = _setting(
        6, "Completion token limit; '12 + 13' plus eos is 6 tokens, and longer answers are wrong anyway."
    )
    learning_rate: float = _setting(3e-4, "RL learning rate (constant after warm-up), the same for every method.")
    warmup_steps: int = _setting(10, "RL learning-rate warm-up steps.")
    temperature: float = _setting(1.0, "Sampling temperature of the rollouts.")
    entropy_coef: float = _setting(0.01, "Entropy bonus coefficient of the `entropy_reg` method (TRL's entropy_coef).")
    eval_samples_per_prompt: int = _setting(
        16, "Samples per prompt drawn from each trained policy to count distinct correct answers (0 skips it)."
    )
    threads: int = _setting(
        1,
        "torch CPU threads. The matrices are tiny, so a second thread gains little, and on shared cores two OpenMP "
        "threads were measured about 20x slower than one (6 RL steps: 38 s vs 1.6 s).",
    )

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
            "steps",
            "warm_start_batch_size",
            "prompts_per_step",
            "max_completion_length",
            "hidden_size",
            "num_layers",
            "threads",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.warm_start_steps < 0 or self.eval_samples_per_prompt < 0:
            raise ValueError("warm_start_steps and eval_samples_per_prompt must be >= 0.")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (GRPO needs a group to compare), got {self.num_generations}."
            )
        if self.min_target < 2:
            raise ValueError(f"min_target must be >= 2 (a sum of two positive numbers), got {self.min_target}.")
        default_targets(self.min_target, self.max_target)

    @classmethod
    def quick(cls, **overrides) -> DemoSettings:
        """The CI setting: one seed, a shorter warm start and fewer RL steps (under 2 minutes on 2 CPU cores)."""
        values = dict(seeds=[0], warm_start_steps=200, steps=30)
        values.update(overrides)
        return cls(**values)


# ---------------------------------------------------------------------------------------------------------------------
# Tiny model and supervised warm start
# ---------------------------------------------------------------------------------------------------------------------

WARM_START_MARKER = "demo_warm_start.json"


def _warm_start_key(settings: DemoSettings) -> dict:
    keys = (
        "min_target",
        "max_target",
        "hidden_size",
        "num_layers",
        "warm_start_steps",
        "warm_start_batch_size",
        "warm_start_learning_rate",
        "warm_start_wrong_fraction",
        "warm_start_seed",
    )
    return {k: getattr(settings, k) for k in keys}


def _encode_example(tokenizer, target: int, answer: str) -> tuple[list[int], list[int]]:
    """Prompt ids (chat template with the assistant header) and completion ids (answer + eos), as TRL generates."""
    (prompt_ids,) = render_prompts(tokenizer, [sum_prompt(target)])
    completion_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids


def warm_start(output_dir: str, settings: DemoSettings, log=print) -> str:
    """Build the tiny model and fit it to the sum task for ``warm_start_steps`` supervised steps; return its path.

    The loss is the completion tokens' cross-entropy (prompt tokens masked), AdamW with a short warm-up and a linear
    decay. A finished warm start with the same settings in ``output_dir/models/warm_start`` is reused.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opefo_trl.tiny import build_tiny_model

    path = os.path.join(output_dir, "models", "warm_start")
    marker = os.path.join(path, WARM_START_MARKER)
    key = _warm_start_key(settings)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f).get("settings") == key:
                log(f"warm start: reusing {path}")
                return path

    base = build_tiny_model(
        os.path.join(output_dir, "models", "base"),
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        seed=settings.warm_start_seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(settings.warm_start_seed)
    steps, batch_size = settings.warm_start_steps, settings.warm_start_batch_size
    examples = sample_warm_start_examples(
        steps * batch_size,
        targets=default_targets(settings.min_target, settings.max_target),
        wrong_fraction=settings.warm_start_wrong_fraction,
        seed=settings.warm_start_seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.warm_start_learning_rate, weight_decay=0.0)
    warmup = max(1, steps // 15)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1.0 - s / max(1, steps))
    )
    log(f"warm start: {steps} supervised steps x {batch_size} examples on the sum task ...")
    start, loss_value = time.perf_counter(), float("nan")
    model.train()
    for step in range(steps):
        batch = examples[step * batch_size : (step + 1) * batch_size]
        encoded = [_encode_example(tokenizer, e.target, e.answer) for e in batch]
        length = max(len(p) + len(c) for p, c in encoded)
        input_ids = torch.full((len(encoded), length), tokenizer.pad_token_id)
        labels = torch.full((len(encoded), length), -100)
        attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
        for i, (p, c) in enumerate(encoded):
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
# Diversity of a policy: distinct correct answers per prompt
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class SampleStats:
    """Accuracy and answer diversity of a policy sampled ``samples_per_prompt`` times per prompt (temperature 1)."""

    accuracy: float
    distinct_correct_per_prompt: float
    samples_per_prompt: int


def sample_policy(model, tokenizer, targets: Sequence[int], samples_per_prompt: int, max_new_tokens: int, seed: int):
    """Sample the policy on every target and measure accuracy and distinct correct answers per prompt."""
    import torch

    prompt_ids = render_prompts(tokenizer, [sum_prompt(t) for t in targets])
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
        group = answers[i * samples_per_prompt : (i + 1) * samples_per_prompt]
        right = {parse_sum(a) for a in group if is_correct_sum(a, target)}  # '3 + 4' and '3+4' are one answer
        correct += sum(is_correct_sum(a, target) for a in group)
        distinct.append(len(right))
    return SampleStats(
        accuracy=correct / len(answers),
        distinct_correct_per_prompt=sum(distinct) / len(distinct),
        samples_per_prompt=samples_per_prompt,
    )


# ---------------------------------------------------------------------------------------------------------------------
# One RL run
# ---------------------------------------------------------------------------------------------------------------------


def build_config(method: DemoMethod, seed: int, run_dir: str, settings: DemoSettings):
    """The ``OPEFOConfig`` of one run: identical budget for every method, the method's own fields on top."""
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
    net_flow_mean: float
    accuracy: float | None = None
    distinct_correct_per_prompt: float | None = None


def _metric(history: list[dict], key: str) -> list[float]:
    values = [row.get(key) for row in history]
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


#: "final" values in the summary are means over this many last logged steps (single steps are noisy).
FINAL_WINDOW = 5


def summarize_history(history: list[dict]) -> dict[str, float]:
    """Start/final/min entropy, start/final reward, mean lambda* and net flow of one run's ``log_history``."""
    missing = [k for k in REQUIRED_METRICS if not _metric(history, k)]
    if missing:
        raise RuntimeError(
            f"The run logged no {missing}; OPEFOTrainer should log them every step with entropy_flow_diagnostics=True."
        )
    entropy, reward = _metric(history, "entropy"), _metric(history, "reward")
    return {
        "entropy_start": entropy[0],
        "entropy_final": statistics.fmean(entropy[-FINAL_WINDOW:]),
        "entropy_min": min(entropy),
        "reward_start": reward[0],
        "reward_final": statistics.fmean(reward[-FINAL_WINDOW:]),
        "lambda_mean": statistics.fmean(_metric(history, "entropy_flow/lambda")),
        "net_flow_mean": statistics.fmean(_metric(history, "entropy_flow/net")),
    }


def train_one(method: DemoMethod, seed: int, model_path: str, run_dir: str, settings: DemoSettings, log=print):
    """Train one method for one seed from ``model_path``; save ``trainer_state.json`` in ``run_dir``."""
    from transformers import PrinterCallback

    from opefo_trl import OPEFOTrainer

    args = build_config(method, seed, run_dir, settings)
    label = f"{method.name} seed {seed}"
    start = time.perf_counter()
    trainer = OPEFOTrainer(
        model=model_path,
        reward_funcs=correct_sum_reward,
        args=args,
        train_dataset=build_sum_dataset(default_targets(settings.min_target, settings.max_target)),
        callbacks=[_progress_callback(label, settings.steps, log)],
    )
    # With disable_tqdm the Trainer prints every log dict; our progress lines replace both.
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    trainer.save_state()
    seconds = time.perf_counter() - start
    result = RunResult(
        method=method.name,
        seed=seed,
        run_dir=run_dir,
        steps=trainer.state.global_step,
        seconds=seconds,
        **summarize_history(trainer.state.log_history),
    )
    if settings.eval_samples_per_prompt:
        stats = sample_policy(
            trainer.model,
            trainer.processing_class,
            default_targets(settings.min_target, settings.max_target),
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
    seeds = sorted({r.seed for r in results})
    lines = [
        "# OPEFO demo: synthetic sum task (Solve t = ? + ?)",
        "",
        f"Tiny Qwen2 (hidden {settings.hidden_size}, {settings.num_layers} layers), {settings.warm_start_steps} "
        f"supervised warm-start steps, then {settings.steps} strict on-policy RL steps of {settings.prompts_per_step} "
        f"prompts x {settings.num_generations} samples, lr {settings.learning_rate:g}, temperature "
        f"{settings.temperature:g}; seeds {seeds}. Values are mean ± std over seeds. 'final' = mean of the last "
        f"{FINAL_WINDOW} logged steps. Entropy is TRL's mean token entropy (nats) of the sampled completions. "
        f"'distinct correct' = distinct correct answers per prompt among {settings.eval_samples_per_prompt} samples "
        "of the trained policy (temperature 1).",
        "",
        "| method | entropy start | entropy final | entropy min | reward start | reward final | mean lambda* | "
        "accuracy (sampled) | distinct correct | steps | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if baseline is not None:
        lines.append(
            f"| warm start (before RL) | | | | | | | {baseline.accuracy:.3f} | "
            f"{baseline.distinct_correct_per_prompt:.2f} | 0 | |"
        )
    for name in dict.fromkeys(r.method for r in results):
        rows = [r for r in results if r.method == name]
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{name} ({methods[name].description})",
                    _mean_std([r.entropy_start for r in rows], ".3f"),
                    _mean_std([r.entropy_final for r in rows], ".3f"),
                    _mean_std([r.entropy_min for r in rows], ".3f"),
                    _mean_std([r.reward_start for r in rows], ".2f"),
                    _mean_std([r.reward_final for r in rows], ".2f"),
                    _mean_std([r.lambda_mean for r in rows], "+.4f"),
                    _mean_std([r.accuracy for r in rows], ".3f"),
                    _mean_std([r.distinct_correct_per_prompt for r in rows], ".2f"),
                    _mean_std([r.steps for r in rows], ".0f"),
                    _mean_std([r.seconds for r in rows], ".0f"),
                ]
            )
            + " |"
        )
    lines += [
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

    total_start = time.perf_counter()
    model_path = warm_start(output_dir, settings, log=log)
    baseline = None
    if settings.eval_samples_per_prompt:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        baseline = sample_policy(
            AutoModelForCausalLM.from_pretrained(model_path),
            AutoTokenizer.from_pretrained(model_path),
            default_targets(settings.min_target, settings.max_target),
            settings.eval_samples_per_prompt,
            settings.max_completion_length,
            seed=0,
        )
        log(
            f"warm-start policy: accuracy {baseline.accuracy:.3f}, {baseline.distinct_correct_per_prompt:.2f} distinct "
            f"correct answers per prompt (of {baseline.samples_per_prompt} samples)"
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
                extra = f", {result.distinct_correct_per_prompt:.2f} distinct correct answers/prompt"
            log(
                f"[{len(results)}/{total}] {name} seed {seed} done in {result.seconds:.0f} s: entropy "
                f"{result.entropy_start:.3f} -> {result.entropy_final:.3f} (min {result.entropy_min:.3f}), reward "
                f"{result.reward_start:.2f} -> {result.reward_final:.2f}, mean lambda* {result.lambda_mean:+.4f}{extra}"
            )

    runs = load_runs([r.run_dir for r in results])
    groups = {run.label: result.method for run, result in zip(runs, results, strict=True)}
    figure = plot_runs(
        runs,
        os.path.join(output_dir, "curves.png"),
        groups=groups,
        smoothing=0.6,
        title=f"Synthetic sum task, tiny Qwen2, {len(settings.seeds)} seed(s) (EMA-smoothed 0.6; band: ±1 std)",
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


#: Command-line flag -> DemoSettings field (the flag's help and default come from the field).
_FLAGS = {
    "--seeds": "seeds",
    "--methods": "methods",
    "--steps": "steps",
    "--warm-start-steps": "warm_start_steps",
    "--learning-rate": "learning_rate",
    "--entropy-coef": "entropy_coef",
    "--prompts-per-step": "prompts_per_step",
    "--num-generations": "num_generations",
    "--eval-samples": "eval_samples_per_prompt",
    "--threads": "threads",
}


def build_parser() -> argparse.ArgumentParser:
    defaults, quick = DemoSettings(), DemoSettings.quick()
    parser = argparse.ArgumentParser(
        prog="python -m opefo_trl.demo",
        description="Train strict on-policy GRPO, OPEFO and baselines on a synthetic task on CPU; plot and tabulate "
        "token entropy, reward and the entropy flow.",
    )
    parser.add_argument("--output-dir", default="runs/demo", help="where models, runs, curves.png and summary.md go")
    parser.add_argument(
        "--quick", action="store_true", help="CI mode: one seed, shorter warm start and fewer steps (under 2 min)"
    )
    fields = DemoSettings.__dataclass_fields__
    for flag, name in _FLAGS.items():
        default, quick_default = getattr(defaults, name), getattr(quick, name)
        help_text = f"{fields[name].metadata['help']} Default {default}"
        help_text += f" (--quick: {quick_default})." if quick_default != default else "."
        kwargs = {"dest": name, "help": help_text}
        if name == "methods":
            kwargs.update(nargs="+", choices=METHOD_NAMES)
        elif name == "seeds":
            kwargs.update(nargs="+", type=int)
        else:
            kwargs.update(type=type(default))
        parser.add_argument(flag, **kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Keep the console to the demo's progress lines: transformers' per-load progress bars and deprecation notices
    # raised inside TRL/transformers say nothing about the demo.
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    overrides = {name: getattr(args, name) for name in _FLAGS.values() if getattr(args, name) is not None}
    settings = DemoSettings.quick(**overrides) if args.quick else DemoSettings(**overrides)
    try:
        settings.validate()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    paths = run_demo(args.output_dir, settings, log=lambda msg: print(msg, flush=True))
    print(f"\nDone in {time.perf_counter() - start:.0f} s.")
    with open(paths["summary_md"]) as f:
        print(f.read())
    print(f"figure:  {paths['figure']}\nsummary: {paths['summary_md']}\nper-run: {paths['summary_json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
