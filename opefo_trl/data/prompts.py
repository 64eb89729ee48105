"""Prompts and completions: what a model is shown and what of its answer a reward reads, one way for training,
evaluation and the demo.

- Templates (:data:`PROMPT_TEMPLATES`, :func:`format_prompt`) turn a bare math problem into TRL conversational
  messages. Training (``opefo-train``) and evaluation (``opefo-eval``) both format problems through this registry, so
  a model is evaluated with exactly the prompt it was trained on.
- :func:`render_prompts` turns TRL prompts (chats or plain strings) into token ids exactly as ``GRPOTrainer``
  tokenizes them before generating, so ``opefo-train``'s length check, ``opefo-eval`` and the demo see the very
  prompt the policy sees.
- :func:`completion_to_text` turns a TRL completion back into the text a reward function scores, and
  :func:`gold_to_text` a data set's gold answer into the text it is compared with.

Registered templates:

- ``"qwen_math_boxed"``: the Qwen2.5-Math system prompt ("Please reason step by step, and put your final answer
  within \\boxed{}.") followed by the problem as the user message. Used by the OPEFO paper's Qwen recipes.
- ``"dapo"``: DAPO-Math-17k's user prompt, which asks for a last line ``Answer: $Answer``.
- ``"plain"``: the problem alone as the user message.
- ``"worked_example"``: one solved word problem as a previous user / assistant turn (the working, then a last line
  ``Answer: N``), then the problem. A small instruct model copies the example's answer line, which the math reward
  reads; under ``"qwen_math_boxed"`` SmolLM2-135M-Instruct explains until its 40 tokens run out and is almost never
  paid (recipes/README.md).

Both answer forms (``\\boxed{...}`` and ``Answer: ...``) are extracted by :mod:`opefo_trl.data.rewards`.

Example:
    >>> from opefo_trl.data.prompts import format_prompt
    >>> format_prompt("What is 2 + 3?", "qwen_math_boxed")  # doctest: +NORMALIZE_WHITESPACE
    [{'role': 'system', 'content': 'Please reason step by step, and put your final answer within \\\\boxed{}.'},
     {'role': 'user', 'content': 'What is 2 + 3?'}]
    >>> format_prompt("What is 2 + 3?", "plain")
    [{'role': 'user', 'content': 'What is 2 + 3?'}]
    >>> completion_to_text([{"role": "assistant", "content": "3 + 4"}])
    '3 + 4'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PROBLEM_PLACEHOLDER = "{problem}"


@dataclass(frozen=True)
class PromptTemplate:
    """A system message (optional), solved examples (optional: (question, answer) pairs, each a user and an assistant
    turn before the problem) and a user message with a ``{problem}`` placeholder.

    The placeholder is substituted with :meth:`str.replace`, not :meth:`str.format`, so LaTeX braces in problems
    (``\\frac{1}{2}``) need no escaping.
    """

    user: str
    system: str | None = None
    description: str = ""
    examples: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.user.count(PROBLEM_PLACEHOLDER) != 1:
            raise ValueError(
                f"A prompt template's user message must contain the placeholder {PROBLEM_PLACEHOLDER!r} exactly once, "
                f"got {self.user!r}."
            )

    def format(self, problem: str) -> list[dict[str, str]]:
        """Return the conversational messages (TRL's ``prompt`` format) for ``problem``."""
        messages = []
        if self.system is not None:
            messages.append({"role": "system", "content": self.system})
        for question, answer in self.examples:
            messages.append({"role": "user", "content": self.user.replace(PROBLEM_PLACEHOLDER, question)})
            messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": self.user.replace(PROBLEM_PLACEHOLDER, problem)})
        return messages


QWEN_MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

DAPO_USER_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

#: The solved example of ``"worked_example"``: a problem of the kind ``opefo_trl.data.word_problems`` writes (not one
#: of them: a name and a thing it never uses).
WORKED_EXAMPLE_QUESTION = "Tom has 2 kites and gets 3 more. How many kites does Tom have now?"
WORKED_EXAMPLE_ANSWER = "2 + 3 = 5\nAnswer: 5"

PROMPT_TEMPLATES: dict[str, PromptTemplate] = {
    "qwen_math_boxed": PromptTemplate(
        system=QWEN_MATH_SYSTEM_PROMPT,
        user=PROBLEM_PLACEHOLDER,
        description="Qwen2.5-Math system prompt asking for the final answer in \\boxed{}; problem as user message.",
    ),
    "dapo": PromptTemplate(
        user=DAPO_USER_PROMPT,
        description='DAPO-Math-17k user prompt asking for a last line "Answer: $Answer".',
    ),
    "plain": PromptTemplate(user=PROBLEM_PLACEHOLDER, description="The problem alone as the user message."),
    "worked_example": PromptTemplate(
        user=PROBLEM_PLACEHOLDER,
        examples=((WORKED_EXAMPLE_QUESTION, WORKED_EXAMPLE_ANSWER),),
        description='One solved word problem as a previous turn (last line "Answer: N"), then the problem.',
    ),
}

DEFAULT_TEMPLATE = "qwen_math_boxed"


def get_template(template: str | PromptTemplate) -> PromptTemplate:
    """Look up a registered template by name (a :class:`PromptTemplate` is returned unchanged).

    Raises:
        ValueError: if ``template`` is not a registered name; the message lists the valid names.
    """
    if isinstance(template, PromptTemplate):
        return template
    if not isinstance(template, str) or template not in PROMPT_TEMPLATES:
        raise ValueError(
            f"Unknown prompt template {template!r}. Valid templates: {', '.join(sorted(PROMPT_TEMPLATES))} "
            f"(or pass a opefo_trl.data.prompts.PromptTemplate)."
        )
    return PROMPT_TEMPLATES[template]


def format_prompt(problem: str, template: str | PromptTemplate = DEFAULT_TEMPLATE) -> list[dict[str, str]]:
    """Format ``problem`` with a registered template into TRL conversational messages.

    Args:
        problem: The problem text (LaTeX allowed; inserted verbatim).
        template: A name in :data:`PROMPT_TEMPLATES` (``"qwen_math_boxed"``, ``"dapo"``, ``"plain"``) or a
            :class:`PromptTemplate`.

    Returns:
        A list of ``{"role": ..., "content": ...}`` messages, system message first when the template has one.

    Raises:
        ValueError: unknown template name (the message lists the valid ones) or empty problem.
        TypeError: ``problem`` is not a string.

    Example:
        >>> messages = format_prompt("Compute $\\\\frac{1}{2} + \\\\frac{1}{2}$.", "dapo")
        >>> messages[0]["role"], messages[0]["content"].splitlines()[2]
        ('user', 'Compute $\\\\frac{1}{2} + \\\\frac{1}{2}$.')
    """
    resolved = get_template(template)
    if not isinstance(problem, str):
        raise TypeError(f"format_prompt expects the problem as a str, got {type(problem).__name__}: {problem!r}.")
    if not problem.strip():
        raise ValueError("format_prompt got an empty problem; check the data set's question column.")
    return resolved.format(problem)


def render_prompts(tokenizer, prompts: Sequence, *, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of TRL prompts, as ``GRPOTrainer`` tokenizes them for generation.

    Conversational prompts (lists of ``{"role", "content"}`` messages) go through the tokenizer's chat template with
    the generation prompt appended (the assistant header the completion follows); plain-text prompts are tokenized
    as they are, special tokens included.

    Raises:
        ValueError: conversational prompts but the tokenizer has no chat template, or a mix of both kinds.
    """
    from trl.data_utils import is_conversational

    prompts = list(prompts)
    if not prompts:
        return []
    conversational = [is_conversational({"prompt": prompt}) for prompt in prompts]
    if any(conversational) and not all(conversational):
        other = conversational.index(not conversational[0])
        raise ValueError(
            f"Prompts mix chats and plain text (prompt 0 is {'a chat' if conversational[0] else 'text'}, prompt "
            f"{other} is not); give every prompt in one form."
        )
    if not conversational[0]:
        return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer of {getattr(tokenizer, 'name_or_path', None) or 'the model'} has no chat template, which "
            "conversational prompts need; use a tokenizer that has one (e.g. the instruct model's)."
        )
    encoded = tokenizer.apply_chat_template(
        conversation=prompts,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **(chat_template_kwargs or {}),
    )
    return [list(ids) for ids in encoded["input_ids"]]


def _content_text(content: Any) -> str | None:
    """A message's content as text: a string, or the text parts of a multimodal content list joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, (list, tuple)):
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return None


def completion_to_text(completion: Any) -> str:
    """The text of a TRL completion that a reward scores: a plain string as it is, or for a conversational completion
    the content of its last assistant message.

    ``GRPOTrainer`` passes conversational completions as ``[{"role": "assistant", "content": text}]``; with tool
    calling a completion holds the whole exchange (``assistant``, ``tool``, ..., ``assistant``) and its final answer
    is the last assistant turn, so tool outputs and earlier turns are never scored. A message without a ``role``
    counts as the assistant's; content given as a list of parts (``[{"type": "text", "text": ...}]``) is joined.

    Raises:
        TypeError: anything else (the message shows what was given).

    Example:
        >>> completion_to_text("Answer: 42")
        'Answer: 42'
        >>> completion_to_text([{"role": "assistant", "content": "Let me add.", "tool_calls": ["..."]},
        ...                     {"role": "tool", "name": "add", "content": "41"},
        ...                     {"role": "assistant", "content": [{"type": "text", "text": "Answer: 42"}]}])
        'Answer: 42'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion and all(isinstance(m, dict) for m in completion):
        assistant = [m for m in completion if m.get("role", "assistant") == "assistant"]
        text = _content_text(assistant[-1].get("content")) if assistant else None
        if text is not None:
            return text
    raise TypeError(
        "Expected a completion as a string or a list of chat messages ending in an assistant turn "
        f"([{{'role': 'assistant', 'content': ...}}]), got {completion!r:.200}."
    )


def gold_to_text(gold: Any) -> str:
    r"""Turn a gold answer into one LaTeX string: a list (OlympiadBench ``final_answer``) becomes ``a, b``.

    Example:
        >>> gold_to_text(["$\\frac{1}{2}$"]), gold_to_text([1, 2]), gold_to_text(42)
        ('\\frac{1}{2}', '1, 2', '42')
    """
    if isinstance(gold, (list, tuple)):
        return ", ".join(_strip_math_delimiters(gold_to_text(item)) for item in gold)
    if gold is None:
        return ""
    return str(gold).strip()


def _strip_math_delimiters(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        return text.strip("$").strip()
    return text
