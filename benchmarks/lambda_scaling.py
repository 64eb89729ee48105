"""lambda* against the number of tokens with a nonzero advantage per batch, on SmolLM2-135M-Instruct, for each tabular
estimate beside its shuffled-advantage null (docs/algorithm.md, "What lambda* measures").

One pool of rollouts of the base model, with no update, so that every batch drawn from it is an on-policy batch of the
same policy: ``--problems`` word problems (`opefo_trl.data.word_problems`, seed 0) x ``--num_generations``
completions of at most ``--max_completion_length`` tokens at ``--temperature``, under the step-by-step prompt
``--prompt_template`` (default `qwen_math_boxed`, whose completions are long), scored by ``math_accuracy_reward``,
with GRPO's advantages per group ((R - mean) / (std + 1e-4)). Each completion token is scored once in float32: log
pi_t, H_t and the surprise-gap moments S_2, S_3 (`opefo_trl.maths.vocab_stats`, the LM head in tiles).

A batch is a random set of k groups (k = 1, 2, 4, ...; ``--draws`` sets per k). For each batch and estimate:
lambda* = (N - P) / (N + P) of sum_t A_t u_t over the completion tokens (TRL's `dapo` factor is the same for every
token and cancels), the part of lambda* the estimate's on-policy mean accounts for (``lambda_bias``), and the null:
lambda* with the completions' advantages shuffled within each group, which keeps every group's advantages (they still
sum to zero) but breaks their tie to the completions (``--null_draws`` shuffles per batch). For an estimate with zero
on-policy mean the real and the null |lambda*| both shrink like 1/sqrt(tokens); a lambda* that stays above its null
is signal or bias.

`param` is not in the table: its u_t takes a gradient forward, two backwards and a forward-mode pass over the batch,
and depends on the batch's own mean entropy, so subsets of one pool do not give it; `benchmarks/real_flow.py` measures
it per rollout.

    HF_HUB_OFFLINE=1 python benchmarks/lambda_scaling.py --output runs/lambda_scaling.json

Prints a markdown table and writes the figures (JSON) to ``--output`` and a plot beside it (``.png``).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from opefo_trl.cli.options import INPUT_ERRORS, build_parser, parse_options, report_error  # noqa: E402
from opefo_trl.maths.entropy_flow import flow_per_unit_advantage, flow_stats, on_policy_mean  # noqa: E402

#: The estimates compared (every tabular one).
ESTIMATES = ("opefo", "opefo_centered", "onaction", "sign", "full")
#: Completions scored at once (their logits over the vocabulary are the largest tensor).
SCORING_ROWS = 16


@dataclass
class ScalingSettings:
    problems: int = field(default=64, metadata={"help": "Word problems (groups) in the pool."})
    num_generations: int = field(default=8, metadata={"help": "Completions per problem."})
    max_completion_length: int = field(default=128, metadata={"help": "Longest completion, in tokens."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (the policy's)."})
    prompt_template: str = field(default="qwen_math_boxed", metadata={"help": "Prompt template (data.prompts)."})
    draws: int = field(default=40, metadata={"help": "Random batches per batch size."})
    null_draws: int = field(default=20, metadata={"help": "Within-group shuffles of the advantages per batch."})
    generation_batch: int = field(default=64, metadata={"help": "Sequences generated at once."})
    seed: int = field(default=0, metadata={"help": "Seed of sampling and of the batches."})
    output: str | None = field(default=None, metadata={"help": "JSON output path (a .png plot beside it)."})


@torch.no_grad()
def rollout_pool(settings: ScalingSettings) -> dict:
    """Sample the pool and score it: per completion token log pi, H, S_2, S_3 and the completion's advantage."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opefo_trl.data.prompts import format_prompt
    from opefo_trl.data.rewards import math_accuracy_reward
    from opefo_trl.data.word_problems import word_problems
    from opefo_trl.maths.lm_head import core_model
    from opefo_trl.maths.vocab_stats import vocab_stats
    from opefo_trl.real_model import smollm2_135m_instruct

    folder = str(smollm2_135m_instruct())
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    head = core_model(model).get_output_embeddings()
    problems = word_problems(settings.problems, seed=0)
    torch.manual_seed(settings.seed)
    rows: list[dict] = []
    per_batch = max(1, settings.generation_batch // settings.num_generations)
    for start in range(0, len(problems), per_batch):
        chunk = problems[start : start + per_batch]
        texts = [
            tokenizer.apply_chat_template(
                format_prompt(p.question, settings.prompt_template), add_generation_prompt=True, tokenize=False
            )
            for p in chunk
        ]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **encoded,
            do_sample=True,
            temperature=settings.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=settings.max_completion_length,
            num_return_sequences=settings.num_generations,
            pad_token_id=tokenizer.pad_token_id,
        )
        prompt_length = encoded["input_ids"].shape[1]
        completions = out[:, prompt_length:]
        is_eos = completions == tokenizer.eos_token_id
        ends = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((len(out),), completions.shape[1]))
        mask = torch.arange(completions.shape[1])[None] <= ends[:, None]  # up to and including the first EOS
        texts_out = tokenizer.batch_decode(completions, skip_special_tokens=True)
        gold = [str(p.result) for p in chunk for _ in range(settings.num_generations)]
        rewards = torch.tensor(
            [r if r is not None else 0.0 for r in math_accuracy_reward(texts_out, gold)], dtype=torch.float64
        )
        attention = torch.cat([encoded["attention_mask"].repeat_interleave(settings.num_generations, 0), mask], 1)
        for first in range(0, len(out), SCORING_ROWS):  # the backbone's hidden states, then the head in tiles
            part = slice(first, first + SCORING_ROWS)
            positions = (attention[part].cumsum(1) - 1).clamp(min=0)
            hidden = (
                core_model(model)
                .model(input_ids=out[part], attention_mask=attention[part], position_ids=positions)
                .last_hidden_state
            )
            states = hidden[:, prompt_length - 1 : -1]  # position i predicts token i + 1
            stats = vocab_stats(states, head.weight, head.bias, temperature=settings.temperature)
            logits = head(states).float() / settings.temperature
            logps = torch.log_softmax(logits, -1).gather(-1, completions[part, :, None])[..., 0]
            moment2, moment3 = stats.moments()
            for offset in range(len(logps)):
                row, keep = first + offset, mask[first + offset]
                rows.append(
                    dict(
                        group=start + row // settings.num_generations,
                        reward=float(rewards[row]),
                        logps=logps[offset, keep],
                        entropies=stats.entropy[offset, keep],
                        moment2=moment2[offset, keep],
                        moment3=moment3[offset, keep],
                    )
                )
        print(f"sampled {start + len(chunk)} / {len(problems)} problems", file=sys.stderr)
    return {"rows": rows}


def group_advantages(rows: list[dict]) -> None:
    """GRPO's advantage (R - mean) / (std + 1e-4) within each group, written into each row."""
    groups: dict[int, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    for members in groups.values():
        rewards = torch.tensor([m["reward"] for m in members], dtype=torch.float64)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for member, advantage in zip(members, advantages.tolist(), strict=True):
            member["advantage"] = advantage


def batch_lambdas(rows: list[dict], advantages: list[float]) -> dict[str, dict[str, float]]:
    """Per estimate: lambda* of the rows' tokens with these per-completion advantages, and its bias part."""
    logps = torch.cat([r["logps"] for r in rows])
    entropies = torch.cat([r["entropies"] for r in rows])
    moment2, moment3 = torch.cat([r["moment2"] for r in rows]), torch.cat([r["moment3"] for r in rows])
    per_token = torch.cat([torch.full_like(r["logps"], a) for r, a in zip(rows, advantages, strict=True)])
    factor = torch.ones_like(logps)[None]
    figures = {}
    for estimate in ESTIMATES:
        unit = flow_per_unit_advantage(logps[None], entropies[None], estimate, moment2[None], moment3[None])
        bias = on_policy_mean(estimate, moment2, moment3)[None] * per_token[None]
        stats = flow_stats(per_token[None] * unit, factor, bias)
        figures[estimate] = dict(lam=float(stats.lambda_star), lam_bias=float(stats.lambda_bias))
    return figures


def scaling_table(pool: dict, settings: ScalingSettings) -> list[dict]:
    rows = pool["rows"]
    groups = sorted({r["group"] for r in rows})
    by_group = {g: [r for r in rows if r["group"] == g] for g in groups}
    informative = [g for g in groups if len({r["reward"] for r in by_group[g]}) > 1]  # reward variance: A != 0
    rng = random.Random(settings.seed)
    if not informative:
        raise SystemExit("lambda_scaling.py: no group of the pool has reward variance (every A = 0): raise --problems.")
    sizes = [2**i for i in range(int(math.log2(len(informative))) + 1)]
    table = []
    for k in sizes:
        draws = 1 if k == len(informative) else settings.draws
        real: dict[str, list[float]] = {e: [] for e in ESTIMATES}
        bias: dict[str, list[float]] = {e: [] for e in ESTIMATES}
        null: dict[str, list[float]] = {e: [] for e in ESTIMATES}
        tokens = []
        for _ in range(draws):
            chosen = [r for g in rng.sample(informative, k) for r in by_group[g]]
            tokens.append(sum(len(r["logps"]) for r in chosen if abs(r["advantage"]) > 0))
            for estimate, values in batch_lambdas(chosen, [r["advantage"] for r in chosen]).items():
                real[estimate].append(values["lam"])
                bias[estimate].append(values["lam_bias"])
            for _ in range(settings.null_draws):
                shuffled = []
                for g in sorted({r["group"] for r in chosen}):
                    advantages = [r["advantage"] for r in by_group[g]]
                    rng.shuffle(advantages)
                    shuffled.extend(advantages)
                for estimate, values in batch_lambdas(chosen, shuffled).items():
                    null[estimate].append(values["lam"])

        def mean_abs(values: list[float]) -> float:
            return sum(abs(v) for v in values) / len(values)

        table.append(
            dict(
                groups=k,
                draws=draws,
                advantaged_tokens=sum(tokens) / len(tokens),
                estimates={
                    e: dict(
                        mean_abs_lambda=mean_abs(real[e]),
                        mean_lambda=sum(real[e]) / len(real[e]),
                        mean_lambda_bias=sum(bias[e]) / len(bias[e]),
                        mean_abs_lambda_net_of_bias=mean_abs([r - b for r, b in zip(real[e], bias[e], strict=True)]),
                        null_mean_abs_lambda=mean_abs(null[e]),
                    )
                    for e in ESTIMATES
                },
            )
        )
        print(f"k={k}: {table[-1]['advantaged_tokens']:.0f} advantaged tokens", file=sys.stderr)
    return table


def markdown(table: list[dict]) -> str:
    head = "| groups | tokens with A != 0 | " + " | ".join(f"`{e}` \\|λ*\\| (null)" for e in ESTIMATES)
    lines = [head + " | `opefo` mean λ* (its bias part) |", "|---" * (3 + len(ESTIMATES)) + "|"]
    for row in table:
        cells = [
            f"{row['estimates'][e]['mean_abs_lambda']:.3f} ({row['estimates'][e]['null_mean_abs_lambda']:.3f})"
            for e in ESTIMATES
        ]
        opefo = row["estimates"]["opefo"]
        lines.append(
            f"| {row['groups']} | {row['advantaged_tokens']:.0f} | "
            + " | ".join(cells)
            + f" | {opefo['mean_lambda']:+.3f} ({opefo['mean_lambda_bias']:+.3f}) |"
        )
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [row["advantaged_tokens"] for row in table]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for estimate, color in zip(ESTIMATES, ("C0", "C1", "C2", "C3", "C4"), strict=True):
        ax.plot(tokens, [r["estimates"][estimate]["mean_abs_lambda"] for r in table], "o-", color=color, label=estimate)
        ax.plot(tokens, [r["estimates"][estimate]["null_mean_abs_lambda"] for r in table], "--", color=color, lw=1)
    reference = table[0]["estimates"]["full"]["null_mean_abs_lambda"] * math.sqrt(tokens[0])
    ax.plot(tokens, [reference / math.sqrt(t) for t in tokens], ":", color="k", label="1/sqrt(tokens)")
    ax.set(xscale="log", yscale="log", xlabel="tokens with a nonzero advantage per batch", ylabel="mean |λ*|")
    ax.set_title("SmolLM2-135M-Instruct: |λ*| (solid) and its shuffled-advantage null (dashed)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = build_parser([ScalingSettings], prog="lambda_scaling.py", description=__doc__)
    try:
        (settings,) = parse_options(parser, argv)
    except INPUT_ERRORS as err:
        return report_error(parser.prog, err)
    started = time.process_time(), time.perf_counter()
    pool = rollout_pool(settings)
    group_advantages(pool["rows"])
    table = scaling_table(pool, settings)
    rows = pool["rows"]
    summary = dict(
        completions=len(rows),
        mean_completion_tokens=sum(len(r["logps"]) for r in rows) / len(rows),
        mean_reward=sum(r["reward"] for r in rows) / len(rows),
        cpu_seconds=time.process_time() - started[0],
        wall_seconds=time.perf_counter() - started[1],
    )
    print(markdown(table))
    print(
        f"\n{summary['completions']} completions, {summary['mean_completion_tokens']:.1f} tokens on average, mean "
        f"reward {summary['mean_reward']:.3f}; {summary['cpu_seconds']:.0f} CPU s, {summary['wall_seconds']:.0f} s"
    )
    if settings.output:
        path = Path(settings.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"settings": asdict(settings), "summary": summary, "table": table}, indent=1))
        plot(table, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
