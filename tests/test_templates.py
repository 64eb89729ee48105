"""Prompt templates: the exact messages a user trains and evaluates with."""

import pytest

from opefo_trl.templates import (
    DAPO_USER_PROMPT,
    PROMPT_TEMPLATES,
    QWEN_MATH_SYSTEM_PROMPT,
    PromptTemplate,
    format_prompt,
)

PROBLEM = r"Let $f(x) = \frac{1}{x}$ and $\{a_n\}$ a sequence. Compute $f(2)$."


def test_registry_has_the_documented_templates():
    assert {"qwen_math_boxed", "dapo", "plain"} <= set(PROMPT_TEMPLATES)


def test_qwen_math_boxed_is_system_prompt_plus_problem():
    messages = format_prompt(PROBLEM, "qwen_math_boxed")
    assert messages == [
        {"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."},
        {"role": "user", "content": PROBLEM},
    ]
    assert QWEN_MATH_SYSTEM_PROMPT == messages[0]["content"]


def test_dapo_prompt_wraps_problem_verbatim_with_latex_braces():
    messages = format_prompt(PROBLEM, "dapo")
    assert len(messages) == 1 and messages[0]["role"] == "user"
    expected = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        + PROBLEM
        + '\n\nRemember to put your answer on its own line after "Answer:".'
    )
    assert messages[0]["content"] == expected
    assert DAPO_USER_PROMPT.replace("{problem}", PROBLEM) == expected


def test_plain_is_the_problem_alone():
    assert format_prompt("What is 2 + 3?", "plain") == [{"role": "user", "content": "What is 2 + 3?"}]


def test_messages_render_with_a_chat_template(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    text = tokenizer.apply_chat_template(format_prompt("What is 2 + 3?"), tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nPlease reason step by step")
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_template_lists_valid_names():
    with pytest.raises(ValueError, match=r"Unknown prompt template 'qwen'.*dapo, plain, qwen_math_boxed"):
        format_prompt("1+1", "qwen")


def test_custom_template_and_its_validation():
    template = PromptTemplate(system="Be brief.", user="Q: {problem}\nA:")
    assert format_prompt("1+1", template) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 1+1\nA:"},
    ]
    with pytest.raises(ValueError, match="placeholder"):
        PromptTemplate(user="no placeholder here")


def test_bad_problem_is_rejected():
    with pytest.raises(TypeError, match="str"):
        format_prompt(["What is 2 + 3?"], "plain")
    with pytest.raises(ValueError, match="empty problem"):
        format_prompt("   ", "plain")
