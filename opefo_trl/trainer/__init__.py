"""The TRL glue: `OPEFOConfig(GRPOConfig)`, `OPEFOTrainer(GRPOTrainer)` and the small parts its hooks hand over to.

`OPEFOTrainer` is loaded on first use (it imports TRL's `GRPOTrainer`); the parts are modules of this package, each
with its own state and explicit dependencies (see `opefo_trl.trainer.trainer`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["OPEFOTrainer"]


def __getattr__(name: str) -> Any:
    if name == "OPEFOTrainer":
        from opefo_trl.trainer.trainer import OPEFOTrainer

        return OPEFOTrainer
    raise AttributeError(f"module 'opefo_trl.trainer' has no attribute {name!r}")
