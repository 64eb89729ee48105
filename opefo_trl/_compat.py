"""The TRL versions this package supports, checked at import time.

OPEFOTrainer hooks private GRPOTrainer methods (`_generate_and_score_completions`, `_compute_loss`,
`_get_per_token_logps_and_entropies`) whose signatures drift between TRL releases, so an untested TRL is
refused with a clear message rather than failing deep inside a training step.
"""

from __future__ import annotations

from packaging.version import Version

TRL_MIN = "1.16.0"
TRL_MAX_EXCLUSIVE = "1.17.0"


def check_trl_version(version: str | None = None) -> str:
    """Raise ImportError unless ``version`` (default: the installed TRL) is in the supported range."""
    if version is None:
        try:
            import trl
        except ImportError as err:  # pragma: no cover - trl is a hard dependency
            raise ImportError(
                f"opefo-trl needs TRL >={TRL_MIN},<{TRL_MAX_EXCLUSIVE}: "
                f"`pip install 'trl>={TRL_MIN},<{TRL_MAX_EXCLUSIVE}'`."
            ) from err
        version = trl.__version__
    parsed = Version(version)
    if not (Version(TRL_MIN) <= Version(parsed.base_version) < Version(TRL_MAX_EXCLUSIVE)):
        raise ImportError(
            f"opefo-trl supports TRL >={TRL_MIN},<{TRL_MAX_EXCLUSIVE}, but TRL {version} is installed. "
            f"OPEFOTrainer overrides private GRPOTrainer hooks that change between releases; install a supported "
            f"version with `pip install 'trl>={TRL_MIN},<{TRL_MAX_EXCLUSIVE}'`."
        )
    return version
