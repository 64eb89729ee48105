"""Whether a run of ``opefo-train`` may have its output_dir, and holding it while it trains.

The output_dir is the run's own: one run at a time holds it (a second is refused at once, naming the first's pid and
host); the run records every top-level entry it writes in its manifest, and refuses a folder holding files no run of
ours wrote (the model's own folder among them). An earlier run in it is refused unless resumed or overwritten
(``overwrite_output_dir``), which sets the earlier run's entries aside and deletes them only once the new run has saved
its first checkpoint or final model (they are moved back if it fails before). What a killed run left half done (an
overwrite, the final model's move) is finished or undone first. The mechanics are :class:`~opefo_trl.runs.RunFolder`'s;
:class:`OutputDirPolicy` decides, from the run's options, what is refused.

Example:
    >>> policy = OutputDirPolicy(training_args, model_name_or_path="Qwen/Qwen2.5-Math-7B")  # doctest: +SKIP
    >>> policy.check()  # before the weights load: raises naming what is wrong and the fix  # doctest: +SKIP
    >>> with policy.held() as run:  # locked, checked again, the earlier run set aside  # doctest: +SKIP
    ...     trainer.train()
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opefo_trl.runs.checkpoint import (
    check_checkpoint,
    check_rollout_boundary,
    check_steps_left,
    checkpoints,
    earlier_run_message,
    foreign_checkpoint_files,
    resume_checkpoint,
)
from opefo_trl.runs.files import (
    CHECKPOINT_RE,
    METRICS_FILE,
    METRICS_FILE_PER_RANK,
    SET_ASIDE_DIR,
    RunFolderBusy,
    RunFolderError,
)
from opefo_trl.runs.folder import (
    RunFolder,
    RunLock,
    busy_message,
    foreign_entries,
    interrupted_run,
    lock_holder,
    recover_interrupted_run,
    run_files,
    unfinished_final_model_message,
    unfinished_final_models,
)
from opefo_trl.runs.metrics import metrics_files, read_metrics_lines
from opefo_trl.runs.options import check_resume_options

logger = logging.getLogger(__name__)

#: What opefo-train reports as bad input; raised by the check made again under the lock, it is a RunFolderError.
_REFUSALS = (ValueError, FileNotFoundError, ImportError)


def _inside(path: str, folder: str) -> bool:
    return os.path.realpath(os.path.dirname(os.path.normpath(path))) == os.path.realpath(folder)


def _within(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(os.path.expanduser(path)), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


class OutputDirPolicy:
    """The output_dir a run asks for (``training_args``: its `OPEFOConfig`), checked and held.

    Args:
        training_args: the run's options: ``output_dir``, ``resume_from_checkpoint`` (a path, True for the last whole
            checkpoint, or None), ``method``, ``save_on_each_node``, and what decides the files it writes besides its
            checkpoints (``report_to``, ``log_completions``, ``push_to_hub``).
        model_name_or_path: the model the run starts from; its folder is never the output_dir, nor deleted.
        overwrite: start afresh in a folder holding an earlier run (``overwrite_output_dir``).
        metrics_jsonl: ``opefo-train``'s ``metrics_jsonl`` ("main_process", "every_process" or "off"), the metrics
            files the run writes.
    """

    def __init__(
        self,
        training_args: Any,
        *,
        model_name_or_path: str | None = None,
        overwrite: bool = False,
        metrics_jsonl: str = "main_process",
    ) -> None:
        self.args = training_args
        self.model_name_or_path = model_name_or_path
        self.overwrite = overwrite
        self.metrics_jsonl = metrics_jsonl

    @property
    def writes_output_dir(self) -> bool:
        """Whether this process writes the run folder (Trainer's ``should_save``), read from the launcher's
        environment: the distributed state does not exist yet."""
        return os.environ.get("LOCAL_RANK" if self.args.save_on_each_node else "RANK", "0") == "0"

    def declared_names(self) -> list[str]:
        """What the run writes into output_dir besides its checkpoints and final model, named in its manifest before
        it exists: the metrics files, TensorBoard's default ``runs/`` folder, TRL's ``completions/`` and the model
        card."""
        names = []
        if self.metrics_jsonl == "main_process":
            names.append(METRICS_FILE)
        elif self.metrics_jsonl == "every_process":
            names += [METRICS_FILE_PER_RANK.format(rank=r) for r in range(int(os.environ.get("WORLD_SIZE", "1")))]
        report_to = self.args.report_to or []
        if ("tensorboard" in report_to or "all" in report_to) and not os.environ.get("TENSORBOARD_LOGGING_DIR"):
            names.append("runs")
        if self.args.log_completions:
            names.append("completions")
        if self.args.push_to_hub:
            names.append("README.md")
        return names

    def check(self, *, locked: bool = False) -> None:
        """Refuse an output_dir this run cannot own, and a checkpoint to resume from that could not be loaded.

        Refused: a folder another run holds (its lock), the model's own folder, a folder holding the final model of a
        run killed while saving it (:func:`~opefo_trl.runs.unfinished_final_models`, kept until the user takes or
        discards it), a folder holding files no run of ours wrote (:func:`~opefo_trl.runs.foreign_entries`), an
        earlier run (:func:`~opefo_trl.runs.run_files`) unless this run resumes a checkpoint in it or overwrites it,
        an overwrite that would delete the model or checkpoint this run starts from, and a metrics file the resumed
        run would append to whose lines before the last are not whole. What a killed run left half done is finished or
        undone first, holding the lock. On the processes that do not write the folder, only the checkpoint is
        checked. ``locked``: the caller holds the folder's lock (:meth:`held`, checking again).
        """
        output_dir, resume = self.args.output_dir, self.args.resume_from_checkpoint
        if os.path.islink(output_dir) and not os.path.exists(output_dir):
            raise ValueError(
                f"output_dir {output_dir!r} is a symbolic link to {os.readlink(output_dir)!r}, which does not exist; "
                "create that folder, or give another --output_dir."
            )
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ValueError(f"output_dir {output_dir!r} is a file; give a directory (it is created if missing).")
        writer = self.writes_output_dir
        if writer and not locked and os.path.isdir(output_dir):
            self._recover(output_dir)
        kept = unfinished_final_models(output_dir) if writer else []
        if kept:  # the user takes it or discards it first
            raise ValueError(unfinished_final_model_message(output_dir, kept[0]))
        model = self.model_name_or_path
        if model and os.path.isdir(os.path.expanduser(model)):
            if os.path.realpath(os.path.expanduser(model)) == os.path.realpath(output_dir):
                raise ValueError(
                    f"output_dir {output_dir!r} is the folder of the model this run starts from (model_name_or_path): "
                    "its checkpoints and final model would be written over the model's own files. Give another "
                    "--output_dir."
                )
        if resume is not None and resume is not True and not os.path.isdir(resume):
            raise FileNotFoundError(
                f"resume_from_checkpoint {resume!r} is not a directory. Give a checkpoint-<step> folder, or `true` for "
                f"the last checkpoint in output_dir ({output_dir!r})."
            )
        if resume is True:  # the last whole checkpoint (the trainer says which incomplete ones it skips)
            resume = resume_checkpoint(True, output_dir, self.args.method, warn=False)
        resumes_here = resume is not None and _inside(resume, output_dir)
        if self.overwrite and resumes_here:
            raise ValueError(
                f"overwrite_output_dir would delete the checkpoint {resume} this run resumes from; drop one of the two."
            )
        if writer:
            self._check_contents(output_dir, resume, resumes_here)
        if resume is not None and self.args.resume_from_checkpoint is not True:  # `true`: checked when chosen
            check_checkpoint(resume, method=self.args.method)

    def _recover(self, output_dir: str) -> None:
        """Refuse a folder another run holds; finish or undo what a killed run left half done, holding the lock."""
        holder = lock_holder(output_dir)
        if holder is not None:
            raise RunFolderBusy(busy_message(output_dir, holder))
        if interrupted_run(output_dir):
            with RunLock(output_dir):
                restored = recover_interrupted_run(output_dir)
            if restored:
                logger.warning(
                    "A run into %s that overwrote it was stopped before it saved anything: the earlier run's %s are "
                    "back in place.",
                    output_dir,
                    ", ".join(restored),
                )

    def _check_contents(self, output_dir: str, resume: str | None, resumes_here: bool) -> None:
        """What the folder holds: files no run of ours wrote, an earlier run, and what an overwrite would delete."""
        foreign = foreign_entries(output_dir)
        if foreign:
            raise ValueError(
                f"output_dir {output_dir!r} holds files that no run of opefo-train wrote (its opefo_run_manifest.json "
                f"does not list them): {_shown(foreign)}. opefo-train writes over and deletes only what its own runs "
                "wrote: move them out of the folder, or give another --output_dir."
            )
        earlier = run_files(output_dir)
        if earlier and not resumes_here and not self.overwrite:
            raise ValueError(earlier_run_message(output_dir, earlier))
        self._check_checkpoint_contents(output_dir, earlier, resume if resumes_here else None)
        starts_from = [p for p in (self.model_name_or_path, resume) if p and os.path.isdir(os.path.expanduser(p))]
        if self.overwrite:
            for name in earlier:
                for path in starts_from:
                    if _within(path, os.path.join(output_dir, name)):
                        raise ValueError(
                            f"overwrite_output_dir would delete {os.path.join(output_dir, name)}, which holds {path}, "
                            "the model this run starts from; copy it elsewhere first, or give another --output_dir."
                        )
        if resumes_here:
            for path in metrics_files(output_dir):
                read_metrics_lines(path)  # a cut-off last line is dropped when training starts; a corrupt one is not

    def _check_checkpoint_contents(self, output_dir: str, earlier: list[str], resume: str | None) -> None:
        """Refuse an overwrite that would delete, or a resume that would save again over, a checkpoint holding files
        that no run of ours wrote (:func:`~opefo_trl.runs.foreign_checkpoint_files`: an opefo-eval store, a note)."""
        if self.overwrite:
            doomed, why = [os.path.join(output_dir, n) for n in earlier if CHECKPOINT_RE.match(n)], "delete"
        elif resume is not None and CHECKPOINT_RE.match(os.path.basename(os.path.normpath(resume))):
            # its step by name: its files are checked after this (check_checkpoint), and may be damaged
            step = int(CHECKPOINT_RE.match(os.path.basename(os.path.normpath(resume))).group(1))  # type: ignore[union-attr]
            doomed = [path for later, path in checkpoints(output_dir) if later > step]
            why = f"save again over (it trains the steps after {os.path.basename(os.path.normpath(resume))} anew)"
        else:
            return
        for path in doomed:
            foreign = foreign_checkpoint_files(path)
            if foreign:
                raise ValueError(
                    f"{'overwrite_output_dir' if self.overwrite else 'This resume'} would {why} {path}, which holds "
                    f"files that no run of opefo-train wrote: {_shown(foreign)}. Move them out of {path}, then run "
                    "the command again."
                )

    def check_resume(
        self, planned_steps: int, inputs: dict[str, Any] | None = None, steps_per_epoch: int | None = None
    ) -> None:
        """Refuse to resume a checkpoint at or past the run's ``planned_steps``, with options it would override or
        other ``inputs`` than it recorded (:func:`~opefo_trl.runs.check_resume_options`,
        :func:`~opefo_trl.runs.training_inputs`; what it takes is said when training resumes), or saved between the
        updates of one rollout by a method whose token weights come from the rollout
        (:func:`~opefo_trl.runs.check_rollout_boundary`; ``method="grpo"`` resumes there as GRPOTrainer does, and
        the trainer warns)."""
        from opefo_trl.methods import get_token_method_class

        resume = resume_checkpoint(self.args.resume_from_checkpoint, self.args.output_dir, self.args.method, warn=False)
        if resume is not None:
            check_steps_left(resume, planned_steps)
            check_resume_options(resume, self.args, inputs)
            if get_token_method_class(self.args.method).weighs_tokens():
                check_rollout_boundary(resume, self.args, steps_per_epoch)

    @contextmanager
    def held(self) -> Iterator[RunFolder | None]:
        """The run folder while the block trains (None on a process that does not write it): locked, checked again
        now that nothing else can change it, the earlier run set aside when overwriting; released when the block
        ends, the earlier run moved back if the block fails before the run saved anything."""
        if not self.writes_output_dir:
            yield None
            return
        output_dir = self.args.output_dir
        run = RunFolder(output_dir, overwrite=self.overwrite, declared=self.declared_names())
        try:
            run.open(lambda: self.check(locked=True))
        except RunFolderError:
            raise
        except _REFUSALS as err:  # the folder changed since it was checked
            raise RunFolderError(str(err)) from err
        if run.set_aside:
            logger.info(
                "overwrite_output_dir: the earlier run's %s are set aside in %s until this run saves its first "
                "checkpoint or its final model (moved back if it fails before).",
                ", ".join(run.set_aside),
                os.path.join(output_dir, SET_ASIDE_DIR),
            )
        try:
            yield run
        except BaseException:
            run.close(failed=True)
            raise
        run.close(failed=False)
