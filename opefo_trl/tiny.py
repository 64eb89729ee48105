"""Deprecated import path, kept for one release: the tiny models moved to :mod:`opefo_trl.testing`. Importing it warns
(DeprecationWarning).
"""

import warnings

from opefo_trl.testing import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    keep_rms_norm_in_model_dtype,
    warm_up_tiny_model,
)

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "keep_rms_norm_in_model_dtype",
    "warm_up_tiny_model",
]

warnings.warn(
    "opefo_trl.tiny is deprecated and will be removed in the next release; import the same names from "
    "opefo_trl.testing.",
    DeprecationWarning,
    stacklevel=2,
)
