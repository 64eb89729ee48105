"""A policy on the held-out targets: exact answers among n samples per target, unbiased pass@k, distinct right answers.

Example (the counts of two targets, 4 samples each):
    >>> result = HeldOutResult.from_counts([10, 11], samples=4, correct=[1, 0], distinct=[1, 0], ks=[1, 4])
    >>> result.pass_at_k, result.accuracy
    ({'pass@1': 0.125, 'pass@4': 0.5}, 0.125)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opefo_trl.data.prompts import render_prompts
from opefo_trl.demo.tasks import DemoTask
from opefo_trl.eval.pass_at_k import mean_pass_at_k


@dataclass
class HeldOutResult:
    """What ``samples_per_target`` samples per held-out target show (pass@k averaged over the targets)."""

    targets: list[int]
    samples_per_target: int
    correct: list[int]  # exact answers among the samples, per target
    distinct_correct: list[int]  # distinct exact answers, per target
    pass_at_k: dict[str, float]  # {"pass@k": value}
    accuracy: float  # fraction of exact samples (= pass@1)
    distinct_correct_per_target: float

    @classmethod
    def from_counts(cls, targets, samples: int, correct, distinct, ks: Sequence[int]) -> HeldOutResult:
        n = [samples] * len(targets)
        return cls(
            targets=list(targets),
            samples_per_target=samples,
            correct=list(correct),
            distinct_correct=list(distinct),
            pass_at_k={f"pass@{k}": mean_pass_at_k(n, correct, k) for k in ks},
            accuracy=sum(correct) / (samples * len(targets)),
            distinct_correct_per_target=sum(distinct) / len(targets),
        )


def sample_completions(
    model, tokenizer, prompts: Sequence[list[dict]], samples: int, max_new_tokens: int, temperature: float, seed: int
):
    """``samples`` completions of each conversational prompt (each prompt's together, in prompt order), sampled at
    ``temperature`` without top-k / top-p, in eval mode, from a random stream seeded with ``seed`` and forked from
    the caller's (left as it was). Returns the prompts' attention mask, one row per completion, and the whole
    sequences (prompt, then completion)."""
    import torch

    prompt_ids = render_prompts(tokenizer, list(prompts))
    batch = tokenizer.pad({"input_ids": prompt_ids}, padding=True, padding_side="left", return_tensors="pt")
    batch = {k: v.to(model.device) for k, v in batch.items()}
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            output = model.generate(
                **batch,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=samples,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
    finally:
        model.train(was_training)
    return batch["attention_mask"].repeat_interleave(samples, 0), output


def evaluate_held_out(
    model,
    tokenizer,
    task: DemoTask,
    samples: int,
    ks: Sequence[int],
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> HeldOutResult:
    """Sample ``samples`` completions per held-out target (at ``temperature``, no top-k/top-p) and score exact
    answers."""
    targets = task.held_out_targets
    prompt_mask, output = sample_completions(
        model, tokenizer, [task.prompt(t) for t in targets], samples, max_new_tokens, temperature, seed
    )
    answers = tokenizer.batch_decode(output[:, prompt_mask.shape[1] :], skip_special_tokens=True)
    correct, distinct = [], []
    for i, target in enumerate(targets):  # generate returns each prompt's samples together, in prompt order
        keys = [task.exact_answer(a, target) for a in answers[i * samples : (i + 1) * samples]]
        right = [k for k in keys if k is not None]
        correct.append(len(right))
        distinct.append(len(set(right)))
    return HeldOutResult.from_counts(targets, samples, correct, distinct, ks)
