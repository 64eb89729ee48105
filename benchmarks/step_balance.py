"""What OPEFO's step balance does to the real AdamW step, against strict GRPO, measured three independent ways.

    python benchmarks/step_balance.py                                   # lr 1e-5 and 5e-6, 8 steps, float32
    python benchmarks/step_balance.py --dtype float64 --output_json step_balance.json

A tiny Qwen2 model, warm-started by a few supervised steps so that its policy is peaked (``opefo_trl.testing``), is
trained from the same weights and seed with torch AdamW (default betas 0.9 / 0.999), no gradient clipping
(``max_grad_norm`` 1e9), a constant learning rate and the audit on every step, by

- strict GRPO with the `param` diagnostics (``method="grpo"``), and
- OPEFO with the exact step balance (``entropy_flow_estimate="param"``, ``opefo_balance="step"``),

at each learning rate. Per step it reports, from the trainer's own metrics:

- ``measured``: the re-scored change of the batch's mean token entropy (``entropy_flow/measured_delta``, per-token
  differences summed in float64): every order, every term;
- ``first order``: <grad Hbar, theta_after - theta_before> of the parameters AdamW really wrote
  (``entropy_flow/step_first_order``), which does not depend on how lambda was chosen;
- ``GRPO, same batch``: the first-order change of GRPO's step on the balanced run's own batch and optimizer state
  (``opefo/step_change_unweighted``).

Step 1 starts from the same weights, seed and empty optimizer, so both methods see the same first batch; later
steps follow each method's own trajectory. If the balance is exact, the first order of the real step is ~0 and what
is left of the measured change is second order: it shrinks ~4x when the learning rate halves, where GRPO's halves.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback  # noqa: E402

from opefo_trl import OPEFOConfig, OPEFOTrainer  # noqa: E402
from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error  # noqa: E402
from opefo_trl.testing import build_tiny_model, keep_rms_norm_in_model_dtype, warm_up_tiny_model  # noqa: E402

METHODS = {"grpo": dict(method="grpo"), "step_balance": dict(method="opefo", opefo_balance="step")}
METRICS = {
    "measured": "entropy_flow/measured_delta",
    "first_order": "entropy_flow/step_first_order",
    "predicted": "entropy_flow/predicted_delta",
    "grpo_same_batch": "opefo/step_change_unweighted",
    "lambda": "opefo/lambda_applied",
}


@dataclass
class StepBalanceSettings:
    """What `step_balance.py` runs."""

    learning_rates: list[float] = field(
        default_factory=lambda: [1e-5, 5e-6], metadata={"help": "Learning rates to run (constant, AdamW)."}
    )
    steps: int = field(default=8, metadata={"help": "Optimizer steps per run."})
    dtype: str = field(
        default="float32", metadata={"help": "Weights: 'float32', or 'float64' (RMSNorm kept in float64 as well)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of both runs (they share the first batch)."})
    output_json: str | None = field(default=None, metadata={"help": "Also write the results to this JSON file."})

    def __post_init__(self):
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}.")
        if self.steps < 1 or not self.learning_rates or min(self.learning_rates) <= 0:
            raise ValueError("steps must be >= 1 and every learning rate > 0.")


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 3) for c in completions]


def run(model_path: str, method: str, lr: float, settings: StepBalanceSettings, work: str) -> dict[str, list[float]]:
    args = OPEFOConfig(
        output_dir=os.path.join(work, f"{method}-{lr:g}"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=settings.steps,
        logging_steps=1,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=1e9,
        optim="adamw_torch",
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=settings.seed,
        disable_tqdm=True,
        entropy_flow_estimate="param",
        entropy_flow_audit_steps=1,
        **METHODS[method],
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, settings.dtype))
    if settings.dtype == "float64":
        keep_rms_norm_in_model_dtype(model)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i + 2} + {3 * i + 1}?"}]} for i in range(64)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = OPEFOTrainer(
            model=model,
            processing_class=AutoTokenizer.from_pretrained(model_path),
            reward_funcs=length_reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    history = trainer.state.log_history
    return {name: [e[key] for e in history if key in e] for name, key in METRICS.items()}


def _mean(values):
    return statistics.fmean(values) if values else float("nan")


def summarize(results: dict) -> dict:
    """Per learning rate: mean |dH| and signed mean of each run's measured and first-order change, and the ratios."""
    summary = {}
    for lr, runs in results.items():
        grpo, balanced = runs["grpo"], runs["step_balance"]
        summary[lr] = {
            "grpo_mean_abs_measured": _mean([abs(x) for x in grpo["measured"]]),
            "grpo_mean_measured": _mean(grpo["measured"]),
            "balanced_mean_abs_measured": _mean([abs(x) for x in balanced["measured"]]),
            "balanced_mean_measured": _mean(balanced["measured"]),
            "balanced_mean_abs_first_order": _mean([abs(x) for x in balanced["first_order"]]),
            "grpo_same_batch_mean_abs": _mean([abs(x) for x in balanced["grpo_same_batch"]]),
            "max_first_order_over_grpo_same_batch": max(
                abs(f) / abs(g) for f, g in zip(balanced["first_order"], balanced["grpo_same_batch"], strict=True)
            ),
            "step1_measured_grpo": grpo["measured"][0],
            "step1_measured_balanced": balanced["measured"][0],
        }
    return summary


def markdown(results: dict, summary: dict) -> str:
    lines = []
    for lr, runs in results.items():
        grpo, balanced = runs["grpo"], runs["step_balance"]
        lines += [
            f"learning rate {lr}",
            "",
            "| step | GRPO measured | GRPO first order | balanced measured | balanced first order | "
            "GRPO first order, same batch | lambda |",
            "|---|---|---|---|---|---|---|",
        ]
        for i in range(len(grpo["measured"])):
            lines.append(
                f"| {i + 1} | {grpo['measured'][i]:+.3e} | {grpo['first_order'][i]:+.3e} | "
                f"{balanced['measured'][i]:+.3e} | {balanced['first_order'][i]:+.3e} | "
                f"{balanced['grpo_same_batch'][i]:+.3e} | {balanced['lambda'][i]:+.4f} |"
            )
        s = summary[lr]
        reduction = s["grpo_mean_abs_measured"] / s["balanced_mean_abs_measured"]
        lines += [
            "",
            f"mean |dH| measured: GRPO {s['grpo_mean_abs_measured']:.3e}, balanced "
            f"{s['balanced_mean_abs_measured']:.3e} ({reduction:.1f}x)"
            f"; signed means {s['grpo_mean_measured']:+.3e} vs {s['balanced_mean_measured']:+.3e}; balanced first "
            f"order / GRPO's on the same batch at most {s['max_first_order_over_grpo_same_batch']:.1e}",
            "",
        ]
    rates = sorted(results)
    if len(rates) >= 2:
        low, high = rates[0], rates[-1]
        grpo_ratio = summary[low]["step1_measured_grpo"] / summary[high]["step1_measured_grpo"]
        balanced_ratio = summary[low]["step1_measured_balanced"] / summary[high]["step1_measured_balanced"]
        lines.append(
            f"step 1 (same batch and state for every run): measured change at lr {low:g} over lr {high:g}: GRPO "
            f"{grpo_ratio:.3f} (first order: {low / high:.3f}), balanced {balanced_ratio:.3f} (second order: "
            f"{(low / high) ** 2:.3f})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser([StepBalanceSettings], prog="step_balance.py", description=__doc__)
    try:
        (settings,) = parse_options(parser, argv)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    work = tempfile.mkdtemp(prefix="opefo-step-balance-")
    model_path = warm_up_tiny_model(build_tiny_model(os.path.join(work, "tiny")), os.path.join(work, "warm"))
    results = {
        lr: {method: run(model_path, method, lr, settings, work) for method in METHODS}
        for lr in settings.learning_rates
    }
    summary = summarize(results)
    print(f"{settings.dtype}, {torch.get_num_threads()} torch threads\n")
    print(markdown(results, summary))
    if settings.output_json:
        with open(settings.output_json, "w") as f:
            json.dump({"settings": asdict(settings), "runs": results, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
