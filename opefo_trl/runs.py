"""Run directories and checkpoints: what an earlier run left in an ``output_dir``, and whether a checkpoint is whole.

- :func:`run_files` lists what a training run leaves in its ``output_dir`` (``checkpoint-<step>`` folders, the
  metrics files, ``trainer_state.json``, saved weights); ``opefo-train`` refuses such a directory unless it resumes
  or is told to overwrite, and :func:`remove_run_files` is that overwrite. Other files (an ``opefo-eval`` folder
  inside the run, notes) are never listed nor removed.
- :func:`check_checkpoint` reads, without loading a tensor, every file ``Trainer`` will load from a checkpoint
  (safetensors headers and sizes, the zip directories of ``torch.save`` files, the JSON states) and names the first
  one that is missing, empty or cut short, with the previous checkpoint that is whole.

Example:
    >>> from opefo_trl.runs import run_files
    >>> run_files("runs/opefo-7b")  # doctest: +SKIP
    ['checkpoint-50', 'checkpoint-100', 'metrics.jsonl', 'model.safetensors']
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zipfile

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

#: The metrics files of `opefo-train` (`metrics_jsonl`): one for the main process, or one per process.
METRICS_FILE = "metrics.jsonl"
METRICS_FILE_PER_RANK = "metrics.rank{rank}.jsonl"
TRAINER_STATE_NAME = "trainer_state.json"
#: The token method's state in a checkpoint (`OPEFOTrainer`), e.g. PAR's coefficient.
METHOD_STATE_NAME = "opefo_method_state.json"
CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_METRICS_RE = re.compile(r"^metrics(\.rank\d+)?\.jsonl$")
#: Weight files `Trainer.save_model` writes (full model, shards and their index, a PEFT adapter).
_WEIGHTS_RE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
#: What `Trainer` writes with `torch.save` into a checkpoint (zip archives since torch 1.6).
_TORCH_SAVE_RE = re.compile(r"\.(pt|pth|bin)$")


class CheckpointError(ValueError):
    """A checkpoint file is missing, empty or cut short (the message names it and the previous whole checkpoint)."""


# ----------------------------------------------------------------------------------------------------------------------
# Output directories
# ----------------------------------------------------------------------------------------------------------------------


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-<step>`` folder of ``output_dir``, by step."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def run_files(output_dir: str) -> list[str]:
    """Names of what a training run left in ``output_dir``: checkpoints (by step), metrics, state, saved weights."""
    if not os.path.isdir(output_dir):
        return []
    names = [os.path.basename(path) for _, path in checkpoints(output_dir)]
    for name in sorted(os.listdir(output_dir)):
        if os.path.isfile(os.path.join(output_dir, name)) and (
            _METRICS_RE.match(name) or _WEIGHTS_RE.match(name) or name == TRAINER_STATE_NAME
        ):
            names.append(name)
    return names


def remove_run_files(output_dir: str) -> list[str]:
    """Delete what :func:`run_files` lists (and nothing else); returns the names removed."""
    names = run_files(output_dir)
    for name in names:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return names


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------------


def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file cannot be read whole (header, or data shorter than the header says); None if fine."""
    size = os.path.getsize(path)
    if size < 8:
        return f"is cut short: it has {size} bytes, less than a safetensors header"
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        if 8 + header_size > size:
            return f"is cut short: its header announces {header_size} bytes but the file has {size}"
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "has a safetensors header that is not valid JSON"
    if not isinstance(header, dict):
        return "has a safetensors header that is not a JSON mapping"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    expected = 8 + header_size + max(ends, default=0)
    if size < expected:
        return f"is cut short: it has {size} bytes where its header needs {expected}"
    return None


def _file_problem(path: str, method_state_name: str) -> str | None:
    """Why a checkpoint file cannot be loaded, read without loading any tensor; None if it looks whole."""
    name = os.path.basename(path)
    known = name.endswith((".safetensors", ".json")) or _TORCH_SAVE_RE.search(name)
    if known and os.path.getsize(path) == 0:
        return "is empty"
    if name.endswith(".safetensors"):
        return _safetensors_problem(path)
    if name.endswith(".json"):
        try:
            with open(path) as f:
                content = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"is not valid JSON ({err})"
        if name == TRAINER_STATE_NAME and not (isinstance(content, dict) and "global_step" in content):
            return "has no global_step"
        if name == method_state_name and not (isinstance(content, dict) and {"method", "state"} <= content.keys()):
            return "lacks the method or its state"
        return None
    if _TORCH_SAVE_RE.search(name):
        try:
            with zipfile.ZipFile(path):  # reads the central directory at the end: gone when the file is cut short
                pass
        except zipfile.BadZipFile:
            return "is not a whole torch.save archive (cut short?)"
    return None


def _first_problem(checkpoint: str) -> tuple[str, str] | None:
    """``(file, reason)`` of the first file of ``checkpoint`` that cannot be loaded, else None."""
    names = os.listdir(checkpoint)
    if TRAINER_STATE_NAME not in names:
        return os.path.join(checkpoint, TRAINER_STATE_NAME), "is missing (without it training would restart at step 0)"
    if not any(_WEIGHTS_RE.match(n) for n in names) and not any(
        os.path.isdir(os.path.join(checkpoint, n)) for n in names
    ):  # a sub-folder: DeepSpeed's global_step<N> or an FSDP shard folder
        return checkpoint, "holds no model weights (model.safetensors, adapter_model.safetensors, ...)"
    for root, _, files in sorted(os.walk(checkpoint)):
        for name in sorted(files):
            path = os.path.join(root, name)
            reason = _file_problem(path, METHOD_STATE_NAME)
            if reason is not None:
                return path, reason
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


def check_checkpoint(checkpoint: str, method: str | None = None) -> None:
    """Refuse a checkpoint that ``Trainer`` could not resume from, before any weights load.

    Every file is read as far as needed to know it is whole (safetensors headers against the file size, the central
    directory of ``torch.save`` zips, the JSON states), never loaded. With ``method``, a checkpoint saved by another
    token method (``opefo_method_state.json``) is refused too.

    Raises:
        CheckpointError: naming the file, what is wrong with it, and the previous checkpoint that is whole.
    """
    problem = _first_problem(checkpoint)
    if problem is not None:
        path, reason = problem
        previous = previous_whole_checkpoint(checkpoint)
        fix = (
            f"Resume from the previous checkpoint with --resume_from_checkpoint {previous}"
            if previous
            else "No earlier whole checkpoint is left next to it: start afresh without resume_from_checkpoint"
        )
        raise CheckpointError(f"Cannot resume from {checkpoint}: {path} {reason}. {fix}.")
    state_path = os.path.join(checkpoint, METHOD_STATE_NAME)
    if method is not None and os.path.isfile(state_path):
        with open(state_path) as f:
            saved = json.load(f)["method"]
        if saved != method:
            raise CheckpointError(
                f"Checkpoint {checkpoint} was trained with method={saved!r}, but this run uses method={method!r}. "
                f"Resume with --method {saved}, or start from its weights without resume_from_checkpoint "
                f"(--model_name_or_path {checkpoint})."
            )


# ----------------------------------------------------------------------------------------------------------------------
# The token method's state in a checkpoint
# ----------------------------------------------------------------------------------------------------------------------


def save_method_state(checkpoint: str, method: str, state: dict) -> None:
    """Write the token method's name and state (``TokenMethod.state_dict()``) into a checkpoint folder."""
    with open(os.path.join(checkpoint, METHOD_STATE_NAME), "w") as f:
        json.dump({"method": method, "state": state}, f)


def load_method_state(checkpoint: str, method: str) -> dict | None:
    """The state a checkpoint holds for ``method`` (None when it holds none); a checkpoint of another method is
    refused, naming both."""
    path = os.path.join(checkpoint, METHOD_STATE_NAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    if saved["method"] != method:
        raise ValueError(
            f"Checkpoint {checkpoint} was trained with method={saved['method']!r}, but this run uses "
            f"method={method!r}. Resume with the same method, or start from the weights without "
            "resume_from_checkpoint."
        )
    return saved["state"]
