"""The names, errors and file helpers that the run folder, its checkpoints and its metrics files share."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from opefo_trl.data.model_files import safetensors_problem

#: The metrics files of `opefo-train` (`metrics_jsonl`): one for the main process, or one per process.
METRICS_FILE = "metrics.jsonl"
METRICS_FILE_PER_RANK = "metrics.rank{rank}.jsonl"
TRAINER_STATE_NAME = "trainer_state.json"
#: The token method's state in a checkpoint (`OPEFOTrainer`), e.g. PAR's coefficient.
METHOD_STATE_NAME = "opefo_method_state.json"
#: The options a checkpoint was trained with, compared on resume (``opefo_trl.runs.options``).
RUN_OPTIONS_NAME = "opefo_run_options.json"
#: Written last into a checkpoint, once every other file is on disk: ``{"step": N, "files": {path: size}}``.
CHECKPOINT_MARKER = "opefo_checkpoint_complete.json"
#: The top-level entries of an output_dir that runs of `opefo-train` wrote there: ``{"entries": [name, ...]}``.
MANIFEST_NAME = "opefo_run_manifest.json"
LOCK_NAME = ".opefo_run.lock"
#: Where an overwrite keeps the earlier run's entries until the new run has saved something.
SET_ASIDE_DIR = ".opefo_overwritten"
#: Where `opefo-train` saves the final model before moving its files into output_dir (named in the manifest first).
FINAL_MODEL_STAGING = ".opefo_final_model"
#: Written into the staging folder once ``save_model`` has returned on every process: the staged model is whole, and is
#: moved into place (never deleted) by whatever finds it there, the next run after a kill included. A staged model
#: without it is moved into place too when its files show it whole, else kept in ``UNFINISHED_FINAL_MODEL``.
FINAL_MODEL_SAVED = ".opefo_final_model_saved"
#: Where a staged final model that was not marked whole, and whose files do not show it whole (a kill inside
#: ``save_model``), is kept, never deleted, for the user to take or discard.
UNFINISHED_FINAL_MODEL = "final_model.unfinished"
#: What ``Trainer.save_model`` writes last (``transformers.trainer.TRAINING_ARGS_NAME``): a saved model holding it whole
#: was saved to the end.
TRAINING_ARGS_NAME = "training_args.bin"
CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
METRICS_RE = re.compile(r"^metrics(\.rank\d+)?\.jsonl$")
#: Weight files `Trainer.save_model` writes (full model, shards and their index, a PEFT adapter).
WEIGHTS_RE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
#: What `Trainer` writes with `torch.save` into a checkpoint (zip archives since torch 1.6).
TORCH_SAVE_RE = re.compile(r"\.(pt|pth|bin)$")
#: The files of an opefo-eval sample store (``opefo_trl.eval.store``); a folder holding one is the user's, not a run's.
SAMPLES_FILE = "samples.jsonl"
RUN_CONFIG_FILE = "run_config.json"
#: Free space under which a failed write is taken for a full disk (torch and safetensors raise errors of their own).
LOW_SPACE = 64 << 20


class RunFolderError(ValueError):
    """An output_dir that this run cannot use as asked (the message says why and what to do)."""


class CheckpointError(RunFolderError):
    """A checkpoint that cannot be resumed from: incomplete, damaged, or of another method (the message names the
    file and the previous whole checkpoint)."""


class RunFolderBusy(RunFolderError):
    """Another process holds the run folder's lock (the message names its pid and host)."""


class MetricsFileError(RunFolderError):
    """A metrics file with a corrupt line before its last (the message names the line)."""


class CheckpointSaveError(Exception):
    """Writing a checkpoint or the final model failed (a full disk, a read-only folder); nothing partial is left to be
    resumed from."""


def fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomically(path: str, text: str) -> None:
    """``text`` at ``path``, whole or not at all: a flushed temporary file moved over it. A failed write (a full
    disk) removes the temporary file and leaves ``path`` as it was."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(folder)


def write_json_atomically(path: str, content: Any, **dump_options: Any) -> None:
    """``content`` as JSON at ``path`` (``json.dumps(content, indent=1, **dump_options)``), whole or not at all, as
    :func:`write_text_atomically` writes it."""
    write_text_atomically(path, json.dumps(content, **{"indent": 1, **dump_options}))


def remove_entry(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def unwritable_reason(folder: str) -> str | None:
    """Why this process cannot create files in ``folder`` (which need not exist yet), or None if it can.

    Probed by creating a nameless temporary file in ``folder``, or in the closest folder above it that exists, and
    closing it at once: permission bits, a read-only mount and a file in the way all show, and nothing is left behind.

    >>> import tempfile
    >>> unwritable_reason(os.path.join(tempfile.mkdtemp(), "not", "yet")) is None
    True
    """
    probe = os.path.abspath(folder)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        return f"{err.strerror or err}: {probe}"
    return None


def read_json_lines(path: str, refuse: Callable[[int, str], Exception]) -> tuple[list[tuple[int, str, Any]], bool]:
    r"""``(line number, line, value)`` of every non-blank line of a JSON-lines file, and whether its last line was cut
    off (not valid JSON: what a kill during a write leaves) and dropped; a line before it that is not valid JSON raises
    ``refuse(number, line)``.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "log.jsonl")
    >>> _ = open(path, "w").write('{"step": 1}\n{"step": 2}\n{"st')
    >>> read_json_lines(path, lambda number, line: ValueError(number))
    ([(1, '{"step": 1}\n', {'step': 1}), (2, '{"step": 2}\n', {'step': 2})], True)
    """
    with open(path) as f:
        lines = f.readlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    rows: list[tuple[int, str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((number, line, json.loads(line)))
        except json.JSONDecodeError:
            if number == last:
                return rows, True
            raise refuse(number, line) from None
    return rows, False


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer step a checkpoint was saved at (its ``trainer_state.json``, read by transformers' own
    ``TrainerState.load_from_json``)."""
    from transformers import TrainerState

    return TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME)).global_step


def file_problem(path: str, saved_size: int | None = None) -> str | None:
    """Why a saved file (of a checkpoint, of a final model) cannot be loaded, read without loading any tensor; None if
    it looks whole. ``saved_size``: the size its save wrote, if known."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:  # unreadable (permissions, an I/O error): loading it would fail after the model loaded
        return f"cannot be read ({type(err).__name__}: {err.strerror or err})"
    size = os.path.getsize(path)
    known = name.endswith((".safetensors", ".json")) or TORCH_SAVE_RE.search(name)
    if known and size == 0 and saved_size != 0:
        return "is empty"
    if saved_size is not None and size != saved_size:
        if size < saved_size:
            return f"is cut short: it has {size} bytes where its save wrote {saved_size}"
        return f"has changed since it was saved: it has {size} bytes where its save wrote {saved_size}"
    if name.endswith(".safetensors"):
        return safetensors_problem(path)
    if name.endswith(".json"):
        try:
            with open(path) as f:
                content = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"is not valid JSON ({err})"
        if name == TRAINER_STATE_NAME:
            return _trainer_state_problem(path, content)
        if name == METHOD_STATE_NAME and not (isinstance(content, dict) and {"method", "state"} <= content.keys()):
            return "lacks the method or its state"
        return None
    if TORCH_SAVE_RE.search(name):
        try:
            with zipfile.ZipFile(path):  # reads the central directory at the end: gone when the file is cut short
                pass
        except zipfile.BadZipFile:
            return "is not a whole torch.save archive (cut short?)"
    return None


def _trainer_state_problem(path: str, content: Any) -> str | None:
    """Why transformers cannot resume from this ``trainer_state.json`` (read as a resume reads it, with
    ``TrainerState.load_from_json``), or None."""
    from transformers import TrainerState

    try:
        TrainerState.load_from_json(path)
    except TypeError as err:  # not a mapping, or a key this release's TrainerState does not take
        return f"cannot be read by transformers' TrainerState.load_from_json ({err})"
    if "global_step" not in content:  # TrainerState would take the step for 0, and train the run again from there
        return "has no global_step"
    return None
