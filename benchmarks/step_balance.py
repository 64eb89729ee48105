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

What a user means by holding entropy is the policy's, not one batch's: ``held-out drift`` is the change, since the
start, of the mean token entropy of ``--held_out`` completions sampled once from the initial model on prompts no run
trains on (``--held_out_first_prompt``: by default the prompts that follow the training set's 64), re-scored in
float64 after every optimizer step (a plain float64 copy of the model, loaded once without TRL's patched forward or
head cast, given the trained parameters' values). It is measured for
GRPO, the step balance on its own batch, and the step balance on a probe of the last ``--probe_rollouts`` rollouts
(``entropy_flow_probe_rollouts``), and the step balance on a fixed probe of ``--probe_prompts`` other prompts'
completions sampled once at the start (``probe_dataset``); none of the held-out completions is in either probe.
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
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback  # noqa: E402

from opefo_trl import OPEFOConfig, OPEFOTrainer  # noqa: E402
from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error  # noqa: E402
from opefo_trl.testing import build_tiny_model, keep_rms_norm_in_model_dtype, warm_up_tiny_model  # noqa: E402

STEP_BALANCE = dict(method="opefo", opefo_balance="step")
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
    probe_rollouts: int = field(
        default=4, metadata={"help": "entropy_flow_probe_rollouts of the probe-balanced run (0: no such run)."}
    )
    held_out: int = field(default=64, metadata={"help": "Held-out completions whose entropy drift is measured."})
    probe_prompts: int = field(
        default=64,
        metadata={
            "help": "Prompts of the fixed probe (OPEFOTrainer's probe_dataset; 4 completions each) of the "
            "fixed-probe-balanced run, from prompt 128 on (0: no such run)."
        },
    )
    held_out_first_prompt: int = field(
        default=64,
        metadata={"help": "Index of the first held-out prompt (4 completions each); the runs train on prompts 0..63."},
    )
    output_json: str | None = field(default=None, metadata={"help": "Also write the results to this JSON file."})

    def __post_init__(self):
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}.")
        if self.steps < 1 or not self.learning_rates or min(self.learning_rates) <= 0:
            raise ValueError("steps must be >= 1 and every learning rate > 0.")
        if self.probe_rollouts < 0 or self.probe_rollouts == 1 or self.held_out < 4 or self.held_out % 4:
            raise ValueError("probe_rollouts must be 0 or >= 2, and held_out a positive multiple of 4.")
        if self.held_out_first_prompt < TRAINING_PROMPTS:
            raise ValueError(f"held_out_first_prompt must be >= {TRAINING_PROMPTS}: prompts below it are trained on.")
        probe = range(FIRST_PROBE_PROMPT, FIRST_PROBE_PROMPT + self.probe_prompts)
        if self.probe_prompts < 0 or set(probe) & set(
            range(self.held_out_first_prompt, self.held_out_first_prompt + self.held_out // 4)
        ):
            raise ValueError(
                f"probe_prompts must be >= 0, and the probe's prompts ({FIRST_PROBE_PROMPT} on) disjoint from the "
                "held-out ones."
            )

    def methods(self) -> dict[str, dict]:
        methods = {"grpo": dict(method="grpo"), "step_balance": STEP_BALANCE}
        if self.probe_rollouts:
            methods["probe_balance"] = {**STEP_BALANCE, "entropy_flow_probe_rollouts": self.probe_rollouts}
        if self.probe_prompts:
            methods["fixed_probe_balance"] = STEP_BALANCE
        return methods


#: The runs' data set is prompts 0 .. TRAINING_PROMPTS - 1; a fixed probe's start at FIRST_PROBE_PROMPT.
TRAINING_PROMPTS, FIRST_PROBE_PROMPT = 64, 128


def prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {i + 2} + {3 * i + 1}?"}]


@dataclass
class HeldOut:
    """Completions sampled once from the initial model on held-out prompts, and their mean token entropy in float64
    under any later parameters."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    prompt_length: int
    #: A plain float64 copy of the model (RMSNorm in float64, none of TRL's patched forward, head cast or hooks),
    #: given the trained model's parameter values before each re-score.
    reference: torch.nn.Module

    @classmethod
    def sample(cls, model_path: str, count: int, first_prompt: int, seed: int) -> HeldOut:
        tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(model_path)
        texts = [
            tokenizer.apply_chat_template(prompt(first_prompt + i), tokenize=False, add_generation_prompt=True)
            for i in range(count // 4)
        ]
        prompts = tokenizer(texts, return_tensors="pt", padding=True)
        torch.manual_seed(seed)
        with torch.no_grad():
            sequences = model.generate(
                **prompts, do_sample=True, temperature=1.0, max_new_tokens=12, num_return_sequences=4,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        prompt_length = prompts["input_ids"].size(1)
        completion = sequences[:, prompt_length:]
        ended = (completion == tokenizer.eos_token_id).int().cumsum(1)
        completion_mask = ((ended == 0) | ((ended == 1) & (completion == tokenizer.eos_token_id))).long()
        attention_mask = torch.cat([prompts["attention_mask"].repeat_interleave(4, 0), completion_mask], 1)
        reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
        return cls(sequences, attention_mask, completion_mask, prompt_length, keep_rms_norm_in_model_dtype(reference))

    @torch.no_grad()
    def entropy(self, model) -> float:
        trained = dict(model.named_parameters())
        for name, p in self.reference.named_parameters():
            p.copy_(trained[name])
        logits = self.reference.eval()(input_ids=self.input_ids, attention_mask=self.attention_mask).logits
        assert logits.dtype == torch.float64
        logp = torch.log_softmax(logits[:, self.prompt_length - 1 : -1], -1)
        entropies = -(logp.exp() * logp).sum(-1)
        mask = self.completion_mask.double()
        return float((entropies * mask).sum() / mask.sum())


class HeldOutDrift(TrainerCallback):
    """The held-out entropy's change since the start, after every optimizer step."""

    def __init__(self, held_out: HeldOut, model):
        self.held_out, self.start, self.drift = held_out, held_out.entropy(model), []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.drift.append(self.held_out.entropy(model) - self.start)


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 3) for c in completions]


def run(
    model_path: str, method: str, lr: float, settings: StepBalanceSettings, work: str, held_out: HeldOut
) -> dict[str, list[float]]:
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
        **settings.methods()[method],
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, settings.dtype))
    if settings.dtype == "float64":
        keep_rms_norm_in_model_dtype(model)
    rows = [{"prompt": prompt(i)} for i in range(TRAINING_PROMPTS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = OPEFOTrainer(
            model=model,
            processing_class=AutoTokenizer.from_pretrained(model_path),
            reward_funcs=length_reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            probe_dataset=Dataset.from_list(
                [{"prompt": prompt(FIRST_PROBE_PROMPT + i)} for i in range(settings.probe_prompts)]
            )
            if method == "fixed_probe_balance"
            else None,
        )
        trainer.remove_callback(PrinterCallback)
        drift = HeldOutDrift(held_out, trainer.model)
        trainer.add_callback(drift)
        trainer.train()
    history = trainer.state.log_history
    return {**{name: [e[key] for e in history if key in e] for name, key in METRICS.items()}, "held_out": drift.drift}


def _mean(values):
    return statistics.fmean(values) if values else float("nan")


def _mean_abs_steps(drift: list[float]) -> float:
    """Mean |change| per optimizer step of a drift series (its differences, the first from 0)."""
    return _mean([abs(b - a) for a, b in zip([0.0, *drift[:-1]], drift, strict=True)])


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
            "held_out_max_abs_drift": {m: max(abs(x) for x in r["held_out"]) for m, r in runs.items()},
            "held_out_mean_abs_step_change": {m: _mean_abs_steps(r["held_out"]) for m, r in runs.items()},
            "held_out_final_drift": {m: r["held_out"][-1] for m, r in runs.items()},
        }
    return summary


def held_out_markdown(results: dict, summary: dict) -> list[str]:
    methods = list(next(iter(results.values())))
    lines = ["held-out drift (float64 re-scoring of completions no run trains on)", ""]
    for lr, runs in results.items():
        lines += [
            f"learning rate {lr}",
            "",
            "| step | " + " | ".join(methods) + " |",
            "|---" * (len(methods) + 1) + "|",
        ]
        for i in range(len(runs["grpo"]["held_out"])):
            lines.append(f"| {i + 1} | " + " | ".join(f"{runs[m]['held_out'][i]:+.3e}" for m in methods) + " |")
        worst, per_step = summary[lr]["held_out_max_abs_drift"], summary[lr]["held_out_mean_abs_step_change"]
        lines += [
            "",
            "max |drift|: "
            + ", ".join(f"{m} {worst[m]:.3e} ({worst['grpo'] / worst[m]:.1f}x below GRPO)" for m in methods),
            "mean |change per step|: "
            + ", ".join(f"{m} {per_step[m]:.3e} ({per_step['grpo'] / per_step[m]:.1f}x below GRPO)" for m in methods),
            "",
        ]
    rates = sorted(results)
    if len(rates) >= 2:
        low, high = rates[0], rates[-1]
        ratios = ", ".join(
            f"{m} {summary[low]['held_out_max_abs_drift'][m] / summary[high]['held_out_max_abs_drift'][m]:.3f}"
            for m in methods
        )
        lines.append(
            f"max |drift| at lr {low:g} over lr {high:g}: {ratios} (first order: {low / high:.3f}, second order: "
            f"{(low / high) ** 2:.3f}; after step 1 the runs follow their own trajectories)"
        )
    return lines


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
    lines += ["", *held_out_markdown(results, summary)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser([StepBalanceSettings], prog="step_balance.py", description=__doc__)
    try:
        (settings,) = parse_options(parser, argv)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    work = tempfile.mkdtemp(prefix="opefo-step-balance-")
    model_path = warm_up_tiny_model(build_tiny_model(os.path.join(work, "tiny")), os.path.join(work, "warm"))
    held_out = HeldOut.sample(model_path, settings.held_out, settings.held_out_first_prompt, settings.seed + 1)
    results = {
        lr: {method: run(model_path, method, lr, settings, work, held_out) for method in settings.methods()}
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
