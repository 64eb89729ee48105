"""Deprecated import path, kept for one release: the prompt templates moved to :mod:`opefo_trl.prompts`. Importing it
warns (DeprecationWarning).
"""

import warnings

from opefo_trl.prompts import (
    DAPO_USER_PROMPT,
    DEFAULT_TEMPLATE,
    PROBLEM_PLACEHOLDER,
    PROMPT_TEMPLATES,
    QWEN_MATH_SYSTEM_PROMPT,
    PromptTemplate,
    format_prompt,
    get_template,
)

__all__ = [
    "DAPO_USER_PROMPT",
    "DEFAULT_TEMPLATE",
    "PROBLEM_PLACEHOLDER",
    "PROMPT_TEMPLATES",
    "PromptTemplate",
    "QWEN_MATH_SYSTEM_PROMPT",
    "format_prompt",
    "get_template",
]

warnings.warn(
    "opefo_trl.templates is deprecated and will be removed in the next release; import the same names from "
    "opefo_trl.prompts.",
    DeprecationWarning,
    stacklevel=2,
)
