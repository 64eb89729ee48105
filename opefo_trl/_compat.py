"""The TRL versions this package runs with, checked at import time by what the trainer depends on.

OPEFOTrainer overrides and calls private GRPOTrainer / Trainer methods (:data:`TRL_HOOKS`), whose signatures can
drift between TRL releases. The package is tested with TRL ``>=1.16.0,<1.17.0`` (:data:`TRL_TESTED`):

- a TRL in the tested range imports silently;
- a newer TRL whose hooks still take the parameters the trainer relies on imports with one warning naming the tested
  range;
- a newer TRL in which a hook changed, or an older one, is refused with an ImportError naming the hook (or the floor)
  and the install command of a tested version, rather than failing deep inside a training step.
"""

from __future__ import annotations

import functools
import inspect
import warnings

from packaging.version import Version

TRL_MIN = "1.16.0"
TRL_MAX_EXCLUSIVE = "1.17.0"
TRL_TESTED = f">={TRL_MIN},<{TRL_MAX_EXCLUSIVE}"
_INSTALL_TESTED = f"`pip install 'trl{TRL_TESTED}'`"

#: The GRPOTrainer methods OPEFOTrainer overrides (``__init__`` to ``_save_checkpoint``) or calls (the rest), with
#: the parameters after ``self`` it relies on, in order. A later parameter is fine if it has a default.
TRL_HOOKS: dict[str, tuple[str, ...]] = {
    "__init__": ("model", "reward_funcs", "args"),
    "_generate_and_score_completions": ("inputs",),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
    ),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "create_optimizer": (),
    "train": ("resume_from_checkpoint",),
    "_save_checkpoint": ("model", "trial"),
    "save_model": ("output_dir", "_internal_call"),
    "_get_output_dir": ("trial",),
    "_tokenize_prompts": ("prompts",),
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations"),
}


def hook_change(trainer_class: type, name: str, expected: tuple[str, ...]) -> str | None:
    """How ``trainer_class.name`` differs from what the trainer relies on, or None if it still fits."""
    method = getattr(trainer_class, name, None)
    if not callable(method):
        return f"`{name}` no longer exists"
    parameters = list(inspect.signature(method).parameters.values())[1:]  # after self
    names = tuple(p.name for p in parameters[: len(expected)])
    later_required = [
        p.name
        for p in parameters[len(expected) :]
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if names == expected and not later_required:
        return None
    found = ", ".join(p.name for p in parameters)
    return f"`{name}` takes ({found}) where OPEFOTrainer expects ({', '.join(expected)}[, optional ...])"


def check_trl_version(version: str | None = None, trainer_class: type | None = None) -> str:
    """Check ``version`` (default: the installed TRL) and, outside the tested range, ``trainer_class``'s hooks
    (default: TRL's ``GRPOTrainer``); return the version.

    Raises ImportError for a TRL older than the tested range or one whose hooks changed; warns (UserWarning) for a
    newer one whose hooks fit.
    """
    if version is None:
        import trl

        version = trl.__version__
    release = Version(Version(version).base_version)
    if release < Version(TRL_MIN):
        raise ImportError(
            f"opefo-trl needs TRL >= {TRL_MIN} (tested: {TRL_TESTED}), but TRL {version} is installed: "
            f"{_INSTALL_TESTED}."
        )
    if release < Version(TRL_MAX_EXCLUSIVE):
        return version
    if trainer_class is None:
        import trl

        trainer_class = trl.GRPOTrainer
    changes = [change for name, expected in TRL_HOOKS.items() if (change := hook_change(trainer_class, name, expected))]
    if changes:
        raise ImportError(
            f"opefo-trl is tested with TRL {TRL_TESTED}, and in the installed TRL {version} a GRPOTrainer method "
            f"OPEFOTrainer overrides or calls changed: {'; '.join(changes)}. Install a tested TRL: {_INSTALL_TESTED}."
        )
    warnings.warn(
        f"opefo-trl is tested with TRL {TRL_TESTED}; TRL {version} is installed. The GRPOTrainer methods "
        f"OPEFOTrainer overrides and calls have the parameters it expects, but what they compute is untested: "
        f"{_INSTALL_TESTED} for a tested version.",
        UserWarning,
        stacklevel=2,
    )
    return version


@functools.cache
def check_installed_trl() -> str:
    """:func:`check_trl_version` of the installed TRL, once per process (one warning, however many modules ask)."""
    return check_trl_version()
