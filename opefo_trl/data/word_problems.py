"""One-step arithmetic word problems for a small instruct model: the data of recipes/smollm2-135m-instruct
(``make_word_problems.py`` writes them in GSM8K's format) and of ``make demo-real`` (``opefo_trl.demo.tasks``).

Sums and differences of small numbers and products of small one-digit numbers: the sizes SmolLM2-135M-Instruct
answers right now and then at temperature 0.7 (with two-digit numbers every reward of 32 completions was 0).
Deterministic: the same ``seed`` gives the same problems.

Example:
    >>> first = word_problems(2)[0]
    >>> first.question, first.work, first.result
    ('Grace has 5 stamps and gets 5 more. How many stamps does Grace have now?', '5 + 5', 10)
    >>> gsm8k_rows(1)[0]["answer"]
    '5 + 5 = 10\\n#### 10'
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: Problems in recipes/smollm2-135m-instruct/word_problems.jsonl (seed 0).
RECIPE_PROBLEMS = 256
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kofi", "Lena"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


@dataclass(frozen=True)
class WordProblem:
    question: str
    work: str  # the arithmetic, e.g. "5 + 5"
    result: int


def problem(rng: random.Random) -> WordProblem:
    """One word problem drawn from ``rng``: a sum, a difference or a product, with equal chance."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.choice(["plus", "minus", "times"])
    if kind == "plus":
        a, b = rng.randint(1, 9), rng.randint(1, 5)
        question = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        return WordProblem(question, f"{a} + {b}", a + b)
    if kind == "minus":
        a = rng.randint(4, 10)
        b = rng.randint(1, a - 2)
        return WordProblem(
            f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", f"{a} - {b}", a - b
        )
    a, b = rng.randint(2, 5), rng.randint(2, 4)
    question = f"There are {a} bags with {b} {thing} in each. How many {thing} are there in all?"
    return WordProblem(question, f"{a} * {b}", a * b)


def word_problems(count: int, seed: int = 0) -> list[WordProblem]:
    """The first ``count`` problems of the stream seeded with ``seed`` (a longer list extends a shorter one)."""
    rng = random.Random(seed)
    return [problem(rng) for _ in range(count)]


def gsm8k_rows(count: int = RECIPE_PROBLEMS, seed: int = 0) -> list[dict[str, str]]:
    """The problems in GSM8K's format: ``question``, and ``answer`` with the working and a last line ``#### N``."""
    return [
        {"question": p.question, "answer": f"{p.work} = {p.result}\n#### {p.result}"}
        for p in word_problems(count, seed)
    ]
