"""The demo's tasks: data, reward, warm-start answers, the exact-answer check, and the train / held-out split.

Each synthetic task's prompts are whole target numbers, and its model a tiny Qwen2 warm-started on them;
``word_problems`` (``make demo-real``) starts from the pretrained SmolLM2-135M-Instruct instead, and its targets are
the indices of recipes/smollm2-135m-instruct's word problems (``opefo_trl.data.word_problems``). Every fifth target
(from the third) is *held out*: it appears neither in the warm start's supervised data nor in RL, and pass@k is
measured on it (``held_out_split``).

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

from opefo_trl.data import word_problems
from opefo_trl.data.prompts import format_prompt
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
    #: A pretrained model's folder (built on call) that every run starts from, instead of the tiny model and its
    #: warm start; the report then reads the pretrained readings (``opefo_trl.demo.report``).
    pretrained_model: Callable[[], str] | None = None
    #: Raises ImportError / FileNotFoundError, in one line, when something the task needs is not installed.
    check_installed: Callable[[], None] = lambda: None
    #: Measure where the entropy sits during each run (``opefo_trl.demo.placement``): 16 samples per held-out prompt
    #: every twelfth of the run, cheap on the tiny model, minutes per run on a pretrained one.
    measure_placement: bool = True

    @property
    def start_label(self) -> str:
        """What the policy before RL is called in the report."""
        return "base model (before RL)" if self.pretrained_model else "warm start (before RL)"

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


#: The word-problem task's problems: the first ``WORD_PROBLEMS`` of recipes/smollm2-135m-instruct's generator.
WORD_PROBLEMS = 80
WORD_PROBLEM_TEMPLATE = "worked_example"


def _word_problem_prompt(index: int) -> list[dict]:
    return format_prompt(word_problems.word_problems(WORD_PROBLEMS)[index].question, WORD_PROBLEM_TEMPLATE)


def _word_problem_dataset(indices: Sequence[int]):
    from datasets import Dataset

    problems = word_problems.word_problems(WORD_PROBLEMS)
    return Dataset.from_list(
        [{"prompt": _word_problem_prompt(i), "solution": str(problems[i].result), "target": i} for i in indices]
    )


def strict_math_reward(completions, solution, log_metric=None, log_extra=None, **kwargs):
    """The strict math reward (``math_reward_mode="strict"``, recipes/smollm2-135m-instruct's), imported on first
    call: the synthetic tasks need no math extra."""
    from opefo_trl.data.rewards import build_math_accuracy_reward

    return build_math_accuracy_reward("strict")(completions, solution, log_metric, log_extra, **kwargs)


def _exact_word_problem(text: str, index: int):
    from opefo_trl.data.rewards import verify_completion

    result = word_problems.word_problems(WORD_PROBLEMS)[index].result
    return result if verify_completion(text, str(result), "strict").score == 1.0 else None


def _no_warm_start(count: int, targets: Sequence[int], seed: int) -> list[tuple[int, str]]:
    raise ValueError("The word_problems task starts from the pretrained model: it has no warm start.")


def _check_word_problems_installed() -> None:
    from opefo_trl._extras import require_extra
    from opefo_trl.real_model import wheel_gguf_path

    require_extra("math", "math_verify", "The word_problems task (its strict math reward)")
    wheel_gguf_path()  # the model file (gguf itself is needed only to build the cached folder, and checked then)


def _smollm2() -> str:
    from opefo_trl.real_model import smollm2_135m_instruct

    return str(smollm2_135m_instruct())


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
    "word_problems": DemoTask(
        name="word_problems",
        description="One-step arithmetic word problems on the pretrained SmolLM2-135M-Instruct (make demo-real)",
        targets=tuple(range(WORD_PROBLEMS)),
        prompt=_word_problem_prompt,
        build_dataset=_word_problem_dataset,
        reward=strict_math_reward,
        warm_start_answers=_no_warm_start,
        exact_answer=_exact_word_problem,
        pretrained_model=_smollm2,
        check_installed=_check_word_problems_installed,
        measure_placement=False,
        # recipes/smollm2-135m-instruct's rollouts and learning rate (8 prompts x 4 completions of <= 40 tokens,
        # temperature 0.7, lr 5e-6), sized to the CPU budget of make demo-real; hidden size and layers are the model's.
        defaults=dict(
            hidden_size=576,
            num_layers=30,
            warm_start_steps=0,
            steps=15,
            prompts_per_step=8,
            num_generations=4,
            micro_batch_size=8,  # the recipe's: a 32-completion forward over the 49,152-token vocabulary takes ~11 GB
            learning_rate=5e-6,
            warmup_steps=0,
            temperature=0.7,
            max_completion_length=40,
            pass_at_k_samples=16,
            pass_at_k=[1, 4, 16],
        ),  # fmt: skip
    ),
}
