"""The word-problem generator: the recipe's data file is its output, byte for byte (one generator for the recipe and
make demo-real)."""

import json
from pathlib import Path

from opefo_trl.data.word_problems import RECIPE_PROBLEMS, gsm8k_rows, word_problems

RECIPE_DATA = Path(__file__).parents[2] / "recipes" / "smollm2-135m-instruct" / "word_problems.jsonl"


def test_the_recipes_data_file_is_the_generators_output():
    assert RECIPE_DATA.read_text() == "".join(json.dumps(row) + "\n" for row in gsm8k_rows())
    assert len(gsm8k_rows()) == RECIPE_PROBLEMS == 256


def test_problems_are_deterministic_and_their_results_right():
    problems = word_problems(200)
    assert problems == word_problems(200) and problems[:80] == word_problems(80)  # a longer list extends a shorter
    for p in problems:
        assert eval(p.work) == p.result >= 1  # noqa: S307 (the generator's own "a + b" / "a - b" / "a * b")
    assert {p.work.split()[1] for p in problems} == {"+", "-", "*"}
