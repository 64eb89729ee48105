"""math-verify accuracy reward: both answer forms, None for unparseable gold, counted failures, thread safety."""

import pathlib
import re
import threading

import pytest

from opefo_trl.data import rewards
from opefo_trl.data.rewards import (
    FAILURES_METRIC,
    NOT_FINAL_METRIC,
    VERIFICATION_FAILURES,
    extract_answer,
    math_accuracy_reward,
    score_completion,
    verify_completion,
)


def _chat(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        (r"First 20 + 22 = 42, so the answer is \boxed{42}.", "42", 1.0),
        (r"So the answer is \boxed{41}.", "42", 0.0),
        (r"Thus $x = \boxed{\frac{1}{2}}$", "0.5", 1.0),
        (r"\boxed{3\sqrt{13}}", r"3\sqrt{13}", 1.0),
        (r"\boxed{1} is wrong, I correct it to \boxed{2}", "2", 1.0),  # the last \boxed is the answer
        ("Step 1: add.\nAnswer: 42", "42", 1.0),  # DAPO form
        ("Step 1: add.\nAnswer: 43", "42", 0.0),
        ("Answer: $42$", "42", 1.0),
        ("Answer: $42", "42", 1.0),  # DAPO's "$Answer" placeholder taken literally
        ("Answer: \\$42", "42", 1.0),  # escaped dollar (currency)
        ("**Answer:** 42", "42", 1.0),
        ("Answer: 3\\sqrt{13}", r"3\sqrt{13}", 1.0),  # bare LaTeX after Answer: is read as LaTeX, not as "3"
        ("Answer: \\frac{1}{2}.", "1/2", 1.0),
        ("\\boxed{41} was a slip.\nAnswer: 42", "42", 1.0),  # whichever comes last wins
        ("I think it is 42 but I am not sure", "42", 0.0),  # no anchored answer
        ("", "42", 0.0),
        (r"\boxed{1, 2}", ["$1$", "$2$"], 1.0),  # OlympiadBench-style list gold
    ],
)
def test_score_completion(completion, gold, expected):
    assert score_completion(completion, gold) == expected


@pytest.mark.parametrize("gold", [r"\frac{", "", "@@@"])
def test_unparseable_gold_gives_none_not_zero(gold):
    assert score_completion(r"\boxed{5}", gold) is None
    assert verify_completion(r"\boxed{5}", gold).status == "gold_unparseable"


def test_extract_answer_is_canonical_across_forms():
    assert extract_answer(r"so \boxed{\frac{1}{2}}") == extract_answer("Answer: 1/2") == extract_answer("Answer: 0.5")
    assert extract_answer(r"\boxed{2^{10}}") == "2**10"
    assert extract_answer("nothing to see") is None


def test_reward_accepts_conversational_and_plain_completions():
    solutions = ["42", "42", "7", r"\frac{"]
    conversational = [_chat(r"\boxed{42}"), _chat("Answer: 41"), _chat("Answer: 7"), _chat(r"\boxed{7}")]
    plain = [r"\boxed{42}", "Answer: 41", "Answer: 7", r"\boxed{7}"]
    assert math_accuracy_reward(conversational, solution=solutions) == [1.0, 0.0, 1.0, None]
    assert math_accuracy_reward(plain, solution=solutions) == [1.0, 0.0, 1.0, None]


def test_reward_logs_metrics_and_columns_like_trl_expects():
    metrics, columns = {}, {}
    out = math_accuracy_reward(
        [_chat(r"\boxed{42}"), _chat("Answer: 41"), _chat("x")],
        solution=["42", "42", r"\frac{"],
        log_metric=lambda name, value: metrics.__setitem__(name, value),
        log_extra=lambda name, values: columns.__setitem__(name, values),
        prompts=["p"] * 3,
        completion_ids=[[1]] * 3,
        trainer_state=None,
    )
    assert out == [1.0, 0.0, None]
    assert metrics == {FAILURES_METRIC: 0.0, "rewards/math_accuracy_reward/gold_unparseable": 1.0}
    assert columns == {"answer": ["42", "41", ""], "verification": ["correct", "wrong", "gold_unparseable"]}


def test_reward_from_a_worker_thread_gives_the_right_value():
    before = VERIFICATION_FAILURES.count
    result = {}

    def worker():
        result["rewards"] = math_accuracy_reward(
            [_chat(r"\boxed{\frac{3}{4}}"), "Answer: 0.75", "Answer: 0.7"], solution=[r"\frac34", "3/4", "3/4"]
        )

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    assert result["rewards"] == [1.0, 1.0, 0.0]
    assert VERIFICATION_FAILURES.count == before  # no signal.alarm error swallowed in the thread


@pytest.mark.parametrize(
    "error, message",
    [(rewards.TimeoutException("slow"), "timed out after"), (RuntimeError("sympy broke"), "RuntimeError: sympy broke")],
)
def test_verification_failure_is_counted_and_logged_never_zero(monkeypatch, caplog, error, message):
    def failing_verify(*args, **kwargs):
        raise error

    monkeypatch.setattr(rewards, "verify", failing_verify)
    before = VERIFICATION_FAILURES.count
    metrics = {}
    with caplog.at_level("WARNING", logger="opefo_trl.data.rewards"):
        out = math_accuracy_reward(
            [r"\boxed{42}", r"\boxed{42}", "no answer"],
            solution=["42", "42", "42"],
            log_metric=lambda name, value: metrics.__setitem__(name, value),
        )
    assert out == [None, None, 0.0]  # a failure is excluded (None), an absent answer is wrong (0.0)
    assert VERIFICATION_FAILURES.count == before + 2
    assert metrics[FAILURES_METRIC] == 2.0
    assert "2 of 3 completions could not be verified" in caplog.text
    assert message in VERIFICATION_FAILURES.last_error


def test_parsing_failure_is_counted(monkeypatch):
    def failing_parse(*args, **kwargs):
        raise RuntimeError("parser broke")

    rewards._parse_gold.cache_clear()
    monkeypatch.setattr(rewards, "parse", failing_parse)
    before = VERIFICATION_FAILURES.count
    result = verify_completion(r"\boxed{42}", "42")
    assert result.score is None and result.status == "failed" and "parser broke" in result.error
    assert VERIFICATION_FAILURES.count == before + 1
    rewards._parse_gold.cache_clear()


def test_bad_reward_inputs_are_explained():
    with pytest.raises(ValueError, match="2 completions but 1 solutions"):
        math_accuracy_reward(["a", "b"], solution=["1"])
    with pytest.raises(TypeError, match="string or a list of chat messages"):
        math_accuracy_reward([42], solution=["1"])


# (completion, gold, reward in math_reward_mode "equivalent" (the default), reward in "strict")
MODE_CASES = [
    ("27", "27", 0.0, 1.0),  # a completion that is only a number: strict reads it, the default needs an answer form
    (r"\boxed{27}", "27", 1.0, 1.0),
    ("3 * 9 = 27", "27", 0.0, 0.0),  # working in no answer form
    ("Answer: 3 * 9 = 27", "27", 1.0, 0.0),  # the question's arithmetic restated as the answer
    (r"\boxed{3 \times 9 = 27}", "27", 1.0, 0.0),
    (r"\boxed{3 \times 9}", "27", 1.0, 0.0),
    ("The answer is 3 * 9.", "27", 1.0, 0.0),
    ("The answer is 6 + 3.", "9", 1.0, 0.0),  # issue 40's examples of the hole
    (r"\boxed{6+3}", "9", 1.0, 0.0),
    ("The final answer is 5 - 2.", "3", 1.0, 0.0),
    ("That's the answer to 7 + 1, which is simply 7.", "8", 1.0, 0.0),  # a real SmolLM2 completion
    ("The answer is 3 * 9 = 27.", "27", 1.0, 1.0),  # math-verify reads the value after the last '='
    ("The answer is 27.0", "27", 1.0, 1.0),
    ("27.0", "27", 0.0, 1.0),
    (r"\boxed{27.0}", "27", 1.0, 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("The answer is 1/2.", "0.5", 1.0, 1.0),
    (r"\boxed{\frac{2}{4}}", "1/2", 1.0, 1.0),
    ("The answer is -3/4.", "-0.75", 1.0, 1.0),
    ("1/2", r"\frac{1}{2}", 0.0, 1.0),
    (r"$\frac{1}{2}$", "0.5", 0.0, 1.0),
    ("The answer is 54/2.", "27", 1.0, 0.0),  # a division left undone
    ("Answer: 50%", "0.5", 1.0, 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0, 0.0),
    (r"\boxed{2^{10}}", r"2^{10}", 1.0, 1.0),  # written as the gold is written
    (r"\boxed{3!}", "6", 1.0, 0.0),
    (r"\boxed{3\sqrt{13}}", r"3\sqrt{13}", 1.0, 1.0),  # expressions with nothing left to compute
    (r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{2}", 1.0, 1.0),
    (r"\boxed{x^2+1}", "x^2+1", 1.0, 1.0),
    (r"\boxed{1+1, 2}", ["$2$", "$2$"], 1.0, 0.0),
    ("Answer: 26", "27", 0.0, 0.0),  # wrong numbers
    ("26", "27", 0.0, 0.0),
    (r"\boxed{28}", "27", 0.0, 0.0),
    ("I think it is 42 but I am not sure", "42", 0.0, 0.0),  # not only a number: no answer in either mode
]


@pytest.mark.parametrize("completion, gold, equivalent, strict", MODE_CASES)
def test_what_each_math_reward_mode_pays(completion, gold, equivalent, strict):
    assert score_completion(completion, gold) == equivalent  # the default mode, as it was
    assert score_completion(completion, gold, "equivalent") == equivalent
    assert score_completion(completion, gold, "strict") == strict


def test_the_strict_mode_says_why_it_refused_and_extracts_no_answer():
    assert verify_completion("The answer is 6 + 3.", "9", "strict").status == "not_final"
    assert verify_completion("Answer: 8", "9", "strict").status == "wrong"
    assert verify_completion("nothing", "9", "strict").status == "no_answer"
    assert extract_answer("The answer is 6 + 3.") == "3.0 + 6"
    assert extract_answer("The answer is 6 + 3.", "strict") is None
    assert extract_answer("27", "strict") == extract_answer("The answer is 27.", "strict") == "27"
    assert extract_answer(r"\boxed{\frac{2}{4}}", "strict") == "1/2"


def test_the_strict_reward_logs_its_refusals_under_the_rewards_name():
    strict = rewards.build_math_accuracy_reward("strict")
    assert strict.__name__ == "math_accuracy_reward"  # TRL logs rewards/<name>/mean: one name in both modes
    assert rewards.build_math_accuracy_reward("equivalent") is math_accuracy_reward
    metrics, columns = {}, {}
    out = strict(
        [_chat("The answer is 6 + 3."), _chat("9"), _chat("Answer: 8"), _chat(r"\boxed{9}")],
        solution=["9", "9", "9", r"\frac{"],
        log_metric=metrics.__setitem__,
        log_extra=columns.__setitem__,
        prompts=["p"] * 4,
    )
    assert out == [0.0, 1.0, 0.0, None]
    assert metrics == {
        FAILURES_METRIC: 0.0,
        "rewards/math_accuracy_reward/gold_unparseable": 1.0,
        NOT_FINAL_METRIC: 1.0,
    }
    assert columns == {
        "answer": ["", "9", "8", ""],
        "verification": ["not_final", "correct", "wrong", "gold_unparseable"],
    }


def test_a_math_reward_mode_that_does_not_exist_is_refused():
    with pytest.raises(
        ValueError, match="math_reward_mode='exact' is not a mode of the math reward; give 'equivalent'"
    ):
        rewards.build_math_accuracy_reward("exact")
    with pytest.raises(ValueError, match="math_reward_mode='exact'"):
        score_completion("27", "27", "exact")


def _readme_reward_table():
    """(completion, gold, equivalent, strict) of each example in README's "The math reward: what it pays" table."""
    readme = pathlib.Path(__file__).parents[2] / "README.md"
    section = readme.read_text().split("## The math reward: what it pays", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `") or line.startswith("| ...")]
    for line in rows:
        completions_cell, gold_cell, equivalent, strict = (cell.strip() for cell in line.strip("|").split(" | "))
        completions = re.findall(r"`([^`]+)`", completions_cell)
        golds = [gold.strip("`") for gold in gold_cell.split(", ")]
        golds = golds if len(golds) == len(completions) else golds * len(completions)
        for completion, gold in zip(completions, golds, strict=True):
            yield completion, gold, float(equivalent[0]), float(strict[0])


README_EXAMPLES = list(_readme_reward_table())


@pytest.mark.parametrize("completion, gold, equivalent, strict", README_EXAMPLES)
def test_the_readmes_examples_score_as_it_says(completion, gold, equivalent, strict):
    assert len(README_EXAMPLES) >= 20
    assert (score_completion(completion, gold), score_completion(completion, gold, "strict")) == (equivalent, strict)
