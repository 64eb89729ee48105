"""Deprecated import path, kept for one release: local data files moved to :mod:`opefo_trl.data`, model paths, weight
fingerprints and the context length to :mod:`opefo_trl.model_files`, prompt rendering and completion text to
:mod:`opefo_trl.prompts`. Importing it warns (DeprecationWarning).
"""

import warnings

from opefo_trl.data import LOCAL_FILE_BUILDERS, is_local_data_file, load_local_files, local_file_builder
from opefo_trl.model_files import (
    check_model_name_or_path,
    looks_like_local_path,
    model_context_length,
    weight_file_fingerprint,
    weight_fingerprints,
)
from opefo_trl.prompts import completion_to_text, render_prompts

__all__ = [
    "LOCAL_FILE_BUILDERS",
    "check_model_name_or_path",
    "completion_to_text",
    "is_local_data_file",
    "load_local_files",
    "local_file_builder",
    "looks_like_local_path",
    "model_context_length",
    "render_prompts",
    "weight_file_fingerprint",
    "weight_fingerprints",
]

warnings.warn(
    "opefo_trl.model_io is deprecated and will be removed in the next release; import the same names from "
    "opefo_trl.data (local data files), opefo_trl.model_files (model paths, weight fingerprints, context length) or "
    "opefo_trl.prompts (render_prompts, completion_to_text).",
    DeprecationWarning,
    stacklevel=2,
)
