"""The run folder of ``opefo-train`` (:class:`RunFolder`, held while it trains): what the run owns, one run at a time,
and an overwrite that cannot destroy what it does not own.

- an OS lock (:class:`RunLock`: ``filelock.FileLock`` on ``<output_dir>/.opefo_run.lock``) held for the run's
  lifetime, so a second run into the folder is refused at once with the holder's pid and host. The kernel releases
  the lock of a process that dies, so the lock file a killed run leaves blocks nobody;
- a manifest (``opefo_run_manifest.json``) of the top-level entries the run writes, each recorded before it is
  written. :func:`run_files` is what it lists, and :func:`foreign_entries` what no run of ours wrote;
- the overwrite: the earlier run's entries (those its manifest lists, and nothing else) are set aside in
  ``.opefo_overwritten/``, deleted only once the new run has saved its first checkpoint or its final model, and moved
  back if it fails before that (after a kill, by the next run into the folder: :func:`recover_interrupted_run`).

Example:
    >>> from opefo_trl.runs import run_files
    >>> run_files("runs/opefo-7b")  # doctest: +SKIP
    ['checkpoint-50', 'checkpoint-100', 'metrics.jsonl', 'model.safetensors']
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable
from functools import partial

from filelock import FileLock, Timeout

from opefo_trl.runs.files import (
    CHECKPOINT_RE,
    FINAL_MODEL_SAVED,
    FINAL_MODEL_STAGING,
    LOCK_NAME,
    MANIFEST_NAME,
    RUN_CONFIG_FILE,
    SAMPLES_FILE,
    SET_ASIDE_DIR,
    TRAINING_ARGS_NAME,
    UNFINISHED_FINAL_MODEL,
    WEIGHTS_RE,
    RunFolderBusy,
    RunFolderError,
    file_problem,
    fsync_dir,
    remove_entry,
    write_json_atomically,
)

logger = logging.getLogger(__name__)


def read_manifest(output_dir: str) -> list[str] | None:
    """The entries the manifest of ``output_dir`` lists (None when it has none)."""
    path = os.path.join(output_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            content = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunFolderError(
            f"{path} is not valid JSON ({err}): opefo-train cannot tell which files of {output_dir} its earlier run "
            "wrote. Restore that file, or give another --output_dir."
        ) from None
    entries = content.get("entries") if isinstance(content, dict) else None
    if not (isinstance(entries, list) and all(isinstance(e, str) for e in entries)):
        raise RunFolderError(f"{path} lists no entries; restore that file, or give another --output_dir.")
    return entries


def write_manifest(output_dir: str, entries: Iterable[str]) -> None:
    """Replace the manifest of ``output_dir`` by ``entries`` (written atomically)."""
    write_json_atomically(
        os.path.join(output_dir, MANIFEST_NAME), {"written_by": "opefo-train", "entries": sorted(set(entries))}
    )


def record_in_manifest(output_dir: str, names: Iterable[str]) -> None:
    """Add ``names`` (top-level entries of ``output_dir``) to its manifest, creating it."""
    os.makedirs(output_dir, exist_ok=True)
    write_manifest(output_dir, [*(read_manifest(output_dir) or []), *names])


def _by_kind(name: str) -> tuple:
    match = CHECKPOINT_RE.match(name)
    return (0, int(match.group(1)), "") if match else (1, 0, name)


def run_files(output_dir: str) -> list[str]:
    """The entries of ``output_dir`` that its manifest lists and that exist: checkpoints by step, then the rest."""
    if not os.path.isdir(output_dir):
        return []
    entries = read_manifest(output_dir) or []
    return sorted((n for n in set(entries) if os.path.lexists(os.path.join(output_dir, n))), key=_by_kind)


def _is_eval_store(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in (SAMPLES_FILE, RUN_CONFIG_FILE))


def foreign_entries(output_dir: str) -> list[str]:
    """Top-level entries of ``output_dir`` that no run of ours wrote: not in its manifest, not hidden (``.name``),
    and not an ``opefo-eval`` output folder (``samples.jsonl`` / ``run_config.json``), which runs of ``opefo-train``
    never touch."""
    if not os.path.isdir(output_dir):
        return []
    listed = set(read_manifest(output_dir) or []) | {MANIFEST_NAME}
    foreign = []
    for name in sorted(os.listdir(output_dir), key=_by_kind):
        path = os.path.join(output_dir, name)
        if name in listed or name.startswith("."):
            continue
        if os.path.isdir(path) and not CHECKPOINT_RE.match(name) and _is_eval_store(path):
            continue
        foreign.append(name)
    return foreign


def _read_holder(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            holder = json.loads(f.read(4096) or b"null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


#: What two runs of opefo-train in one folder would mix (the end of the message the second one gets).
RUN_MIXES = "their checkpoints and metrics"


def busy_message(output_dir: str, holder: dict | None, mixes: str = RUN_MIXES) -> str:
    """What a run refused by the lock of ``output_dir`` is told (``mixes``: what two runs in it would mix)."""
    lock = os.path.join(output_dir, LOCK_NAME)
    who = (
        f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('since')})"
        if holder
        else "a process that has just taken it"
    )
    return (
        f"output_dir {output_dir!r} is in use by another run: {who} holds its lock {lock}. Two runs in one folder "
        f"would mix {mixes}: wait for that run to end (or stop it), or give another --output_dir."
    )


#: How long taking the lock is tried before a run is refused: a :func:`lock_holder` probe holds it for an instant, and
#: a holder that is releasing it removes its file first (a contender then retries on the new file).
LOCK_WAIT = 0.25


def lock_holder(output_dir: str) -> dict | None:
    """Who holds the lock of ``output_dir`` (``{"pid", "host", "since"}``, ``{}`` if unreadable), None if nobody
    does: a lock file left by a process that died holds no lock, and is removed (under the lock this probe takes)."""
    path = os.path.join(output_dir, LOCK_NAME)
    if not os.path.exists(path):
        return None
    probe = FileLock(path, thread_local=False, on_acquired=partial(_remove_if_still_at, path))
    try:
        probe.acquire(timeout=LOCK_WAIT)
    except Timeout:
        return _read_holder(path) or {}
    probe.release()
    return None


def _remove_if_still_at(path: str, fd: int) -> None:
    """Remove ``path`` if it is the file ``fd`` holds locked. filelock's contenders that opened it meanwhile find it
    gone once they lock it, and retry on a new file (Windows' filelock removes it itself, on release)."""
    if os.name == "nt":
        return
    try:
        if os.path.samestat(os.stat(path), os.fstat(fd)):
            os.remove(path)
    except FileNotFoundError:
        pass


class RunLock:
    """``filelock.FileLock`` on ``<output_dir>/.opefo_run.lock`` (an OS lock, ``flock`` on Unix), from
    :meth:`acquire` to :meth:`release` (or as a context manager): one holder at a time, in any process or this one.
    The kernel releases the lock of a process that dies, so the lock file a killed run leaves blocks nobody.

    The lock file holds the holder's pid, host and start time, written through filelock's descriptor once the lock is
    held, for the message a second run gets; it is removed on release (while still locked: filelock's contenders
    retry on a new file). ``mixes`` says, in that message, what two writers would mix (opefo-eval's sample stores are
    locked too).

    Example:
        >>> with RunLock("runs/opefo"):  # doctest: +SKIP
        ...     ...  # a second RunLock("runs/opefo").acquire(), in any process, raises RunFolderBusy
    """

    def __init__(self, output_dir: str, mixes: str = RUN_MIXES):
        self.output_dir = output_dir
        self.mixes = mixes
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._lock = FileLock(self.path, thread_local=False, on_acquired=self._record_holder)
        self._locked_fd: int | None = None  # filelock's descriptor, lent to `on_acquired`, while the lock is held
        self._record_error: OSError | None = None

    def acquire(self, wait: float = LOCK_WAIT) -> RunLock:
        """Take the lock, trying for ``wait`` seconds, or raise :class:`RunFolderBusy` naming its holder."""
        if self._lock.is_locked:
            return self
        self._record_error = None
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            self._lock.acquire(timeout=wait)
        except Timeout:
            raise RunFolderBusy(busy_message(self.output_dir, _read_holder(self.path), self.mixes)) from None
        except OSError as err:
            if err is self._record_error:  # a full disk: raised as it is, and no lock file is left behind
                raise
            raise RunFolderError(
                f"Cannot write into output_dir {self.output_dir!r} ({err}); give a folder this user can write to."
            ) from None
        return self

    def _record_holder(self, fd: int) -> None:
        """filelock's ``on_acquired``: the holder record, written into the locked file."""
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(mine).encode())
        except OSError as err:  # filelock then releases the lock; the file goes first, while it is still held
            self._record_error = err
            _remove_if_still_at(self.path, fd)
            raise
        self._locked_fd = fd

    def release(self) -> None:
        if not self._lock.is_locked:
            return
        if self._locked_fd is not None:
            _remove_if_still_at(self.path, self._locked_fd)
            self._locked_fd = None
        self._lock.release()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _set_aside(output_dir: str) -> list[str]:
    """Move the entries the manifest lists, and the manifest, into ``SET_ASIDE_DIR``; returns their names.

    The manifest goes first: whatever a kill interrupts, the folder set aside holds the manifest of everything
    that is not back in place yet, and the manifest in output_dir (if any) is the new run's. A manifest none of whose
    entries exists any more is only removed.
    """
    entries = run_files(output_dir)
    if not entries:
        remove_entry(os.path.join(output_dir, MANIFEST_NAME))
        return []
    aside = os.path.join(output_dir, SET_ASIDE_DIR)
    os.mkdir(aside)
    os.replace(os.path.join(output_dir, MANIFEST_NAME), os.path.join(aside, MANIFEST_NAME))
    for name in entries:
        os.replace(os.path.join(output_dir, name), os.path.join(aside, name))
    fsync_dir(output_dir)
    return entries


def _restore(output_dir: str) -> list[str]:
    """Undo :func:`_set_aside`: remove what the new run wrote (its manifest's entries), move the earlier run back."""
    aside = os.path.join(output_dir, SET_ASIDE_DIR)
    names = sorted(os.listdir(aside))
    if MANIFEST_NAME in names:  # else nothing was moved yet, and output_dir's manifest is still the earlier run's
        for name in read_manifest(output_dir) or []:
            remove_entry(os.path.join(output_dir, name))
        remove_entry(os.path.join(output_dir, MANIFEST_NAME))
    for name in names:
        os.replace(os.path.join(aside, name), os.path.join(output_dir, name))
    os.rmdir(aside)
    fsync_dir(output_dir)
    return [n for n in names if n != MANIFEST_NAME]


def _discard_set_aside(output_dir: str) -> None:
    """Delete the entries set aside: renamed first, so that a kill during the deletion leaves nothing to restore."""
    aside, discarded = os.path.join(output_dir, SET_ASIDE_DIR), os.path.join(output_dir, SET_ASIDE_DIR + ".discard")
    if os.path.isdir(aside):
        os.replace(aside, discarded)
    shutil.rmtree(discarded, ignore_errors=True)


def interrupted_run(output_dir: str) -> bool:
    """Whether a run into ``output_dir`` was killed in the middle of an overwrite or of moving its final model."""
    return any(
        os.path.lexists(os.path.join(output_dir, name))
        for name in (SET_ASIDE_DIR, SET_ASIDE_DIR + ".discard", FINAL_MODEL_STAGING)
    )


def _mark_final_model_saved(staging: str) -> None:
    with open(os.path.join(staging, FINAL_MODEL_SAVED), "w") as f:
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(staging)


def _move_final_model(output_dir: str, staging: str, declare: Callable[[list[str]], None] | None = None) -> list[str]:
    """Move the files of the whole model staged in ``staging`` into ``output_dir``, each named in the manifest
    (``declare``) before it lands there; returns their names. Raises :class:`RunFolderError` (the model left in
    ``staging``) when one of them would replace a file no run of ours wrote."""
    names = sorted(n for n in os.listdir(staging) if n != FINAL_MODEL_SAVED)
    ours = set(read_manifest(output_dir) or [])
    clashes = sorted(n for n in set(names) - ours if os.path.lexists(os.path.join(output_dir, n)))
    if clashes:
        raise RunFolderError(
            f"The final model has {', '.join(clashes)}, which {output_dir} already holds and no run of ours wrote; "
            f"the whole final model is kept in {staging}: move those files out of {output_dir} and run opefo-train "
            "again (it moves the model into place), or take the model from there."
        )
    if declare is None:
        record_in_manifest(output_dir, names)
    else:
        declare(names)
    for name in names:
        remove_entry(os.path.join(output_dir, name))
        os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
    fsync_dir(output_dir)
    remove_entry(os.path.join(staging, FINAL_MODEL_SAVED))
    os.rmdir(staging)
    return names


def saved_model_problem(folder: str) -> tuple[str, str] | None:
    """``(file, reason)`` of the first reason ``folder`` is not a whole model as ``Trainer.save_model`` writes it,
    else None: the file it writes last (``training_args.bin``) missing, a file that cannot be read whole (safetensors
    headers against the file's size, JSON, ``torch.save`` archives), no weights, or a shard its index lists missing.
    Nothing is loaded."""
    names = sorted(os.listdir(folder))
    if TRAINING_ARGS_NAME not in names:
        return os.path.join(folder, TRAINING_ARGS_NAME), "is missing (save_model writes it last: it did not finish)"
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            reason = None if name.startswith(".") else file_problem(os.path.join(root, name))
            if reason is not None:
                return os.path.join(root, name), reason
    if not any(WEIGHTS_RE.match(n) for n in names):
        return folder, "holds no model weights (model.safetensors, adapter_model.safetensors, ...)"
    for index in (n for n in names if WEIGHTS_RE.match(n) and n.endswith(".index.json")):
        with open(os.path.join(folder, index)) as f:
            content = json.load(f)
        shards = content.get("weight_map", {}) if isinstance(content, dict) else {}
        missing = sorted(set(shards.values()) - set(names)) if isinstance(shards, dict) else [index]
        if missing:
            return os.path.join(folder, missing[0]), f"is missing ({index} lists it)"
    return None


def unfinished_final_models(output_dir: str) -> list[str]:
    """The paths of the final models that runs into ``output_dir`` were killed while saving, kept for the user
    (``UNFINISHED_FINAL_MODEL``, then ``.2``, ``.3``, ...)."""
    if not os.path.isdir(output_dir):
        return []
    names = (n for n in os.listdir(output_dir) if n.split(".", 2)[:2] == UNFINISHED_FINAL_MODEL.split("."))
    return [os.path.join(output_dir, n) for n in sorted(names)]


def unfinished_final_model_message(output_dir: str, kept: str) -> str:
    """Where the final model of a run killed while saving it is, what it lacks, and how to take it or discard it."""
    problem = saved_model_problem(kept) if os.path.isdir(kept) else None
    lacks = f": {problem[0]} {problem[1]}" if problem else ""
    return (
        f"output_dir {output_dir!r} holds the final model of a run killed while saving it, kept in {kept}; it may "
        f"lack files{lacks}. Take it (move it out of {output_dir}; a tokenizer it lacks can be copied from the model "
        f"the run started from) or discard it (`rm -r {kept}`), then run the command again."
    )


def _keep_unfinished(output_dir: str, staging: str) -> str:
    """Rename the unfinished final model ``staging`` to a name of its own in ``output_dir``; returns its path."""
    kept, number = os.path.join(output_dir, UNFINISHED_FINAL_MODEL), 1
    while os.path.lexists(kept):
        number += 1
        kept = os.path.join(output_dir, f"{UNFINISHED_FINAL_MODEL}.{number}")
    os.replace(staging, kept)
    fsync_dir(output_dir)
    return kept


def _settle_final_model(output_dir: str) -> str | None:
    """What a run left in the final model's staging folder, never deleted: a whole model (``save_model`` returned,
    whether or not it was marked so before a kill) is moved into place ("moved"), or kept there if it cannot be
    ("kept", logged with where it is); a save that did not finish is kept under a name of its own ("unfinished",
    logged with where it is and what to do). None when there is no staging folder."""
    staging = os.path.join(output_dir, FINAL_MODEL_STAGING)
    if not os.path.lexists(staging):
        return None
    if not os.path.isfile(os.path.join(staging, FINAL_MODEL_SAVED)):
        if not os.path.isdir(staging) or saved_model_problem(staging) is not None:
            logger.warning("%s", unfinished_final_model_message(output_dir, _keep_unfinished(output_dir, staging)))
            return "unfinished"
        _mark_final_model_saved(staging)  # killed after save_model returned, before the mark: every file is whole
    try:
        names = _move_final_model(output_dir, staging)
    except RunFolderError as err:
        logger.warning("%s", err)
        return "kept"
    if names:
        logger.warning(
            "A run into %s was stopped before its saved final model was in place; its whole final model (%s) is now "
            "in %s.",
            output_dir,
            ", ".join(names),
            output_dir,
        )
    return "moved"


def recover_interrupted_run(output_dir: str) -> list[str]:
    """Finish or undo what a killed run left half done (call it holding the lock); returns the names moved back.

    A deletion of the entries set aside is finished. A staged final model is never deleted: one whose save finished
    (marked so, or with every file ``save_model`` writes whole) is moved into place; kept in its staging folder, and
    said so, if a file no run of ours wrote is in its way; a save that did not finish is kept under a name of its own
    (``UNFINISHED_FINAL_MODEL``), and said so. An overwrite whose final model is whole has finished: the earlier run
    it set aside is deleted, as the run would have. An overwrite that saved nothing whole is undone: the earlier run
    is moved back, the killed run's own entries removed (not its unfinished final model, which no manifest lists).
    """
    if os.path.isdir(os.path.join(output_dir, SET_ASIDE_DIR + ".discard")):
        _discard_set_aside(output_dir)
    final_model = _settle_final_model(output_dir)
    if not os.path.isdir(os.path.join(output_dir, SET_ASIDE_DIR)):
        return []
    if final_model == "moved":
        _discard_set_aside(output_dir)
        return []
    if final_model == "kept":  # the killed run finished: its final model is not undone with the overwrite
        logger.warning(
            "The earlier run that run overwrote stays set aside in %s until its final model is in place.",
            os.path.join(output_dir, SET_ASIDE_DIR),
        )
        return []
    return _restore(output_dir)


class RunFolder:
    """The output_dir of one run while it runs: its lock, its manifest, and an overwrite that deletes nothing before
    the new run has saved a checkpoint or its final model.

    Call :meth:`open` first, :meth:`declare` before writing a top-level entry, :meth:`saved` after each checkpoint
    (and :meth:`publish_final_model` for the final model), and :meth:`close` last, saying whether the run failed.

    Example:
        >>> run = RunFolder("runs/opefo", overwrite=True, declared=["metrics.jsonl"])  # doctest: +SKIP
        >>> run.open()  # locked; the earlier run is set aside  # doctest: +SKIP
        >>> ...; run.saved()  # the first checkpoint is whole: the earlier run is deleted  # doctest: +SKIP
        >>> run.close(failed=False)  # doctest: +SKIP
    """

    def __init__(self, output_dir: str, *, overwrite: bool = False, declared: Iterable[str] = ()):
        self.output_dir = output_dir
        self.overwrite = overwrite
        self.declared = list(declared)
        self.lock = RunLock(output_dir)
        self.set_aside: list[str] = []
        self.restored: list[str] = []
        self._created = False

    def open(self, check: Callable[[], None] | None = None) -> RunFolder:
        """Lock the folder; undo what a killed run left half done; ``check`` it (e.g. validate it again, now that
        nothing else can change it); set the earlier run aside when overwriting; start or extend the manifest."""
        self._created = not os.path.isdir(self.output_dir)
        self.lock.acquire()
        try:
            self.restored = recover_interrupted_run(self.output_dir)
            if check is not None:
                check()
            if self.overwrite and read_manifest(self.output_dir) is not None:
                self.set_aside = _set_aside(self.output_dir)
            record_in_manifest(self.output_dir, self.declared)
        except BaseException:
            self.close(failed=True)
            raise
        return self

    def declare(self, names: Iterable[str]) -> None:
        """Record ``names`` in the manifest before they are written."""
        names = list(names)
        self.declared += [n for n in names if n not in self.declared]
        record_in_manifest(self.output_dir, names)

    def _refresh(self) -> None:
        """The manifest as the folder is: what it lists that still exists (a rotated checkpoint is gone), and what
        this run declared. Never what else appeared in the folder meanwhile (an opefo-eval store, a user's notes):
        only what the manifest lists is ever deleted."""
        listed = {n for n in read_manifest(self.output_dir) or [] if os.path.lexists(os.path.join(self.output_dir, n))}
        write_manifest(self.output_dir, listed | set(self.declared))

    def saved(self) -> None:
        """A checkpoint or the final model is whole: the earlier run set aside is deleted now."""
        self._refresh()
        if os.path.isdir(os.path.join(self.output_dir, SET_ASIDE_DIR)):
            _discard_set_aside(self.output_dir)
            logger.info("overwrite_output_dir: deleted the earlier run's %s.", ", ".join(self.set_aside))
            self.set_aside = []

    def publish_final_model(self, staging: str) -> list[str]:
        """Move the files of a model saved into ``staging`` (``save_model`` has returned on every process) into
        output_dir, each named in the manifest before it lands there; returns their names. The staged model is marked
        whole first: from then on a kill leaves it for the next run to move into place, never to delete."""
        _mark_final_model_saved(staging)
        names = _move_final_model(self.output_dir, staging, self.declare)
        self.saved()
        return names

    def close(self, failed: bool) -> None:
        """Release the folder. A run that failed before it saved anything moves the earlier run back; a run that
        wrote nothing leaves the folder as it found it."""
        try:
            if _settle_final_model(self.output_dir) == "moved":  # e.g. interrupted (Ctrl-C) while moving it
                self.saved()
            if not failed and os.path.isdir(self.output_dir):
                self._refresh()  # e.g. the model card push_to_hub writes
            if failed and os.path.isdir(os.path.join(self.output_dir, SET_ASIDE_DIR)):
                restored = _restore(self.output_dir)
                logger.warning(
                    "The run failed before it saved a checkpoint: the earlier run's %s are back in %s.",
                    ", ".join(restored),
                    self.output_dir,
                )
                self.set_aside = []
            try:
                nothing_written = os.path.isdir(self.output_dir) and not run_files(self.output_dir)
            except RunFolderError:  # a damaged manifest, reported by whoever opened the folder
                nothing_written = False
            if nothing_written:
                remove_entry(os.path.join(self.output_dir, MANIFEST_NAME))
        finally:
            self.lock.release()
            if self._created and os.path.isdir(self.output_dir) and not os.listdir(self.output_dir):
                os.rmdir(self.output_dir)
