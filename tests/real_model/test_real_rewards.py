"""The math reward and answer extraction on real completions of SmolLM2-135M-Instruct (fixtures/completions.json,
sampled once by make_fixtures.py; answers and rewards read off by hand), in both math reward modes.

No model is loaded, so these run in every tier, not only `make test-real`. The default mode's known hole (a
restated question paid as the answer: 'the answer to 7 + 1' against 8) is pinned as it is, and the strict mode is
checked to refuse it."""

import json
import pathlib

import pytest

from opefo_trl.data.reward_modes import MATH_REWARD_MODES
from opefo_trl.data.rewards import build_math_accuracy_reward, extract_answer

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "completions.json").read_text())
ROWS = FIXTURE["completions"]


def _expected(row, mode):
    """(reward, answer) the fixture expects in ``mode``: the row's own, or the default mode's where they differ."""
    in_equivalent = row.get("expected_in_equivalent_mode") if mode == "equivalent" else None
    if in_equivalent is not None:
        return in_equivalent["reward"], in_equivalent["answer"]
    return row["expected_reward"], row["expected_answer"]


def test_the_fixture_holds_rewarded_and_unrewarded_real_completions():
    rewards = [row["expected_reward"] for row in ROWS]
    assert len(ROWS) >= 12 and 0 < sum(rewards) < len(rewards)
    assert all(row["completion"] and row["solution"] for row in ROWS)


@pytest.mark.parametrize("mode", MATH_REWARD_MODES)
@pytest.mark.parametrize("row", ROWS, ids=[f"{i}-{row['completion'][:24]}" for i, row in enumerate(ROWS)])
def test_the_reward_and_the_extracted_answer_of_a_real_completion(row, mode):
    completion = [{"role": "assistant", "content": row["completion"]}]  # as TRL hands a conversational completion
    reward, answer = _expected(row, mode)
    assert build_math_accuracy_reward(mode)([completion], solution=[row["solution"]]) == [reward]
    assert extract_answer(row["completion"], mode) == answer


def test_the_default_mode_pays_the_restated_question_and_the_strict_mode_refuses_it():
    (hole,) = [row for row in ROWS if "expected_in_equivalent_mode" in row]
    completion, solution = hole["completion"], [hole["solution"]]
    assert build_math_accuracy_reward("equivalent")([completion], solution=solution) == [1.0]
    columns = {}
    strict = build_math_accuracy_reward("strict")([completion], solution=solution, log_extra=columns.__setitem__)
    assert strict == [0.0] and columns == {"answer": [""], "verification": ["not_final"]}
