"""The math reward and answer extraction on real completions of SmolLM2-135M-Instruct (fixtures/completions.json,
sampled once by make_fixtures.py; answers and rewards read off by hand).

No model is loaded, so these run in every tier, not only `make test-real`. The known hole of the reward (a
restated question paid as the answer) is a strict xfail: it fails once the reward stops paying it, and is then
turned into an ordinary row."""

import json
import pathlib

import pytest

from opefo_trl.data.rewards import extract_answer, math_accuracy_reward

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "completions.json").read_text())
ROWS = FIXTURE["completions"]


def _cases():
    for i, row in enumerate(ROWS):
        marks = []
        if "expected_known_hole" in row:
            marks = [pytest.mark.xfail(strict=True, reason=row["expected_known_hole"])]
        yield pytest.param(row, id=f"{i}-{row['completion'][:24]}", marks=marks)


def test_the_fixture_holds_rewarded_and_unrewarded_real_completions():
    rewards = [row["expected_reward"] for row in ROWS]
    assert len(ROWS) >= 12 and 0 < sum(rewards) < len(rewards)
    assert all(row["completion"] and row["solution"] for row in ROWS)


@pytest.mark.parametrize("row", _cases())
def test_the_reward_and_the_extracted_answer_of_a_real_completion(row):
    completion = [{"role": "assistant", "content": row["completion"]}]  # as TRL hands a conversational completion
    assert math_accuracy_reward([completion], solution=[row["solution"]]) == [row["expected_reward"]]
    assert extract_answer(row["completion"]) == row["expected_answer"]
