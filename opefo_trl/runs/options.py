"""The options a checkpoint was trained with, and what a resume with other values does.

Every checkpoint holds ``opefo_run_options.json``: the options below as the run had them. A resume compares them with
its own, following what transformers' ``Trainer`` restores from a checkpoint:

- refused, with the old and new values (:data:`REFUSED`): options whose new value the checkpoint would silently
  override (the learning rate and schedule live in the restored scheduler, the optimizer's hyperparameters in its
  restored state), or that change which prompts the steps already trained stand for (the batch shape: the resumed
  run would skip the wrong number of batches and count its epoch wrongly; the seed: every epoch's order);
- taken, with one line saying what changes from the resumed step on (:data:`TAKEN`, and every option of the token
  methods): sampling, lengths and loss options, which transformers reads afresh on resume as well.

``max_steps`` and ``num_train_epochs`` are how a run is extended, and logging / saving options change no result: they
are not compared.

What the run trains on is recorded beside its options when it is known (``opefo-train`` gives the trainer
:func:`training_inputs`: the training data's identity, its prompt template and the reward functions) and refused on
resume when it differs. The final model holds the same file (``OPEFOTrainer.save_model``): ``opefo-eval`` reads the
prompt template and reward mode the run was trained with from it (:func:`read_run_options`).
A checkpoint that records none of it (written by an earlier version) still resumes, with one line saying what was
not compared.

Example:
    >>> refused, taken = compare_options({"learning_rate": 1e-6, "temperature": 1.0},
    ...                                  {"learning_rate": 2e-6, "temperature": 0.7})
    >>> refused, taken
    (['learning_rate 1e-06 -> 2e-06'], ['temperature 1.0 -> 0.7'])
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from enum import Enum
from typing import Any

from opefo_trl.runs.files import RUN_OPTIONS_NAME, CheckpointError, checkpoint_step, write_json_atomically

#: What the run trains on (:func:`training_inputs`), recorded when the trainer is given it; refused on resume.
INPUTS: tuple[str, ...] = ("training_data", "prompt_template", "reward_funcs", "math_reward_mode")
#: Refused on resume, by why (the reason is part of the error).
REFUSED: dict[str, tuple[str, ...]] = {
    "the checkpoint's scheduler and optimizer state would override it (transformers restores them)": (
        "learning_rate",
        "lr_scheduler_type",
        "lr_scheduler_kwargs",
        "warmup_steps",
        "warmup_ratio",
        "optim",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
    ),
    "the steps already trained would stand for other prompts (the epoch counter and the batches skipped on resume "
    "are counted in this shape)": (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_generations",
        "steps_per_generation",
        "generation_batch_size",
        "num_iterations",
        "world_size",
    ),
    "every epoch's prompt order is drawn from it": ("seed", "shuffle_dataset"),
    "the steps already trained learned from other data or rewards, which the resumed run would mix with these": INPUTS,
}
#: Taken on resume, with one line each; the token methods' options are taken too.
TAKEN: tuple[str, ...] = (
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "beta",
    "epsilon",
    "epsilon_high",
    "loss_type",
    "scale_rewards",
    "reward_weights",
    "mask_truncated_completions",
    "max_grad_norm",
)


def _method_options(args: Any) -> list[str]:
    """The options the config adds to TRL's GRPOConfig: the token methods' and the entropy flow's."""
    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    return (
        [f.name for f in dataclasses.fields(args) if f.name not in inherited] if dataclasses.is_dataclass(args) else []
    )


def _plain(value: Any) -> Any:
    """``value`` as it reads back from JSON (enums by value), so that saved and current values compare equal."""
    if isinstance(value, Enum):
        value = value.value
    return json.loads(json.dumps(value, default=str))


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def training_inputs(
    dataset_name: str,
    dataset_config: str | None,
    split: str,
    data_files: list[str] | None,
    reward_funcs: list[str],
    math_reward_mode: str | None = None,
    prompt_template: str | None = None,
) -> dict[str, Any]:
    """What a run trains on, as its checkpoints record it (:data:`INPUTS`): the training data (local files by name and
    SHA-256, so a moved file is the same data and an edited one is not; a data set by name, config and split), the
    reward functions by the names the run was given, and ``math_reward_mode`` and ``prompt_template`` when given.

    >>> inputs = training_inputs("dapo-math-17k", "default", "train", None, ["math_accuracy_reward"], "strict", "dapo")
    >>> inputs["training_data"], inputs["reward_funcs"], inputs["math_reward_mode"], inputs["prompt_template"]
    ('dapo-math-17k (config default, split train)', ['math_accuracy_reward'], 'strict', 'dapo')
    """
    files = list(data_files or ([dataset_name] if os.path.isfile(dataset_name) else []))
    if files:
        data = ", ".join(f"{os.path.basename(path)} (sha256 {_sha256(path)})" for path in files)
    else:
        data = f"{dataset_name} (config {dataset_config}, split {split})"
    inputs: dict[str, Any] = {"training_data": data, "reward_funcs": list(reward_funcs)}
    if math_reward_mode is not None:
        inputs["math_reward_mode"] = _plain(math_reward_mode)
    if prompt_template is not None:
        inputs["prompt_template"] = prompt_template
    return inputs


def run_options(args: Any, inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The compared options of ``args`` (a `GRPOConfig` / `OPEFOConfig`), JSON-ready, and ``inputs``, what the run
    trains on (:func:`training_inputs`) if known."""
    names = [n for group in REFUSED.values() for n in group] + list(TAKEN) + _method_options(args)
    options = {name: _plain(getattr(args, name)) for name in names if hasattr(args, name)}
    return {**options, **_plain(inputs or {})}


def save_run_options(checkpoint: str, args: Any, inputs: dict[str, Any] | None = None) -> None:
    write_json_atomically(os.path.join(checkpoint, RUN_OPTIONS_NAME), run_options(args, inputs))


def read_run_options(folder: str) -> dict[str, Any] | None:
    """The options recorded in ``folder`` (a checkpoint or a saved final model), or None if it holds none.

    Raises:
        ValueError: the file is there but is not a JSON mapping.
    """
    path = os.path.join(folder, RUN_OPTIONS_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            options = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as JSON ({err}); restore it from another copy of the run.") from err
    if not isinstance(options, dict):
        raise ValueError(f"{path} holds {type(options).__name__}, not the mapping of options a run writes.")
    return options


def compare_options(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(refused, taken)``: ``"name old -> new"`` of every option that differs, refused or taken on resume."""
    refused_names = {n for group in REFUSED.values() for n in group}
    refused: list[str] = []
    taken: list[str] = []
    for name, old in saved.items():
        if name not in current or current[name] == old:
            continue
        (refused if name in refused_names else taken).append(f"{name} {old} -> {current[name]}")
    return refused, taken


def check_resume_options(checkpoint: str, args: Any, inputs: dict[str, Any] | None = None) -> list[str]:
    """Refuse to resume ``checkpoint`` with options it would override or misread (:data:`REFUSED`), or with other
    ``inputs`` (:func:`training_inputs`) than it recorded, naming old and new values; return the lines saying what
    else changes, and that the inputs were not compared when the checkpoint records none (an earlier release). A
    checkpoint without ``opefo_run_options.json`` (of an earlier release) is compared through its
    ``training_args.bin``."""
    saved = read_run_options(checkpoint)
    if saved is None:
        saved = _options_of_training_args(checkpoint)
        if saved is None:
            return [
                f"Resuming {checkpoint}, which holds neither {RUN_OPTIONS_NAME} nor a readable training_args.bin: its "
                "options are not compared with this run's (a changed learning rate or batch shape is not refused)."
            ]
    refused, taken = compare_options(saved, run_options(args, inputs))
    if refused:
        reasons = [
            f"{', '.join(n for n in refused if n.split(' ', 1)[0] in names)}: {why}"
            for why, names in REFUSED.items()
            if any(n.split(" ", 1)[0] in names for n in refused)
        ]
        raise CheckpointError(
            f"Cannot resume {checkpoint} with other options than it was trained with: {'; '.join(reasons)}. Resume "
            "with the checkpoint's values, or start a new run from its weights (--model_name_or_path "
            f"{checkpoint}, without resume_from_checkpoint)."
        )
    lines = [f"Resuming {checkpoint} with {change} from step {_step(checkpoint)} on." for change in taken]
    unrecorded = [name for name in INPUTS if name in (inputs or {}) and name not in saved]
    if unrecorded:
        lines.append(
            f"Resuming {checkpoint}, which records no {', '.join(unrecorded)} (saved by an earlier version of "
            "opefo-trl): they are not compared with this run's."
        )
    return lines


def _options_of_training_args(checkpoint: str) -> dict[str, Any] | None:
    """The compared options (but ``world_size``, which reads the current process group) from the checkpoint's
    ``training_args.bin``, which every Trainer checkpoint holds (a checkpoint of a release that wrote no
    ``opefo_run_options.json``); None if it cannot be read."""
    import torch

    path = os.path.join(checkpoint, "training_args.bin")
    if not os.path.isfile(path):
        return None
    try:
        # A pickle of the run's TrainingArguments, written by transformers' Trainer into the user's own checkpoint.
        args = torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 - unpicklable (classes since renamed): nothing to compare
        return None
    names = [n for group in REFUSED.values() for n in group if n != "world_size"] + list(TAKEN)
    names += _method_options(args)
    return {name: _plain(getattr(args, name)) for name in names if name in getattr(args, "__dict__", {})}


def _step(checkpoint: str) -> str:
    return str(checkpoint_step(checkpoint))
