"""Run folders and checkpoints: what a run owns in its ``output_dir``, one run per folder, and checkpoints that are
whole or not checkpoints at all.

- :mod:`opefo_trl.runs.policy`: whether a run may have its output_dir, and holding it while it trains
  (:class:`OutputDirPolicy`, what ``opefo-train`` calls);
- :mod:`opefo_trl.runs.folder`: the run folder (:class:`RunFolder`): its lock, its manifest, and the overwrite;
- :mod:`opefo_trl.runs.checkpoint`: whole checkpoints (:func:`saving_checkpoint`, :func:`check_checkpoint`,
  :func:`resume_checkpoint`) and the token method's state in them;
- :mod:`opefo_trl.runs.metrics`: the metrics files (:func:`read_metrics_lines`);
- :mod:`opefo_trl.runs.options`: the options a checkpoint was trained with, and a resume with others;
- :mod:`opefo_trl.runs.files`: the names, errors and file helpers they share.

Example:
    >>> from opefo_trl.runs import CHECKPOINT_RE
    >>> int(CHECKPOINT_RE.match("checkpoint-50").group(1))
    50
"""

from opefo_trl.runs.checkpoint import (
    at_rollout_boundary,
    check_checkpoint,
    check_rollout_boundary,
    check_steps_left,
    checkpoints,
    foreign_checkpoint_files,
    load_method_state,
    mark_checkpoint_complete,
    method_is_stateful,
    previous_whole_checkpoint,
    reported_write_errors,
    resume_checkpoint,
    rollout_boundary_period,
    rollout_schedule,
    rotate_run_checkpoints,
    save_method_state,
    saving_checkpoint,
)
from opefo_trl.runs.files import (
    CHECKPOINT_MARKER,
    CHECKPOINT_RE,
    FINAL_MODEL_STAGING,
    LOCK_NAME,
    MANIFEST_NAME,
    METHOD_STATE_NAME,
    METRICS_FILE,
    METRICS_FILE_PER_RANK,
    RUN_OPTIONS_NAME,
    SET_ASIDE_DIR,
    TRAINER_STATE_NAME,
    UNFINISHED_FINAL_MODEL,
    CheckpointError,
    CheckpointSaveError,
    MetricsFileError,
    RunFolderBusy,
    RunFolderError,
    checkpoint_step,
)
from opefo_trl.runs.folder import (
    RunFolder,
    RunLock,
    busy_message,
    foreign_entries,
    interrupted_run,
    lock_holder,
    read_manifest,
    record_in_manifest,
    recover_interrupted_run,
    run_files,
    unfinished_final_models,
    write_manifest,
)
from opefo_trl.runs.metrics import metrics_files, read_metrics_lines
from opefo_trl.runs.options import check_resume_options, read_run_options, training_inputs
from opefo_trl.runs.policy import OutputDirPolicy

__all__ = [
    "CHECKPOINT_MARKER",
    "CHECKPOINT_RE",
    "FINAL_MODEL_STAGING",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "METHOD_STATE_NAME",
    "METRICS_FILE",
    "METRICS_FILE_PER_RANK",
    "RUN_OPTIONS_NAME",
    "SET_ASIDE_DIR",
    "TRAINER_STATE_NAME",
    "UNFINISHED_FINAL_MODEL",
    "CheckpointError",
    "CheckpointSaveError",
    "MetricsFileError",
    "OutputDirPolicy",
    "RunFolder",
    "RunFolderBusy",
    "RunFolderError",
    "RunLock",
    "at_rollout_boundary",
    "busy_message",
    "check_checkpoint",
    "check_resume_options",
    "check_rollout_boundary",
    "check_steps_left",
    "checkpoint_step",
    "checkpoints",
    "foreign_checkpoint_files",
    "foreign_entries",
    "interrupted_run",
    "load_method_state",
    "lock_holder",
    "mark_checkpoint_complete",
    "method_is_stateful",
    "metrics_files",
    "previous_whole_checkpoint",
    "read_manifest",
    "read_run_options",
    "read_metrics_lines",
    "record_in_manifest",
    "recover_interrupted_run",
    "reported_write_errors",
    "resume_checkpoint",
    "rollout_boundary_period",
    "rollout_schedule",
    "rotate_run_checkpoints",
    "run_files",
    "save_method_state",
    "saving_checkpoint",
    "training_inputs",
    "unfinished_final_models",
    "write_manifest",
]
