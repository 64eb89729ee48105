"""Writes word_problems.jsonl beside this file: one-step arithmetic word problems in GSM8K's format
(``question``; ``answer`` ending in ``#### N``), which `opefo-train --dataset_name gsm8k --dataset_files ...` reads.

Deterministic (seed 0); run it again to get the same file:
``python recipes/smollm2-135m-instruct/make_word_problems.py``.
Sums and differences of small numbers and products of small one-digit numbers: the sizes SmolLM2-135M-Instruct
answers right now and then at temperature 0.7 (with two-digit numbers every reward of 32 completions was 0). Under
the recipe's prompt and strict reward, every reward of the first 3 training steps measured here was still 0
(recipes/README.md).
"""

import json
import random
from pathlib import Path

PROBLEMS = 256
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kofi", "Lena"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


def problem(rng: random.Random) -> tuple[str, str, int]:
    """One word problem: (question, worked answer, result)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.choice(["plus", "minus", "times"])
    if kind == "plus":
        a, b = rng.randint(1, 9), rng.randint(1, 5)
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", f"{a} + {b}", a + b
    if kind == "minus":
        a = rng.randint(4, 10)
        b = rng.randint(1, a - 2)
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", f"{a} - {b}", a - b
    a, b = rng.randint(2, 5), rng.randint(2, 4)
    return f"There are {a} bags with {b} {thing} in each. How many {thing} are there in all?", f"{a} * {b}", a * b


def rows(count: int = PROBLEMS, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        question, work, result = problem(rng)
        out.append({"question": question, "answer": f"{work} = {result}\n#### {result}"})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("word_problems.jsonl")
    path.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {PROBLEMS} problems to {path}")
