"""The entropy-flow estimates side by side on real rollouts of SmolLM2-135M-Instruct (docs/algorithm.md, section 10,
"On a real pretrained model").

OPEFOTrainer trains strict on-policy GRPO (``method="grpo"``, so no estimate reweights the rollouts being measured)
with ``entropy_flow_estimate="param"`` on arithmetic problems ("What is 7 plus 5?": one-digit sums in the wording
of `benchmarks/arith20`, or ``--problems arith20`` itself), answered "The answer is N." and scored by
``math_accuracy_reward``. Every rollout batch is scored once by the `param` estimate's own path
(`opefo_trl.experimental.param_estimate`: log pi_t, H_t in float32 and u_t = <D grad Hbar, grad log pi_t>) and once by
TRL's scoring pass with the vocabulary sums of `full` (sum pi^2, sum pi^2 log pi). Each tabular estimate's flow
(`opefo`, `onaction`, `sign`, `full`) is then ``flow_per_unit_advantage`` of the same log pi_t and H_t (the two
vocabulary sums from the second pass; its log pi_t's largest difference from the first is reported), with the same
advantages A_t and loss factors f_t (TRL's ``dapo`` loss). Per rollout and estimate:

- lambda*, P and N of sum_t f_t A_t u_t (`opefo_trl.maths.entropy_flow.flow_stats`);
- ``low_prob_share``: the share of OPEFO's reweighted flow sum_t f_t w_t |d_t| (w_t = 1 + lambda* s_t, that estimate's
  own weights) carried by tokens sampled with probability < 0.01, as ``opefo/low_prob_flow_share`` logs it;
- ``sign_agreement``: the fraction of tokens with a nonzero advantage whose flow has the sign of `param`'s;
- ``low_prob_unit``: the mean |u_t| of those rare tokens over the mean |u_t| of the others (how much more one rare
  token weighs than one ordinary token, before the advantage);
- ``lambda_without_rare``: lambda* of the same flow with the rare tokens left out, and the rare tokens' shares of P
  and of N (does the rare tokens' flow make the estimate's lambda*?);
- per rollout, the share of negative advantages among the rare tokens and among all tokens with a nonzero advantage.

One thread, CPU; each rollout takes one to three minutes (the `param` estimate's passes dominate).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/real_flow.py --output runs/real_flow.json

Prints one markdown table (a row per rollout and estimate, then each estimate's mean and range) and writes the
per-rollout figures to ``--output`` (JSON) and the per-token tensors beside it (``.pt``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from opefo_trl import OPEFOConfig, OPEFOTrainer  # noqa: E402
from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error  # noqa: E402
from opefo_trl.maths.entropy_flow import flow_per_unit_advantage, flow_stats, token_weights  # noqa: E402

#: The estimates compared; `param` is the reference of the sign agreement.
ESTIMATES = ("opefo", "onaction", "sign", "full", "param")
#: A sampled token below this probability is "rare" (OPEFO's ``opefo_low_prob`` default).
LOW_PROB = 0.01
PROBLEMS = Path(__file__).parent / "arith20" / "arith20.jsonl"


@dataclass
class FlowSettings:
    """What `real_flow.py` samples and measures."""

    rollouts: int = field(default=4, metadata={"help": "Rollout batches (one optimizer step each)."})
    prompts: int = field(default=8, metadata={"help": "Prompts per rollout batch."})
    num_generations: int = field(default=4, metadata={"help": "Completions per prompt."})
    max_completion_length: int = field(default=40, metadata={"help": "Tokens per completion at most."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    learning_rate: float = field(default=5e-6, metadata={"help": "GRPO's learning rate between rollouts."})
    accumulation: int = field(default=4, metadata={"help": "Micro-batches per rollout (gradient accumulation)."})
    preconditioner: str = field(
        default="adam",
        metadata={
            "help": "`param`'s D: 'adam' (AdamW, the default) or 'none' (plain SGD, the tabular estimates' step)."
        },
    )
    problems: str = field(
        default="small_sums",
        metadata={"help": "'small_sums' (a + b, one digit each) or 'arith20' (benchmarks/arith20, harder)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the sampling and of the prompt order."})
    output: str | None = field(default=None, metadata={"help": "Write the per-rollout figures here (JSON)."})

    def __post_init__(self) -> None:
        if self.problems not in ("small_sums", "arith20"):
            raise ValueError(f"--problems is 'small_sums' or 'arith20'; got {self.problems!r}.")
        if self.preconditioner not in ("adam", "none"):
            raise ValueError(f"--preconditioner is 'adam' or 'none'; got {self.preconditioner!r}.")
        if self.prompts * self.num_generations % self.accumulation:
            raise ValueError(
                f"--prompts x --num_generations ({self.prompts * self.num_generations}) must split into "
                f"--accumulation ({self.accumulation}) micro-batches."
            )


def arithmetic_dataset(problems: str) -> Dataset:
    """``arith20``: the 20 problems of `benchmarks/arith20` (two-digit sums, differences and products; a first rollout
    here had 1 right of 32, so a single group with reward variance); ``small_sums``: "What is a plus b?" for a, b in
    2..9, in arith20's wording."""
    if problems == "arith20":
        rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines() if line.strip()]
    else:
        rows = [{"problem": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(2, 10) for b in range(2, 10)]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{row['problem']} Reply with: The answer is N."}],
                "solution": row["answer"],
            }
            for row in rows
        ]
    )


def record_rollouts(trainer: OPEFOTrainer) -> list[list[dict]]:
    """Wraps the trainer's rollout weigher so that every micro-batch it weighs is recorded, with the vocabulary sums
    of a second scoring pass; returns the list the rollouts are appended to."""
    weigher = trainer.rollout
    assert weigher is not None and weigher.param is not None
    rollouts: list[list[dict]] = []
    weigh, flow = weigher.weigh, weigher._flow

    def weigh_recorded(batches):
        rollouts.append([])
        return weigh(batches)

    def flow_recorded(item, alignment):
        batch = flow(item, alignment)
        vocab = weigher.scorer.score(item.batch, vocab=True)
        rollouts[-1].append(
            dict(
                logps=batch.logps.double(),
                entropies=batch.entropies.double(),
                advantages=batch.advantages.double(),
                factor=batch.factor.double(),
                param=item.unit_flow.double(),
                moment2=vocab.moment2,
                moment3=vocab.moment3,
                trl_logps=vocab.logps.double(),
            )
        )
        return batch

    weigher.weigh, weigher._flow = weigh_recorded, flow_recorded
    return rollouts


def rollout_figures(parts: list[dict]) -> dict:
    """Every estimate's lambda*, P, N, rare-token share and sign agreement with `param` on one rollout batch."""
    joined = {key: torch.cat([part[key].flatten() for part in parts]) for key in parts[0]}
    logps, entropies, advantages, factor = (joined[k] for k in ("logps", "entropies", "advantages", "factor"))
    in_loss = factor > 0
    rare = (logps.exp() < LOW_PROB) & in_loss
    moving = in_loss & (advantages != 0)
    units = {
        estimate: flow_per_unit_advantage(
            logps,
            entropies,
            estimate,
            joined["moment2"],
            joined["moment3"],
            joined["param"],
        ).double()
        for estimate in ESTIMATES
    }
    figures = dict(
        tokens=int(in_loss.sum()),
        rare_tokens=int(rare.sum()),
        mean_entropy=float(entropies[in_loss].mean()),
        mean_advantage_abs=float(advantages[in_loss].abs().mean()),
        logp_rescore_max_diff=float((joined["trl_logps"] - logps)[in_loss].abs().max()),
        # Whether rare tokens sit in wrong completions: the share of negative advantages among the moving tokens.
        negative_share_rare=float((advantages[rare & moving] < 0).double().mean()),
        negative_share_all=float((advantages[moving] < 0).double().mean()),
        estimates={},
    )
    param_sign = (advantages * units["param"]).sign()
    for estimate, unit in units.items():
        flow = advantages * unit
        stats = flow_stats(flow, factor)
        lam = float(stats.lambda_star)
        moved = (factor * token_weights(flow, lam) * flow).abs()
        ordinary = in_loss & ~rare
        without_rare = flow_stats(flow, factor * ordinary)
        figures["estimates"][estimate] = dict(
            lambda_star=lam,
            increase=float(stats.increase),
            decrease=float(stats.decrease),
            lambda_without_rare=float(without_rare.lambda_star),
            rare_share_of_increase=1 - float(without_rare.increase / stats.increase),
            rare_share_of_decrease=1 - float(without_rare.decrease / stats.decrease),
            low_prob_share=float(moved[rare].sum() / moved.sum()),
            sign_agreement=float((flow.sign() == param_sign)[moving].double().mean()),
            low_prob_unit=float(unit[rare].abs().mean() / unit[ordinary].abs().mean()),
        )
    return figures


def table(figures: list[dict]) -> str:
    lines = [
        "| rollout | estimate | lambda* | P | N | share of reweighted flow, pi < 0.01 | sign agreement with param "
        "| mean abs u, rare / others | lambda* without rare | rare share of P | rare share of N |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, rollout in enumerate(figures, 1):
        for estimate, row in rollout["estimates"].items():
            lines.append(
                f"| {index} | `{estimate}` | {row['lambda_star']:+.3f} | {row['increase']:.3g} | {row['decrease']:.3g} "
                f"| {row['low_prob_share']:.2f} | {row['sign_agreement']:.2f} | {row['low_prob_unit']:.2f} "
                f"| {row['lambda_without_rare']:+.3f} | {row['rare_share_of_increase']:.2f} "
                f"| {row['rare_share_of_decrease']:.2f} |"
            )
    lines.append("")
    lines.append(
        "| estimate | lambda* mean (range) | rare share mean (range) | sign agreement mean (range) "
        "| lambda* without rare mean (range) |"
    )
    lines.append("|---|---|---|---|---|")
    for estimate in ESTIMATES:
        rows = [rollout["estimates"][estimate] for rollout in figures]

        def spread(key: str, digits: int, rows=rows) -> str:
            values = [row[key] for row in rows]
            return f"{sum(values) / len(values):.{digits}f} ({min(values):.{digits}f} to {max(values):.{digits}f})"

        lines.append(
            f"| `{estimate}` | {spread('lambda_star', 3)} | {spread('low_prob_share', 2)} "
            f"| {spread('sign_agreement', 2)} | {spread('lambda_without_rare', 3)} |"
        )
    for index, rollout in enumerate(figures, 1):
        lines.append(
            f"\nrollout {index}: {rollout['tokens']} loss tokens, {rollout['rare_tokens']} sampled at pi < {LOW_PROB}, "
            f"mean entropy {rollout['mean_entropy']:.3f}, mean |A| {rollout['mean_advantage_abs']:.3f}, A < 0 on "
            f"{rollout['negative_share_rare']:.2f} of the rare tokens with A != 0 and "
            f"{rollout['negative_share_all']:.2f} of all, log pi of the two scoring passes within "
            f"{rollout['logp_rescore_max_diff']:.1e}, {rollout['seconds']:.0f} s"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser([FlowSettings], prog="real_flow.py", description=__doc__)
    try:
        (settings,) = parse_options(parser, argv)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    from opefo_trl.data.rewards import math_accuracy_reward
    from opefo_trl.real_model import smollm2_135m_instruct

    work = tempfile.mkdtemp(prefix="opefo-real-flow-")
    micro = settings.prompts * settings.num_generations // settings.accumulation
    args = OPEFOConfig(
        output_dir=work,
        method="grpo",
        entropy_flow_estimate="param",
        entropy_flow_preconditioner=settings.preconditioner,
        optim="adamw_torch" if settings.preconditioner == "adam" else "sgd",
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=settings.accumulation,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        learning_rate=settings.learning_rate,
        max_steps=settings.rollouts,
        seed=settings.seed,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = OPEFOTrainer(
        model=str(smollm2_135m_instruct()),
        reward_funcs=math_accuracy_reward,
        args=args,
        train_dataset=arithmetic_dataset(settings.problems),
    )
    rollouts = record_rollouts(trainer)
    starts: list[float] = []
    weigh = trainer.rollout.weigh

    def timed(batches):
        starts.append(time.perf_counter())
        return weigh(batches)

    trainer.rollout.weigh = timed
    trainer.train()
    figures = []
    for index, parts in enumerate(rollouts):
        end = starts[index + 1] if index + 1 < len(starts) else time.perf_counter()
        figures.append(rollout_figures(parts) | {"seconds": end - starts[index]})
    print(table(figures))
    if settings.output:
        Path(settings.output).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.output).write_text(json.dumps({"settings": asdict(settings), "rollouts": figures}, indent=1))
        torch.save(rollouts, Path(settings.output).with_suffix(".pt"))  # the per-token tensors, for a closer look
    return 0


if __name__ == "__main__":
    sys.exit(main())
