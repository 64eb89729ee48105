"""opefo-trl: On-Policy Entropy Flow Optimization (OPEFO) and entropy-control baselines for TRL.

    >>> from opefo_trl import OPEFOConfig, OPEFOTrainer   # drop-in for GRPOConfig / GRPOTrainer

The algorithm (`opefo_trl.maths`) and the token methods (`opefo_trl.methods`) import torch only; the TRL glue
(`OPEFOConfig`, `OPEFOTrainer`, `opefo_trl.trainer`) is loaded on first use and checks the installed TRL version.
"""

__version__ = "0.1.0"

_LAZY = {
    "OPEFOConfig": "opefo_trl.trainer.config",
    "OPEFOTrainer": "opefo_trl.trainer",
}

__all__ = ["OPEFOConfig", "OPEFOTrainer", "__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'opefo_trl' has no attribute {name!r}")
