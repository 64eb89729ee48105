"""Checkpoints that are whole or not checkpoints at all.

:func:`saving_checkpoint` (around ``Trainer._save_checkpoint``) writes the Trainer's files, then the token method's
state (``opefo_method_state.json``), then a completion marker (``opefo_checkpoint_complete.json``, the size of every
file), last and atomically; a save that fails removes the folder. :func:`check_checkpoint` reads, without loading a
tensor, every file ``Trainer`` will load (safetensors headers through ``safetensors.safe_open``, the zip directories
of ``torch.save`` files, the JSON states, the sizes the marker recorded) and names the first problem (a missing marker:
the save did not finish) with the previous whole checkpoint; :func:`resume_checkpoint` is what
``resume_from_checkpoint`` resumes from (``True``: the last *whole* checkpoint).

Example:
    >>> from opefo_trl.runs import resume_checkpoint
    >>> resume_checkpoint(True, "runs/opefo-7b", method="opefo")  # doctest: +SKIP
    'runs/opefo-7b/checkpoint-100'
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, sort_checkpoints

from opefo_trl.runs.files import (
    CHECKPOINT_MARKER,
    CHECKPOINT_RE,
    LOW_SPACE,
    METHOD_STATE_NAME,
    SET_ASIDE_DIR,
    TRAINER_STATE_NAME,
    WEIGHTS_RE,
    CheckpointError,
    CheckpointSaveError,
    RunFolderError,
    checkpoint_step,
    file_problem,
    free_bytes,
    remove_entry,
    write_json_atomically,
)
from opefo_trl.runs.folder import run_files
from opefo_trl.runs.options import save_run_options

logger = logging.getLogger(__name__)


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-<step>`` folder of ``output_dir``, by step, whole or not (transformers'
    ``get_last_checkpoint`` gives the last one only; the previous whole one is looked for among these)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def _saved_sizes(checkpoint: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(checkpoint):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, checkpoint)] = os.path.getsize(path)
    sizes.pop(CHECKPOINT_MARKER, None)
    return dict(sorted(sizes.items()))


def mark_checkpoint_complete(checkpoint: str) -> None:
    """Write the completion marker of ``checkpoint``, last: every file flushed to disk, then the marker (with each
    file's size) moved into place whole."""
    sizes = _saved_sizes(checkpoint)
    for name in sizes:
        with open(os.path.join(checkpoint, name), "rb") as f:
            os.fsync(f.fileno())
    match = CHECKPOINT_RE.match(os.path.basename(os.path.normpath(checkpoint)))
    write_json_atomically(
        os.path.join(checkpoint, CHECKPOINT_MARKER),
        {"step": int(match.group(1)) if match else None, "files": sizes},
    )


def _marker(checkpoint: str) -> tuple[dict[str, int], str | None]:
    """The file sizes the marker recorded, and why the marker does not make the checkpoint whole (None: it does)."""
    path = os.path.join(checkpoint, CHECKPOINT_MARKER)
    if not os.path.isfile(path):
        return {}, (
            "is missing: the save of this checkpoint did not finish (opefo-train writes it last, once every other "
            "file is saved)"
        )
    try:
        with open(path) as f:
            content = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return {}, f"is not valid JSON ({err})"
    files = content.get("files") if isinstance(content, dict) else None
    if not isinstance(files, dict):
        return {}, "does not list the checkpoint's files"
    return files, None


def foreign_checkpoint_files(checkpoint: str) -> list[str]:
    """The files inside ``checkpoint`` (paths relative to it) that its save did not write: those its completion marker
    does not list, e.g. an ``opefo-eval -o checkpoint-2/eval`` store or a note. A checkpoint without a readable marker
    (a save that did not finish) has none: every file in it is its save's.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> _ = open(os.path.join(folder, "model.safetensors"), "w").write("w")
    >>> mark_checkpoint_complete(folder)
    >>> _ = open(os.path.join(folder, "notes.txt"), "w").write("mine")
    >>> foreign_checkpoint_files(folder)
    ['notes.txt']
    """
    saved, problem = _marker(checkpoint)
    if problem is not None:
        return []
    return [name for name in _saved_sizes(checkpoint) if name not in saved]


def shown_files(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _first_problem(checkpoint: str) -> tuple[str, str] | None:
    """``(file, reason)`` of the first reason ``checkpoint`` cannot be resumed from, else None: a damaged file, then
    a missing completion marker, then a file the marker lists that is gone, the trainer state, the weights."""
    sizes, marker_problem = _marker(checkpoint)
    for root, _, files in sorted(os.walk(checkpoint)):
        for name in sorted(files):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, checkpoint)
            if relative == CHECKPOINT_MARKER or name.startswith("."):
                continue
            reason = file_problem(path, sizes.get(relative))
            if reason is not None:
                return path, reason
    if marker_problem is not None:
        return os.path.join(checkpoint, CHECKPOINT_MARKER), marker_problem
    for relative in sizes:
        if not os.path.isfile(os.path.join(checkpoint, relative)):
            return os.path.join(checkpoint, relative), "is missing (the checkpoint was saved with it)"
    names = os.listdir(checkpoint)
    if TRAINER_STATE_NAME not in names:
        return os.path.join(checkpoint, TRAINER_STATE_NAME), "is missing (without it training would restart at step 0)"
    if not any(WEIGHTS_RE.match(n) for n in names) and not any(
        os.path.isdir(os.path.join(checkpoint, n)) for n in names
    ):  # a sub-folder: DeepSpeed's global_step<N> or an FSDP shard folder
        return checkpoint, "holds no model weights (model.safetensors, adapter_model.safetensors, ...)"
    return None


def previous_whole_checkpoint(checkpoint: str) -> str | None:
    """The latest checkpoint before ``checkpoint`` in the same folder that :func:`check_checkpoint` accepts."""
    match = CHECKPOINT_RE.match(os.path.basename(os.path.normpath(checkpoint)))
    if match is None:
        return None
    step = int(match.group(1))
    for earlier_step, path in reversed(checkpoints(os.path.dirname(os.path.normpath(checkpoint)))):
        if earlier_step < step and _first_problem(path) is None:
            return path
    return None


def _fix(checkpoint: str) -> str:
    previous = previous_whole_checkpoint(checkpoint)
    if previous:
        return f"Resume from the previous checkpoint with --resume_from_checkpoint {previous}"
    return "No earlier whole checkpoint is left next to it: start afresh without resume_from_checkpoint"


def method_is_stateful(method: str) -> bool:
    """Whether the token method ``method`` has state that a checkpoint must hold (it overrides ``state_dict``)."""
    from opefo_trl.methods import TokenMethod, get_token_method_class

    try:
        cls = get_token_method_class(method)
    except ValueError:  # an unregistered method: the config refuses it
        return False
    return cls.state_dict is not TokenMethod.state_dict


def _refuse_non_checkpoint(folder: str) -> None:
    """A folder that is not a ``checkpoint-<step>`` folder and has no trainer state: a run folder, a model."""
    if CHECKPOINT_RE.match(os.path.basename(os.path.normpath(folder))) or os.path.exists(
        os.path.join(folder, TRAINER_STATE_NAME)
    ):
        return
    inside = checkpoints(folder)
    if inside:
        hint = f"it holds checkpoints: give one, e.g. {inside[-1][1]}, or `true` with --output_dir {folder}"
    elif os.path.isfile(os.path.join(folder, "config.json")):
        hint = "it is a model: start from its weights with --model_name_or_path, without resume_from_checkpoint"
    else:
        hint = "give a checkpoint-<step> folder of a run"
    raise CheckpointError(
        f"resume_from_checkpoint {folder} is not a checkpoint (no checkpoint-<step> name, no {TRAINER_STATE_NAME}); "
        f"{hint}."
    )


def check_checkpoint(checkpoint: str, method: str | None = None) -> None:
    """Refuse a checkpoint that ``Trainer`` could not resume from, before any weights load.

    A checkpoint without its completion marker is incomplete (its save did not finish). Every file is read as far
    as needed to know it is whole (its size against the marker's, safetensors headers, the central directory of
    ``torch.save`` zips, the JSON states), never loaded. With ``method``, a checkpoint saved by another token method
    (``opefo_method_state.json``), or without the state of a method that has one (PAR's coefficient), is refused too.

    Raises:
        CheckpointError: naming the file, what is wrong with it, and the previous checkpoint that is whole.
    """
    _refuse_non_checkpoint(checkpoint)
    problem = _first_problem(checkpoint)
    if problem is not None:
        path, reason = problem
        raise CheckpointError(f"Cannot resume from {checkpoint}: {path} {reason}. {_fix(checkpoint)}.")
    state_path = os.path.join(checkpoint, METHOD_STATE_NAME)
    if method is None:
        return
    if not os.path.isfile(state_path):
        if method_is_stateful(method):
            raise CheckpointError(
                f"Cannot resume from {checkpoint}: it has no {METHOD_STATE_NAME}, which holds the state of "
                f"method={method!r}; resuming would restart that state from its initial value. {_fix(checkpoint)}, or "
                f"start from its weights without resume_from_checkpoint (--model_name_or_path {checkpoint})."
            )
        return
    with open(state_path) as f:
        saved = json.load(f)["method"]
    if saved != method:
        raise CheckpointError(
            f"Checkpoint {checkpoint} was trained with method={saved!r}, but this run uses method={method!r}. "
            f"Resume with --method {saved}, or start from its weights without resume_from_checkpoint "
            f"(--model_name_or_path {checkpoint})."
        )


def resume_checkpoint(
    resume: str | bool | None, output_dir: str, method: str | None = None, warn: bool = True
) -> str | None:
    """The checkpoint that ``resume_from_checkpoint=resume`` resumes from, checked (:func:`check_checkpoint`).

    ``True`` is the last *whole* checkpoint of ``output_dir`` (``transformers``' ``get_last_checkpoint`` when it is
    whole, else the one before it that is; ``warn`` logs why the later ones are skipped); None / False: none.

    Raises:
        CheckpointError: no checkpoint, none whole, or the one named cannot be resumed from.
    """
    if resume is None or resume is False:
        return None
    if resume is True:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            earlier = run_files(output_dir)
            if earlier:
                raise CheckpointError(
                    f"resume_from_checkpoint=true but output_dir {output_dir!r} has no checkpoint-<step> folder: its "
                    f"earlier run ({shown_files(earlier)}) saved none. {_start_afresh(output_dir, earlier, True)}"
                )
            raise CheckpointError(
                f"resume_from_checkpoint=true but output_dir {output_dir!r} has no checkpoint-<step> folder. Give the "
                "checkpoint's path, or drop resume_from_checkpoint to start afresh."
            )
        problem = _first_problem(last)
        if problem is not None:
            chosen = previous_whole_checkpoint(last)
            if chosen is None:
                raise CheckpointError(
                    f"resume_from_checkpoint=true but no checkpoint of {output_dir!r} is whole: the last, {last}, "
                    f"cannot be resumed from ({problem[0]} {problem[1]}), and none before it can. Start afresh "
                    "without resume_from_checkpoint."
                )
            if warn:
                chosen_step = int(CHECKPOINT_RE.match(os.path.basename(chosen)).group(1))  # type: ignore[union-attr]
                for step, path in checkpoints(output_dir):
                    skipped = _first_problem(path) if step > chosen_step else None
                    if skipped is not None:
                        logger.warning("Skipping %s: %s %s. Resuming from %s.", path, *skipped, chosen)
            last = chosen
        resume = last
    elif not os.path.isdir(resume):
        raise CheckpointError(
            f"resume_from_checkpoint {resume!r} is not a directory. Give a checkpoint-<step> folder, or `true` for "
            f"the last whole checkpoint in output_dir ({output_dir!r})."
        )
    check_checkpoint(resume, method)
    return resume


def _start_afresh(output_dir: str, earlier: list[str], resuming: bool) -> str:
    """The one command that trains in a folder holding an earlier run's files (``earlier``) and no whole
    checkpoint."""
    final_model = any(WEIGHTS_RE.match(n) for n in earlier)
    further = (
        f"; to train its final model further, start from it in another folder (--model_name_or_path {output_dir} "
        "--output_dir <another folder>)"
        if final_model
        else ""
    )
    without_resume = " and without --resume_from_checkpoint" if resuming else ""
    included = ", its final model included," if final_model else ""
    return (
        f"Start afresh in it with --overwrite_output_dir true{without_resume} (the overwrite deletes those files"
        f"{included} once the new run has saved something), or give another --output_dir{further}."
    )


def earlier_run_message(output_dir: str, earlier: list[str]) -> str:
    """Why a fresh run is refused a folder holding the ``earlier`` run's files, and the commands that work."""
    try:
        resumable = resume_checkpoint(True, output_dir, warn=False) is not None
    except CheckpointError:
        resumable = False
    if not resumable:
        return (
            f"output_dir {output_dir!r} holds an earlier run ({shown_files(earlier)}) that saved no whole checkpoint "
            f"to resume; training into it would mix the two runs. {_start_afresh(output_dir, earlier, False)}"
        )
    return (
        f"output_dir {output_dir!r} holds an earlier run ({shown_files(earlier)}); training into it would mix the two "
        "runs. Resume it with --resume_from_checkpoint true, start afresh in it with --overwrite_output_dir true "
        "(deletes those files once the new run has saved its first checkpoint), or give another --output_dir."
    )


def check_steps_left(checkpoint: str, planned_steps: int) -> None:
    """Refuse to resume ``checkpoint`` when it is already at or past the ``planned_steps`` of this run: transformers'
    Trainer would train one more step and save its model over the finished run's final model."""
    step = checkpoint_step(checkpoint)
    if step >= planned_steps:
        run = os.path.dirname(os.path.normpath(checkpoint))
        if any(WEIGHTS_RE.match(n) for n in os.listdir(run)):
            final_model = f"its final model in {run} is left as it is"
        else:  # stopped before its final model was saved: the checkpoint of the last step holds the same weights
            final_model = f"{run} holds no final model, and {checkpoint} holds the weights of its step {step}"
        raise CheckpointError(
            f"Nothing to resume: {checkpoint} is at step {step}, and this run trains {planned_steps} step(s) "
            f"(max_steps, or num_train_epochs over the data), so it has finished; {final_model}. To train further, "
            "raise max_steps or num_train_epochs."
        )


def rollout_boundary_period(args: Any) -> int:
    """Every how many optimizer steps of an epoch a rollout ends where a step ends, as TRL 1.16 schedules them
    (``args``: a `GRPOConfig`). TRL samples a rollout every G = ``steps_per_generation * num_iterations``
    micro-batches, counted over the whole run (``GRPOTrainer._prepare_inputs``); an optimizer step takes A =
    ``gradient_accumulation_steps`` of them, the last of an epoch fewer, and an epoch's micro-batches are a multiple of
    G. So within an epoch the steps that end on a rollout boundary are the multiples of G / gcd(G, A), and every
    epoch ends on one. 1: every step does.

    >>> from types import SimpleNamespace
    >>> period = lambda spg, iterations, accum: rollout_boundary_period(
    ...     SimpleNamespace(steps_per_generation=spg, num_iterations=iterations, gradient_accumulation_steps=accum)
    ... )
    >>> period(16, 1, 2), period(4, 2, 3), period(2, 1, 4)
    (8, 8, 1)
    """
    micro_batches = args.steps_per_generation * args.num_iterations
    return micro_batches // math.gcd(micro_batches, args.gradient_accumulation_steps)


def at_rollout_boundary(step: int, args: Any, steps_per_epoch: int | None = None) -> bool:
    """Whether optimizer step ``step`` ends on a rollout boundary (:func:`rollout_boundary_period`); without
    ``steps_per_epoch`` (the optimizer steps of an epoch, as transformers' Trainer counts them), as in the first
    epoch."""
    within = step % steps_per_epoch if steps_per_epoch else step
    return within % rollout_boundary_period(args) == 0


def rollout_schedule(args: Any) -> str:
    """How TRL's rollouts and the optimizer steps of a run (its `GRPOConfig`) line up, in words.

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(steps_per_generation=4, num_iterations=2, gradient_accumulation_steps=3)
    >>> print(rollout_schedule(args))  # doctest: +NORMALIZE_WHITESPACE
    TRL samples a rollout every 8 micro-batches (steps_per_generation 4 x num_iterations 2) and an optimizer step
    takes 3 (gradient_accumulation_steps), so a rollout spans 8/3 optimizer steps and ends where a step ends only
    every 8 steps (3 rollouts)
    """
    micro_batches, accumulation = args.steps_per_generation * args.num_iterations, args.gradient_accumulation_steps
    spans = Fraction(micro_batches, accumulation)
    text = (
        f"TRL samples a rollout every {micro_batches} micro-batches (steps_per_generation {args.steps_per_generation} "
        f"x num_iterations {args.num_iterations}) and an optimizer step takes {accumulation} "
        f"(gradient_accumulation_steps), so a rollout spans {spans} optimizer step{'s' if spans != 1 else ''}"
    )
    if spans.denominator == 1:
        return text
    period = rollout_boundary_period(args)
    rollouts = period * accumulation // micro_batches
    return f"{text} and ends where a step ends only every {period} steps ({rollouts} rollouts)"


def check_rollout_boundary(checkpoint: str, args: Any, steps_per_epoch: int | None = None, refuse: bool = True) -> None:
    """Refuse (``refuse``), or else warn about, a resume from a checkpoint saved between the updates of one rollout
    (:func:`at_rollout_boundary`): TRL keeps the rollout it trains on in memory (``_buffered_inputs``), not in the
    checkpoint, so the resumed run samples a new rollout and trains the rollout's remaining updates on other
    completions. GRPOTrainer resumes so; a method whose token weights come from the rollout refuses it. The refusal
    names the latest whole checkpoint before it that is at a rollout boundary."""
    step = checkpoint_step(checkpoint)
    if at_rollout_boundary(step, args, steps_per_epoch):
        return
    period = rollout_boundary_period(args)
    within = step % steps_per_epoch if steps_per_epoch else step
    end = step - within % period + period
    if steps_per_epoch:
        end = min(end, step - within + steps_per_epoch)
    left = f"step {end}" if end == step + 1 else f"steps {step + 1}-{end}"
    saved = (
        f"it was saved at step {step}, between the updates of one rollout. {rollout_schedule(args)}. TRL keeps the "
        f"rollout in memory, not in the checkpoint"
    )
    if not refuse:
        logger.warning(
            f"Resuming {checkpoint}: {saved}, so, as GRPOTrainer does, the resume samples a new rollout and trains "
            f"{left} on other completions than the uninterrupted run would."
        )
        return
    run = os.path.dirname(os.path.normpath(checkpoint))
    earlier = [
        path
        for s, path in checkpoints(run)
        if s < step and at_rollout_boundary(s, args, steps_per_epoch) and _first_problem(path) is None
    ]
    if earlier:
        fix = f"Resume from {earlier[-1]}, the latest checkpoint at a rollout boundary, with --resume_from_checkpoint"
        fix += f" {earlier[-1]}"
    else:
        fix = (
            f"No checkpoint before it is at a rollout boundary: start afresh without resume_from_checkpoint, or a new "
            f"run from its weights (--model_name_or_path {checkpoint})"
        )
    raise CheckpointError(
        f"Cannot resume {checkpoint}: {saved}: the resume would sample a new rollout and train {left} on other "
        f"completions, with other token weights, than the run's. {fix}. To keep every checkpoint resumable, make "
        f"save_steps (and max_steps) a multiple of {period}."
    )


@contextmanager
def reported_write_errors(folder: str, what: str, writer: bool = True) -> Iterator[None]:
    """Around writing ``folder`` (a checkpoint, the final model): if it fails, the folder is removed (``writer``:
    the process that writes it), and a failed write (any ``OSError``, or another error while the disk is full, as
    torch and safetensors report it) is raised as one-line :class:`CheckpointSaveError` naming the folder."""
    try:
        yield
    except Exception as err:
        free = free_bytes(folder)
        if writer:
            shutil.rmtree(folder, ignore_errors=True)  # if even that fails, the folder has no marker: never resumed
        disk_full = (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            free is not None and free < LOW_SPACE
        )
        if not (isinstance(err, OSError) or disk_full):
            raise
        lines = str(err).strip().splitlines()
        cause = f"{type(err).__name__}: {lines[0] if lines else ''}"
        if disk_full and not isinstance(err, OSError):
            cause = f"the disk is full ({free} bytes free; {cause})"
        gone = "was removed" if not os.path.exists(folder) else "has no completion marker, so it is never resumed"
        run_dir = os.path.dirname(os.path.normpath(folder))
        whole = [path for _, path in checkpoints(run_dir) if path != folder]
        # What a fresh run wrote besides the failed folder (its metrics), for which opefo-train refuses a plain rerun;
        # an overwrite's own command already overwrites (and its run's files go when the earlier run is moved back).
        try:
            logged = [name for name in run_files(run_dir) if name != os.path.basename(os.path.normpath(folder))]
        except RunFolderError:  # a damaged manifest: the next command names it
            logged = []
        if os.path.isdir(os.path.join(run_dir, SET_ASIDE_DIR)):
            logged = []
        if any(_first_problem(path) is None for path in whole):
            then = "resume from the last whole checkpoint with --resume_from_checkpoint true"
        elif logged:
            then = (
                "run the command again with --overwrite_output_dir true (no whole checkpoint of this run is left to "
                f"resume from; the overwrite replaces the {shown_files(logged)} it left in {run_dir})"
            )
        else:
            then = "run the command again (no whole checkpoint of this run is left to resume from)"
        raise CheckpointSaveError(
            f"Cannot save the {what} {folder}: {cause}. The unfinished {what} {gone}. Free space on that disk (or make "
            f"the folder writable), then {then}."
        ) from err


@contextmanager
def _transformers_rotation_held_back(run_dir: str) -> Iterator[None]:
    """Skip the rotation ``Trainer._save_checkpoint`` ends with (``transformers.trainer.rotate_checkpoints``, which
    deletes checkpoints beyond ``save_total_limit``) for ``run_dir`` while this block runs: at that point the new
    checkpoint has no method state and no marker yet, so a whole checkpoint could be deleted for one that is not.
    Rotations of other folders go through. The `TrainingArguments` are left as they are (their ``save_total_limit``
    is also what the checkpoint's ``training_args.bin`` records)."""
    import transformers.trainer as trainer_module

    rotate = getattr(trainer_module, "rotate_checkpoints", None)
    if rotate is None:  # checked before the save writes anything
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} has no transformers.trainer.rotate_checkpoints, the call with "
            "which Trainer._save_checkpoint deletes old checkpoints; opefo_trl holds it back until a new checkpoint "
            "is whole, and cannot save a checkpoint safely without it. Install the transformers release that TRL's "
            "tested range (opefo_trl._compat.TRL_TESTED) asks for."
        )

    def rotate_other_folders(output_dir: str, *args: Any, **kwargs: Any) -> None:
        if os.path.realpath(output_dir) != os.path.realpath(run_dir):
            rotate(output_dir, *args, **kwargs)

    trainer_module.rotate_checkpoints = rotate_other_folders
    try:
        yield
    finally:
        trainer_module.rotate_checkpoints = rotate


@contextmanager
def saving_checkpoint(
    run_dir: str,
    args: Any,
    state: Any,
    method_state: Callable[[], tuple[str, dict]],
    wait_for_everyone: Callable[[], None],
    inputs: dict[str, Any] | None = None,
) -> Iterator[None]:
    """Around ``Trainer._save_checkpoint`` (its `TrainingArguments` and `TrainerState`): the checkpoint
    ``<run_dir>/checkpoint-<global_step>`` ends up whole, or removed.

    Before the Trainer's files: a folder of the same step (a save that did not finish, or a step replayed after an
    earlier resume) is removed, and the Trainer's rotation of old checkpoints (``save_total_limit``) is held back
    (:func:`_transformers_rotation_held_back`), so that no whole checkpoint is deleted before the new one is. After
    them (every process done): the token method's state (``method_state()``: its name and ``state_dict()``), the run's
    options with what it trains on (``inputs``, :func:`~opefo_trl.runs.training_inputs`), the completion marker, then
    the rotation, with ``args.save_total_limit``. ``args`` is only read. A failed save is
    handled by :func:`reported_write_errors`.
    """
    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    writer = args.should_save
    foreign = foreign_checkpoint_files(folder) if writer and os.path.isdir(folder) else []
    if foreign:  # files put there since the resume was checked: kept, in the folder moved out of the way
        kept = _free_name(run_dir, f"replaced-{os.path.basename(folder)}")
        os.replace(folder, kept)
        logger.warning(
            "%s held files that no run of opefo-train wrote (%s): the checkpoint this run saves at step %d takes its "
            "place, and the earlier folder, with those files, is kept as %s.",
            folder,
            shown_files(foreign),
            state.global_step,
            kept,
        )
    if writer and os.path.lexists(folder):
        try:
            remove_entry(folder)
        except OSError as err:
            raise CheckpointSaveError(
                f"Cannot save the checkpoint {folder}: a folder of that step is there (an unfinished save, or a step "
                f"replayed after a resume) and cannot be removed ({type(err).__name__}: {err}). Make it removable, or "
                "remove it, then run the command again."
            ) from err
    wait_for_everyone()  # removed before any process writes into it
    with _transformers_rotation_held_back(run_dir), reported_write_errors(folder, "checkpoint", writer):
        yield
        wait_for_everyone()
        if writer:
            save_method_state(folder, *method_state())
            save_run_options(folder, args, inputs)
            mark_checkpoint_complete(folder)
    if writer:
        rotate_run_checkpoints(run_dir, args.save_total_limit, best_model_checkpoint=state.best_model_checkpoint)


def _free_name(folder: str, name: str) -> str:
    path, number = os.path.join(folder, name), 1
    while os.path.lexists(path):
        number += 1
        path = os.path.join(folder, f"{name}-{number}")
    return path


#: Checkpoints the rotation kept for the files a user put in them, each said once per process.
_KEPT_FROM_ROTATION: set[str] = set()


def rotate_run_checkpoints(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """``Trainer``'s rotation (``save_total_limit``: delete the oldest checkpoints, never the newest or the best one),
    except that a checkpoint holding files its save did not write (:func:`foreign_checkpoint_files`, e.g. an
    opefo-eval store a user put in it) is kept, said once, and does not count towards the limit."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    ordered = sort_checkpoints(run_dir, use_mtime=True)
    own = []
    for path in ordered:
        foreign = foreign_checkpoint_files(path)
        if not foreign:
            own.append(path)
        elif path != ordered[-1] and os.path.realpath(path) not in _KEPT_FROM_ROTATION:
            _KEPT_FROM_ROTATION.add(os.path.realpath(path))
            logger.warning(
                "save_total_limit: %s is kept, not rotated out, and not counted in the limit: it holds files that "
                "no run of opefo-train wrote (%s). Delete it yourself once you no longer need them.",
                path,
                shown_files(foreign),
            )
    protected = {own[-1]} if own else set()
    if best_model_checkpoint is not None:
        protected.add(str(Path(best_model_checkpoint)))
    remaining = len(own)
    for path in own:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if path not in protected:
            shutil.rmtree(path, ignore_errors=True)
            remaining -= 1


def save_method_state(checkpoint: str, method: str, state: dict) -> None:
    """Write the token method's name and state (``TokenMethod.state_dict()``) into a checkpoint folder."""
    write_json_atomically(os.path.join(checkpoint, METHOD_STATE_NAME), {"method": method, "state": state})


def load_method_state(checkpoint: str, method: str) -> dict | None:
    """The state a checkpoint holds for ``method`` (None when it holds none); a checkpoint of another method, or one
    without the state of a method that has one, is refused."""
    path = os.path.join(checkpoint, METHOD_STATE_NAME)
    if not os.path.exists(path):
        if method_is_stateful(method):
            check_checkpoint(checkpoint, method)  # raises, naming what is missing and the fix
        return None
    with open(path) as f:
        saved = json.load(f)
    if saved["method"] != method:
        raise CheckpointError(
            f"Checkpoint {checkpoint} was trained with method={saved['method']!r}, but this run uses "
            f"method={method!r}. Resume with the same method, or start from the weights without "
            "resume_from_checkpoint."
        )
    return saved["state"]
