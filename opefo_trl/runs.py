"""Run folders and checkpoints: what a run owns in its ``output_dir``, one run per folder, and checkpoints that are
whole or not checkpoints at all.

- The run folder (:class:`RunFolder`, held by ``opefo-train`` while it trains):

  - an OS lock (:class:`RunLock`: ``fcntl.flock`` on ``<output_dir>/.opefo_run.lock``) held for the run's lifetime,
    so a second run into the folder is refused at once with the holder's pid and host. The kernel releases the lock
    of a process that dies, so the lock file a killed run leaves blocks nobody;
  - a manifest (``opefo_run_manifest.json``) of the top-level entries the run writes, each recorded before it is
    written. :func:`run_files` is what it lists, and :func:`foreign_entries` what no run of ours wrote;
  - an overwrite that cannot destroy what it does not own: the earlier run's entries (those its manifest lists, and
    nothing else) are set aside in ``.opefo_overwritten/``, deleted only once the new run has saved its first
    checkpoint or its final model, and moved back if it fails before that (after a kill, by the next run into the
    folder: :func:`recover_interrupted_run`).

- Checkpoints (:func:`saving_checkpoint`, around ``Trainer._save_checkpoint``): the Trainer's files, then the token
  method's state (``opefo_method_state.json``), then a completion marker (``opefo_checkpoint_complete.json``, the size
  of every file), written last and atomically. A save that fails removes the folder. :func:`check_checkpoint` reads,
  without loading a tensor, every file ``Trainer`` will load (safetensors headers through ``safetensors.safe_open``,
  the zip directories of ``torch.save`` files, the JSON states, the sizes the marker recorded) and names the first
  problem (a missing marker: the save did not finish) with the previous whole checkpoint; :func:`resume_checkpoint`
  is what ``resume_from_checkpoint`` resumes from (``True``: the last *whole* checkpoint).

- Metrics files (``metrics.jsonl``): :func:`read_metrics_lines` drops a cut-off last line (what a kill leaves) and
  refuses a corrupt line before it.

Example:
    >>> from opefo_trl.runs import run_files
    >>> run_files("runs/opefo-7b")  # doctest: +SKIP
    ['checkpoint-50', 'checkpoint-100', 'metrics.jsonl', 'model.safetensors']
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

try:
    import fcntl
except ImportError:  # Windows: no flock, so runs are not locked there
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: The metrics files of `opefo-train` (`metrics_jsonl`): one for the main process, or one per process.
METRICS_FILE = "metrics.jsonl"
METRICS_FILE_PER_RANK = "metrics.rank{rank}.jsonl"
TRAINER_STATE_NAME = "trainer_state.json"
#: The token method's state in a checkpoint (`OPEFOTrainer`), e.g. PAR's coefficient.
METHOD_STATE_NAME = "opefo_method_state.json"
#: Written last into a checkpoint, once every other file is on disk: ``{"step": N, "files": {path: size}}``.
CHECKPOINT_MARKER = "opefo_checkpoint_complete.json"
#: The top-level entries of an output_dir that runs of `opefo-train` wrote there: ``{"entries": [name, ...]}``.
MANIFEST_NAME = "opefo_run_manifest.json"
LOCK_NAME = ".opefo_run.lock"
#: Where an overwrite keeps the earlier run's entries until the new run has saved something.
SET_ASIDE_DIR = ".opefo_overwritten"
#: Where `opefo-train` saves the final model before moving its files into output_dir (named in the manifest first).
FINAL_MODEL_STAGING = ".opefo_final_model"
CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_METRICS_RE = re.compile(r"^metrics(\.rank\d+)?\.jsonl$")
#: Weight files `Trainer.save_model` writes (full model, shards and their index, a PEFT adapter).
_WEIGHTS_RE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
#: What `Trainer` writes with `torch.save` into a checkpoint (zip archives since torch 1.6).
_TORCH_SAVE_RE = re.compile(r"\.(pt|pth|bin)$")
#: Free space under which a failed write is taken for a full disk (torch and safetensors raise errors of their own).
_LOW_SPACE = 64 << 20


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


# ----------------------------------------------------------------------------------------------------------------------
# Files written whole
# ----------------------------------------------------------------------------------------------------------------------


def _fsync_dir(folder: str) -> None:
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


def _write_json_atomically(path: str, content: Any) -> None:
    """``content`` as JSON at ``path``, whole or not at all: a flushed temporary file moved over it."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(content, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(folder)


# ----------------------------------------------------------------------------------------------------------------------
# The manifest: what runs of opefo-train wrote into an output_dir
# ----------------------------------------------------------------------------------------------------------------------


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
    _write_json_atomically(
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
    from opefo_trl.eval.store import RUN_CONFIG_FILE, SAMPLES_FILE

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


# ----------------------------------------------------------------------------------------------------------------------
# One run per folder: the lock
# ----------------------------------------------------------------------------------------------------------------------


def _read_holder(fd: int) -> dict | None:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def busy_message(output_dir: str, holder: dict | None) -> str:
    """What a run refused by the lock of ``output_dir`` is told."""
    lock = os.path.join(output_dir, LOCK_NAME)
    who = (
        f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('since')})"
        if holder
        else "a process that has just taken it"
    )
    return (
        f"output_dir {output_dir!r} is in use by another run: {who} holds its lock {lock}. Two runs in one folder "
        "would mix their checkpoints and metrics: wait for that run to end (or stop it), or give another --output_dir."
    )


def lock_holder(output_dir: str) -> dict | None:
    """Who holds the lock of ``output_dir`` (``{"pid", "host", "since"}``, ``{}`` if unreadable), None if nobody
    does: a lock file left by a process that died holds no lock."""
    path = os.path.join(output_dir, LOCK_NAME)
    if fcntl is None or not os.path.exists(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<output_dir>/.opefo_run.lock``, from :meth:`acquire` to :meth:`release`
    (or as a context manager). The lock file holds the holder's pid, host and start time for the message a second
    run gets; it is removed on release.

    Example:
        >>> with RunLock("runs/opefo"):  # doctest: +SKIP
        ...     ...  # a second RunLock("runs/opefo").acquire(), in any process, raises RunFolderBusy
    """

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self, attempts: int = 5) -> RunLock:
        """Take the lock now, or raise :class:`RunFolderBusy` (after ``attempts`` tries 50 ms apart, so that a
        :func:`lock_holder` probe does not refuse a run)."""
        if fcntl is None:
            return self
        holder = None
        for _ in range(attempts):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                time.sleep(0.05)
                continue
            try:  # its last holder may have removed the file between our open and our lock: then lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(mine).encode(), 0)
            self._fd = fd
            return self
        raise RunFolderBusy(busy_message(self.output_dir, holder))

    def _open(self) -> int:
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunFolderError(
                f"Cannot write into output_dir {self.output_dir!r} ({err}); give a folder this user can write to."
            ) from None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.remove(self.path)  # still locked: a process that opened it meanwhile sees it is gone and retries
        except FileNotFoundError:
            pass
        os.close(self._fd)  # releases the lock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ----------------------------------------------------------------------------------------------------------------------
# Overwrite: set aside, then delete once the new run has saved something, or move back
# ----------------------------------------------------------------------------------------------------------------------


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _set_aside(output_dir: str) -> list[str]:
    """Move the entries the manifest lists, and the manifest, into ``SET_ASIDE_DIR``; returns their names.

    The manifest goes first: whatever a kill interrupts, the folder set aside holds the manifest of everything
    that is not back in place yet, and the manifest in output_dir (if any) is the new run's. A manifest none of whose
    entries exists any more is only removed.
    """
    entries = run_files(output_dir)
    if not entries:
        _remove(os.path.join(output_dir, MANIFEST_NAME))
        return []
    aside = os.path.join(output_dir, SET_ASIDE_DIR)
    os.mkdir(aside)
    os.replace(os.path.join(output_dir, MANIFEST_NAME), os.path.join(aside, MANIFEST_NAME))
    for name in entries:
        os.replace(os.path.join(output_dir, name), os.path.join(aside, name))
    _fsync_dir(output_dir)
    return entries


def _restore(output_dir: str) -> list[str]:
    """Undo :func:`_set_aside`: remove what the new run wrote (its manifest's entries), move the earlier run back."""
    aside = os.path.join(output_dir, SET_ASIDE_DIR)
    names = sorted(os.listdir(aside))
    if MANIFEST_NAME in names:  # else nothing was moved yet, and output_dir's manifest is still the earlier run's
        for name in read_manifest(output_dir) or []:
            _remove(os.path.join(output_dir, name))
        _remove(os.path.join(output_dir, MANIFEST_NAME))
    for name in names:
        os.replace(os.path.join(aside, name), os.path.join(output_dir, name))
    os.rmdir(aside)
    _fsync_dir(output_dir)
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


def recover_interrupted_run(output_dir: str) -> list[str]:
    """Finish or undo what a killed run left half done (call it holding the lock); returns the names moved back.

    The earlier run that an overwrite set aside before saving anything is moved back (the killed run's own entries
    removed); a deletion of the entries set aside is finished; a final model not moved into place yet is removed.
    """
    if os.path.isdir(os.path.join(output_dir, SET_ASIDE_DIR + ".discard")):
        _discard_set_aside(output_dir)
    shutil.rmtree(os.path.join(output_dir, FINAL_MODEL_STAGING), ignore_errors=True)
    if not os.path.isdir(os.path.join(output_dir, SET_ASIDE_DIR)):
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
        self._not_ours: set[str] = set()

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
            ours = set(read_manifest(self.output_dir) or []) | {MANIFEST_NAME}
            self._not_ours = set(os.listdir(self.output_dir)) - ours  # eval folders, hidden files: never touched
            record_in_manifest(self.output_dir, self.declared)
        except BaseException:
            self.close(failed=True)
            raise
        return self

    def declare(self, names: Iterable[str]) -> None:
        """Record ``names`` in the manifest before they are written."""
        record_in_manifest(self.output_dir, names)

    def _refresh(self) -> None:
        """The manifest as the folder is: what exists of it, what is declared, and whatever else the run wrote."""
        present = {n for n in os.listdir(self.output_dir) if not n.startswith(".")} - self._not_ours
        write_manifest(self.output_dir, (present - {MANIFEST_NAME}) | set(self.declared))

    def saved(self) -> None:
        """A checkpoint or the final model is whole: the earlier run set aside is deleted now."""
        self._refresh()
        if os.path.isdir(os.path.join(self.output_dir, SET_ASIDE_DIR)):
            _discard_set_aside(self.output_dir)
            logger.info("overwrite_output_dir: deleted the earlier run's %s.", ", ".join(self.set_aside))
            self.set_aside = []

    def publish_final_model(self, staging: str) -> list[str]:
        """Move the files of a model saved into ``staging`` into output_dir, each named in the manifest before it
        lands there; returns their names."""
        names = sorted(os.listdir(staging))
        clashes = sorted(set(names) & self._not_ours)
        if clashes:
            raise RunFolderError(
                f"The final model has {', '.join(clashes)}, which {self.output_dir} already holds and no run of ours "
                f"wrote; it is left in {staging}."
            )
        self.declare(names)
        for name in names:
            _remove(os.path.join(self.output_dir, name))
            os.replace(os.path.join(staging, name), os.path.join(self.output_dir, name))
        os.rmdir(staging)
        self.saved()
        return names

    def close(self, failed: bool) -> None:
        """Release the folder. A run that failed before it saved anything moves the earlier run back; a run that
        wrote nothing leaves the folder as it found it."""
        try:
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
            shutil.rmtree(os.path.join(self.output_dir, FINAL_MODEL_STAGING), ignore_errors=True)
            try:
                nothing_written = os.path.isdir(self.output_dir) and not run_files(self.output_dir)
            except RunFolderError:  # a damaged manifest, reported by whoever opened the folder
                nothing_written = False
            if nothing_written:
                _remove(os.path.join(self.output_dir, MANIFEST_NAME))
        finally:
            self.lock.release()
            if self._created and os.path.isdir(self.output_dir) and not os.listdir(self.output_dir):
                os.rmdir(self.output_dir)


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------------


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-<step>`` folder of ``output_dir``, by step, whole or not."""
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
    _write_json_atomically(
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


def _safetensors_problem(path: str) -> str | None:
    """Why safetensors cannot read the file whole (it checks the header and that the data covers the file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:  # the header only: no tensor is read
            f.keys()
    except SafetensorError as err:
        return f"cannot be read by safetensors (cut short or damaged: {err})"
    return None


def _file_problem(path: str, method_state_name: str, saved_size: int | None) -> str | None:
    """Why a checkpoint file cannot be loaded, read without loading any tensor; None if it looks whole."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    known = name.endswith((".safetensors", ".json")) or _TORCH_SAVE_RE.search(name)
    if known and size == 0 and saved_size != 0:
        return "is empty"
    if saved_size is not None and size != saved_size:
        if size < saved_size:
            return f"is cut short: it has {size} bytes where its save wrote {saved_size}"
        return f"has changed since it was saved: it has {size} bytes where its save wrote {saved_size}"
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
    """``(file, reason)`` of the first reason ``checkpoint`` cannot be resumed from, else None: a damaged file, then
    a missing completion marker, then a file the marker lists that is gone, the trainer state, the weights."""
    sizes, marker_problem = _marker(checkpoint)
    for root, _, files in sorted(os.walk(checkpoint)):
        for name in sorted(files):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, checkpoint)
            if relative == CHECKPOINT_MARKER or name.startswith("."):
                continue
            reason = _file_problem(path, METHOD_STATE_NAME, sizes.get(relative))
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
    if not any(_WEIGHTS_RE.match(n) for n in names) and not any(
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


def check_checkpoint(checkpoint: str, method: str | None = None) -> None:
    """Refuse a checkpoint that ``Trainer`` could not resume from, before any weights load.

    A checkpoint without its completion marker is incomplete (its save did not finish). Every file is read as far
    as needed to know it is whole (its size against the marker's, safetensors headers, the central directory of
    ``torch.save`` zips, the JSON states), never loaded. With ``method``, a checkpoint saved by another token method
    (``opefo_method_state.json``), or without the state of a method that has one (PAR's coefficient), is refused too.

    Raises:
        CheckpointError: naming the file, what is wrong with it, and the previous checkpoint that is whole.
    """
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


# ----------------------------------------------------------------------------------------------------------------------
# Saving: whole or removed
# ----------------------------------------------------------------------------------------------------------------------


def _free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


@contextmanager
def reported_write_errors(folder: str, what: str, writer: bool = True) -> Iterator[None]:
    """Around writing ``folder`` (a checkpoint, the final model): if it fails, the folder is removed (``writer``:
    the process that writes it), and a failed write (any ``OSError``, or another error while the disk is full, as
    torch and safetensors report it) is raised as one-line :class:`CheckpointSaveError` naming the folder."""
    try:
        yield
    except Exception as err:
        free = _free_bytes(folder)
        if writer:
            shutil.rmtree(folder, ignore_errors=True)  # if even that fails, the folder has no marker: never resumed
        disk_full = (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            free is not None and free < _LOW_SPACE
        )
        if not (isinstance(err, OSError) or disk_full):
            raise
        lines = str(err).strip().splitlines()
        cause = f"{type(err).__name__}: {lines[0] if lines else ''}"
        if disk_full and not isinstance(err, OSError):
            cause = f"the disk is full ({free} bytes free; {cause})"
        gone = "was removed" if not os.path.exists(folder) else "has no completion marker, so it is never resumed"
        raise CheckpointSaveError(
            f"Cannot save the {what} {folder}: {cause}. The unfinished {what} {gone}. Free space on that disk (or make "
            "the folder writable), then resume from the last whole checkpoint with --resume_from_checkpoint true."
        ) from err


@contextmanager
def saving_checkpoint(
    run_dir: str,
    args: Any,
    state: Any,
    method_state: Callable[[], tuple[str, dict]],
    wait_for_everyone: Callable[[], None],
) -> Iterator[None]:
    """Around ``Trainer._save_checkpoint`` (its `TrainingArguments` and `TrainerState`): the checkpoint
    ``<run_dir>/checkpoint-<global_step>`` ends up whole, or removed.

    Before the Trainer's files: a folder of the same step (a save that did not finish, or a step replayed after an
    earlier resume) is removed, and the rotation of old checkpoints (``save_total_limit``) is held back, so that no
    whole checkpoint is deleted before the new one is. After them (every process done): the token method's state
    (``method_state()``: its name and ``state_dict()``), the completion marker, then the rotation. A failed save is
    handled by :func:`reported_write_errors`.
    """
    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    writer, limit = args.should_save, args.save_total_limit
    if writer and os.path.lexists(folder):
        _remove(folder)
    wait_for_everyone()  # removed before any process writes into it
    args.save_total_limit = None
    try:
        with reported_write_errors(folder, "checkpoint", writer):
            yield
            wait_for_everyone()
            if writer:
                save_method_state(folder, *method_state())
                mark_checkpoint_complete(folder)
    finally:
        args.save_total_limit = limit
    if writer:
        rotate_checkpoints(run_dir, limit, best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)


# ----------------------------------------------------------------------------------------------------------------------
# The token method's state in a checkpoint
# ----------------------------------------------------------------------------------------------------------------------


def save_method_state(checkpoint: str, method: str, state: dict) -> None:
    """Write the token method's name and state (``TokenMethod.state_dict()``) into a checkpoint folder."""
    _write_json_atomically(os.path.join(checkpoint, METHOD_STATE_NAME), {"method": method, "state": state})


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


# ----------------------------------------------------------------------------------------------------------------------
# Metrics files
# ----------------------------------------------------------------------------------------------------------------------


def read_metrics_lines(path: str) -> tuple[list[str], bool]:
    """The lines of a metrics file (JSON objects, each ending in a newline), and whether its last line was cut off
    (not valid JSON: what a kill during a write leaves) and dropped.

    Raises:
        MetricsFileError: a line before the last is not a JSON object (naming it and the fix).
    """
    with open(path) as f:
        lines = f.readlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    kept: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == last:
                return kept, True
            record = None
        if not isinstance(record, dict):
            raise MetricsFileError(
                f"{path}, line {number}, is not a metrics record: {line.strip()[:80]!r}. Resuming appends to this "
                "file and opefo-plot reads it: fix or delete that line (every logged step is also in the "
                f"checkpoints' {TRAINER_STATE_NAME}), or start afresh with --overwrite_output_dir true."
            )
        kept.append(line if line.endswith("\n") else line + "\n")
    return kept, False


def metrics_files(output_dir: str) -> list[str]:
    """Paths of the metrics files (``metrics.jsonl``, ``metrics.rank<N>.jsonl``) of ``output_dir``."""
    if not os.path.isdir(output_dir):
        return []
    return [os.path.join(output_dir, n) for n in sorted(os.listdir(output_dir)) if _METRICS_RE.match(n)]
