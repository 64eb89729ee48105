"""Deprecated import path, kept for one release: the estimators moved to :mod:`opefo_trl.eval.pass_at_k`. Importing it
warns (DeprecationWarning).
"""

import warnings

from opefo_trl.eval.pass_at_k import avg_at_n, majority_vote, mean_pass_at_k, pass_at_k

__all__ = ["avg_at_n", "majority_vote", "mean_pass_at_k", "pass_at_k"]

warnings.warn(
    "opefo_trl.pass_at_k is deprecated and will be removed in the next release; import the same names from "
    "opefo_trl.eval.pass_at_k.",
    DeprecationWarning,
    stacklevel=2,
)
