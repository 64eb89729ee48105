"""`TrainerCallback`s of the library, for `OPEFOTrainer` as for any `transformers.Trainer`.

- :class:`MetricsJsonlCallback`: every logged metrics dict, with its step, as a JSON line in the run's
  ``metrics.jsonl`` (``opefo-train``'s ``metrics_jsonl``), read back by ``opefo-plot`` (``opefo_trl.plotting``).
- :class:`RunFolderCallback`: keeps the manifest of an ``opefo-train`` run folder (``opefo_trl.runs.RunFolder``)
  ahead of each checkpoint, and tells it when one is saved.

Example:
    >>> from opefo_trl.trainer.callbacks import MetricsJsonlCallback
    >>> callback = MetricsJsonlCallback("runs/opefo", mode="every_process")
    >>> trainer = OPEFOTrainer(..., callbacks=[callback])  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from opefo_trl.runs import METRICS_FILE, METRICS_FILE_PER_RANK, RunFolder, read_metrics_lines

logger = logging.getLogger(__name__)

METRICS_JSONL_MODES = ("main_process", "every_process")


class MetricsJsonlCallback(TrainerCallback):
    """Appends each logged metrics dict (with its step) as a JSON line to ``<output_dir>/metrics.jsonl``
    (``mode="main_process"``: the main process only) or ``<output_dir>/metrics.rank<N>.jsonl`` on every process
    (``mode="every_process"``: shows that distributed statistics agree across ranks), whatever ``report_to`` says.

    A run resumed from a checkpoint older than the file's last line replays the steps after it: their earlier lines
    are dropped once, at the first step, so the file keeps every step once. So is a cut-off last line (a run killed
    while writing it), with a warning; a corrupt line before it is refused (`opefo_trl.runs.read_metrics_lines`).
    """

    def __init__(self, output_dir: str, mode: str = "main_process") -> None:
        if mode not in METRICS_JSONL_MODES:
            raise ValueError(f"mode must be one of {METRICS_JSONL_MODES}, got {mode!r}.")
        self.output_dir = output_dir
        self.mode = mode
        self.trimmed = False

    def _path(self, args: Any, state: Any) -> str | None:
        if self.mode == "main_process" and not state.is_world_process_zero:
            return None
        name = METRICS_FILE if self.mode == "main_process" else METRICS_FILE_PER_RANK.format(rank=args.process_index)
        return os.path.join(self.output_dir, name)

    def on_step_begin(self, args, state, control, **kwargs):
        # When resuming, Trainer restores global_step (the checkpoint's) after on_train_begin: trim here, once.
        if self.trimmed:
            return
        self.trimmed = True
        path = self._path(args, state)
        if path is None or not os.path.exists(path):
            return
        lines, cut_off = read_metrics_lines(path)
        if cut_off:
            logger.warning("%s: dropped its last line, cut off (the run writing it was stopped mid-line).", path)
        kept = [line for line in lines if json.loads(line).get("step", 0) <= state.global_step]
        with open(path, "w") as f:
            f.writelines(kept)

    def on_log(self, args, state, control, logs=None, **kwargs):
        path = self._path(args, state)
        if path is None:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **(logs or {})}, default=float) + "\n")


class RunFolderCallback(TrainerCallback):
    """Keeps an `opefo_trl.runs.RunFolder` up to date: before a checkpoint is saved, its folder (and the model card
    TRL writes next to it, ``README.md``) is named in the manifest; once it is saved, the run folder is told
    (an overwrite then deletes the earlier run it set aside)."""

    def __init__(self, run: RunFolder) -> None:
        self.run = run

    def _declare(self, state, control) -> None:
        if control.should_save:
            self.run.declare([f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", "README.md"])

    def on_step_end(self, args, state, control, **kwargs):
        self._declare(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._declare(state, control)

    def on_save(self, args, state, control, **kwargs):
        self.run.saved()
