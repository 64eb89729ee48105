"""The demo's synthetic tasks: data, reward, warm-start answers, the exact-answer check, and the train / held-out split.

Each task's prompts are whole target numbers. Every fifth target (from the third) is *held out*: it appears neither
in the warm start's supervised data nor in RL, and pass@k is measured on it (``held_out_split``).

Example:
    >>> from opefo_trl.demo.tasks import TASKS
    >>> task = TASKS["digit_sum"]
    >>> task.held_out_targets, len(task.train_targets)
    ([101, 106, 111, 116, 121, 126], 24)
    >>> task.exact_answer("123456789012345678901234", 100), task.exact_answer("12", 3)
    ((1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4), None)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from opefo_trl.demo import addition, digit_sum

#: One target in this many is held out (starting from the ``HELD_OUT_OFFSET``-th), spread across the range.
HELD_OUT_EVERY = 5
HELD_OUT_OFFSET = 2


def held_out_split(targets: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(train, held_out)``: ``targets[HELD_OUT_OFFSET::HELD_OUT_EVERY]`` are held out, the rest train.

    >>> held_out_split(range(6, 16))
    ([6, 7, 9, 10, 11, 12, 14, 15], [8, 13])
    """
    targets = list(targets)
    held_out = targets[HELD_OUT_OFFSET::HELD_OUT_EVERY]
    if not held_out or len(held_out) == len(targets):
        raise ValueError(
            f"Cannot hold out every {HELD_OUT_EVERY}th of {targets}: need at least {HELD_OUT_OFFSET + 1} targets."
        )
    return [t for t in targets if t not in held_out], held_out


@dataclass(frozen=True)
class DemoTask:
    """A synthetic verifiable task: its prompts, reward, warm-start answers, the exact-answer check, and the settings
    that fit it (model size, budget) where they differ from ``DemoSettings``'s defaults.

    ``targets`` is every target of the task; ``train_targets`` (warm start and RL) and ``held_out_targets`` (pass@k)
    split it with ``held_out_split``.
    """

    name: str
    description: str
    targets: tuple[int, ...]
    prompt: Callable[[int], list[dict]]
    build_dataset: Callable[[Sequence[int]], object]
    reward: Callable
    warm_start_answers: Callable[[int, Sequence[int], int], list[tuple[int, str]]]  # (count, targets, seed)
    exact_answer: Callable[[str, int], Hashable | None]  # a right answer's identity (distinct answers), else None
    defaults: dict = field(default_factory=dict)
    #: The characters answers are written in, one token each: the task rewards no other token.
    answer_characters: str = "0123456789"

    @property
    def train_targets(self) -> list[int]:
        return held_out_split(self.targets)[0]

    @property
    def held_out_targets(self) -> list[int]:
        return held_out_split(self.targets)[1]

    def train_dataset(self):
        """The RL dataset: one row per training target (held-out targets excluded)."""
        return self.build_dataset(self.train_targets)

    def task_token_ids(self, tokenizer) -> list[int]:
        """The token ids of ``answer_characters`` (``OPEFOConfig.entropy_flow_task_tokens``)."""
        ids = [tokenizer.convert_tokens_to_ids(c) for c in self.answer_characters]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ValueError(f"The tokenizer has no single token for each of {self.answer_characters!r}.")
        return ids


def _exact_sum(text: str, target: int):
    return addition.parse_sum(text) if addition.is_correct_sum(text, target) else None


def _exact_digit_sum(text: str, target: int):
    digits = digit_sum.answer_digits(text)
    exact = len(digits) == digit_sum.DEFAULT_NUM_DIGITS and sum(digits) == target
    return tuple(digits) if exact else None


TASKS = {
    "digit_sum": DemoTask(
        name="digit_sum",
        description="Write 24 digits that add up to t (graded by how close the sum is): in the paper's regime",
        targets=tuple(digit_sum.default_targets()),
        prompt=digit_sum.digit_sum_prompt,
        build_dataset=lambda targets: digit_sum.build_digit_sum_dataset(targets),
        reward=digit_sum.digit_sum_reward,
        warm_start_answers=lambda n, targets, seed: [
            (e.target, e.answer) for e in digit_sum.sample_warm_start_examples(n, targets=targets, seed=seed)
        ],
        exact_answer=_exact_digit_sum,
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
        targets=tuple(addition.default_targets(6, 15)),
        prompt=addition.sum_prompt,
        build_dataset=addition.build_sum_dataset,
        reward=addition.correct_sum_reward,
        warm_start_answers=lambda n, targets, seed: [
            (e.target, e.answer)
            for e in addition.sample_warm_start_examples(n, targets=targets, wrong_fraction=0.0, seed=seed)
        ],
        exact_answer=_exact_sum,
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
