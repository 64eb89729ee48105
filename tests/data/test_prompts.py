"""opefo_trl.data.prompts: the exact messages a user trains and evaluates with, rendered as the trainer renders them,
and the text of a completion that a reward reads."""

import pytest

from opefo_trl.data.prompts import (
    DAPO_USER_PROMPT,
    PROMPT_TEMPLATES,
    QWEN_MATH_SYSTEM_PROMPT,
    PromptTemplate,
    completion_to_text,
    format_prompt,
    render_prompts,
)

PROBLEM = r"Let $f(x) = \frac{1}{x}$ and $\{a_n\}$ a sequence. Compute $f(2)$."


def test_registry_has_the_documented_templates():
    assert {"qwen_math_boxed", "dapo", "plain", "worked_example"} <= set(PROMPT_TEMPLATES)


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


def test_worked_example_puts_one_solved_problem_before_the_problem():
    assert format_prompt("Ana has 2 cats and gets 1 more. How many cats does Ana have now?", "worked_example") == [
        {"role": "user", "content": "Tom has 2 kites and gets 3 more. How many kites does Tom have now?"},
        {"role": "assistant", "content": "2 + 3 = 5\nAnswer: 5"},
        {"role": "user", "content": "Ana has 2 cats and gets 1 more. How many cats does Ana have now?"},
    ]


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


# ----------------------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_chat_prompts_render_with_the_generation_prompt(tokenizer):
    chats = [
        [{"role": "user", "content": "What is 1 + 1?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
    ]
    ids = render_prompts(tokenizer, chats)
    assert tokenizer.decode(ids[0]) == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids[1]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?")
    for chat, row in zip(chats, ids, strict=True):  # one by one or batched: the same ids
        (alone,) = render_prompts(tokenizer, [chat])
        assert alone == row
    assert render_prompts(tokenizer, []) == []


def test_text_prompts_are_tokenized_as_they_are(tokenizer):
    assert render_prompts(tokenizer, ["1 + 1 ="]) == [tokenizer("1 + 1 =")["input_ids"]]


def test_bad_prompts_are_explained(tokenizer):
    with pytest.raises(ValueError, match="Prompts mix chats and plain text .*prompt 1 is not"):
        render_prompts(tokenizer, ["text", [{"role": "user", "content": "chat"}]])
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="has no chat template"):
            render_prompts(tokenizer, [[{"role": "user", "content": "hi"}]])
    finally:
        tokenizer.chat_template = template


# ----------------------------------------------------------------------------------------------------------------------
# Completions
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, text",
    [
        ("Answer: 42", "Answer: 42"),
        ([{"role": "assistant", "content": "Answer: 42"}], "Answer: 42"),  # what GRPOTrainer passes
        ({"role": "assistant", "content": "7"}, "7"),
        ([{"content": "3 + 4"}], "3 + 4"),  # no role: the assistant's
        (
            [{"role": "assistant", "content": [{"type": "text", "text": "Ans"}, {"type": "text", "text": "wer: 1"}]}],
            "Answer: 1",
        ),
        ([{"role": "assistant", "content": None}], ""),
        (
            [  # tool calling: assistant, tool, ..., assistant; only the final turn is the answer
                {"role": "assistant", "content": "Let me add.", "tool_calls": [{"type": "function"}]},
                {"role": "tool", "name": "add", "content": "41"},
                {"role": "assistant", "content": "Answer: 42"},
            ],
            "Answer: 42",
        ),
    ],
)
def test_completion_to_text(completion, text):
    assert completion_to_text(completion) == text


@pytest.mark.parametrize("completion", [42, [], [{"role": "tool", "content": "41"}], ["text"]])
def test_completion_to_text_refuses_other_shapes(completion):
    with pytest.raises(TypeError, match="a string or a list of chat messages ending in an assistant turn"):
        completion_to_text(completion)
