"""Prompt templates that turn a bare math problem into TRL conversational messages.

Training (``opefo-train``) and evaluation (``opefo-eval``) both format problems through this registry, so a model is
evaluated with exactly the prompt it was trained on.

Registered templates:

- ``"qwen_math_boxed"``: the Qwen2.5-Math system prompt ("Please reason step by step, and put your final answer
  within \\boxed{}.") followed by the problem as the user message. Used by the OPEFO paper's Qwen recipes.
- ``"dapo"``: DAPO-Math-17k's user prompt, which asks for a last line ``Answer: $Answer``.
- ``"plain"``: the problem alone as the user message.

Both answer forms (``\\boxed{...}`` and ``Answer: ...``) are extracted by :mod:`opefo_trl.rewards`.

Example:
    >>> from opefo_trl.templates import format_prompt
    >>> format_prompt("What is 2 + 3?", "qwen_math_boxed")  # doctest: +NORMALIZE_WHITESPACE
    [{'role': 'system', 'content': 'Please reason step by step, and put your final answer within \\\\boxed{}.'},
     {'role': 'user', 'content': 'What is 2 + 3?'}]
    >>> format_prompt("What is 2 + 3?", "plain")
    [{'role': 'user', 'content': 'What is 2 + 3?'}]
"""

from __future__ import annotations

from dataclasses import dataclass

PROBLEM_PLACEHOLDER = "{problem}"


@dataclass(frozen=True)
class PromptTemplate:
    """A system message (optional) and a user message with a ``{problem}`` placeholder.

    The placeholder is substituted with :meth:`str.replace`, not :meth:`str.format`, so LaTeX braces in problems
    (``\\frac{1}{2}``) need no escaping.
    """

    user: str
    system: str | None = None
    description: str = ""

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
        messages.append({"role": "user", "content": self.user.replace(PROBLEM_PLACEHOLDER, problem)})
        return messages


QWEN_MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

DAPO_USER_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

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
            f"(or pass a opefo_trl.templates.PromptTemplate)."
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
