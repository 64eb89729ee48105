"""opefo_trl.runs: what a run owns in its folder (manifest, lock, overwrite), whole and incomplete checkpoints, saves
that fail, and metrics files a kill cut short."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers.trainer_utils import get_last_checkpoint

from opefo_trl.runs import (
    CHECKPOINT_MARKER,
    LOCK_NAME,
    MANIFEST_NAME,
    METHOD_STATE_NAME,
    SET_ASIDE_DIR,
    CheckpointError,
    CheckpointSaveError,
    MetricsFileError,
    RunFolder,
    RunFolderBusy,
    RunFolderError,
    RunLock,
    check_checkpoint,
    foreign_entries,
    load_method_state,
    lock_holder,
    mark_checkpoint_complete,
    read_metrics_lines,
    record_in_manifest,
    recover_interrupted_run,
    resume_checkpoint,
    run_files,
    saving_checkpoint,
)


@pytest.fixture
def run(tmp_path, write_checkpoint):
    """A run folder with checkpoints 2 and 4, metrics, a final model (all in its manifest), an opefo-eval folder of
    its own and a hidden file."""
    folder = tmp_path / "run"
    for step in (2, 4):
        write_checkpoint(folder, step)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "metrics.rank1.jsonl").write_text('{"step": 1}\n')
    save_file({"a": torch.zeros(2)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    record_in_manifest(str(folder), ["metrics.jsonl", "metrics.rank1.jsonl", "model.safetensors", "config.json"])
    (folder / "eval").mkdir()
    (folder / "eval" / "samples.jsonl").write_text("{}\n")
    (folder / ".keep").write_text("hidden")
    return folder


# ----------------------------------------------------------------------------------------------------------------------
# The manifest
# ----------------------------------------------------------------------------------------------------------------------


def test_run_files_are_what_the_manifest_lists_and_foreign_entries_the_rest(run):
    expected = ["checkpoint-2", "checkpoint-4", "config.json", "metrics.jsonl", "metrics.rank1.jsonl"]
    assert run_files(str(run)) == [*expected, "model.safetensors"]
    assert foreign_entries(str(run)) == []  # the eval folder and the hidden file are not the run's, nor foreign
    (run / "notes.txt").write_text("mine")
    (run / "checkpoint-7").mkdir()  # a folder of the user's, named like a checkpoint
    (run / "checkpoint-7" / "paper.tex").write_text("mine")
    (run / "figures").mkdir()
    assert foreign_entries(str(run)) == ["checkpoint-7", "figures", "notes.txt"]
    assert run_files(str(run / "missing")) == [] and run_files(str(run / "eval")) == []
    (run / MANIFEST_NAME).write_text("{")
    with pytest.raises(RunFolderError, match=rf"{MANIFEST_NAME} is not valid JSON .*: opefo-train cannot tell"):
        run_files(str(run))


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints: whole, damaged, incomplete
# ----------------------------------------------------------------------------------------------------------------------


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _empty(path):
    open(path, "wb").close()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"])
@pytest.mark.parametrize("damage", [_truncate, _empty])
def test_a_broken_checkpoint_file_is_named_with_the_previous_whole_checkpoint(run, snapshot, name, damage):
    damage(run / "checkpoint-4" / name)
    before = snapshot(run)
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(str(run / "checkpoint-4"))
    message = str(error.value)
    assert f"Cannot resume from {run / 'checkpoint-4'}: {run / 'checkpoint-4' / name} " in message
    saved = os.path.getsize(run / "checkpoint-2" / name)  # both checkpoints hold the same files
    assert ("is empty" if damage is _empty else f"is cut short: it has {saved // 2} bytes where its save wrote") in (
        message
    )
    assert message.endswith(f"with --resume_from_checkpoint {run / 'checkpoint-2'}.")
    assert snapshot(run) == before  # read, never written


def _overwrite_in_place(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "name, offset, reason",
    [
        ("model.safetensors", 0, "cannot be read by safetensors (cut short or damaged: "),
        ("optimizer.pt", -22, "is not a whole torch.save archive"),
        ("trainer_state.json", 0, "is not valid JSON"),
    ],
)
def test_damage_that_keeps_the_size_is_found_by_reading_the_file(run, name, offset, reason):
    path = run / "checkpoint-4" / name
    _overwrite_in_place(path, offset % os.path.getsize(path), b"\xff" * 8)
    with pytest.raises(CheckpointError, match=rf"{name} {__import__('re').escape(reason)}"):
        check_checkpoint(str(run / "checkpoint-4"))


def test_a_truncated_safetensors_file_is_found_without_a_marker(tmp_path, write_checkpoint):
    """safe_open checks that the data the header announces covers the file: no size record is needed."""
    checkpoint = write_checkpoint(tmp_path / "run", 3)
    _truncate(checkpoint / "model.safetensors")
    mark_checkpoint_complete(str(checkpoint))  # a marker that records the truncated size
    with pytest.raises(CheckpointError, match=r"model.safetensors cannot be read by safetensors \(cut short"):
        check_checkpoint(str(checkpoint))


def test_a_checkpoint_without_its_marker_is_incomplete_and_resume_true_takes_the_last_whole_one(
    run, write_checkpoint, caplog
):
    """A save interrupted after every Trainer file and the method state, before the marker: not a checkpoint."""
    write_checkpoint(run, 6, complete=False)
    incomplete = run / "checkpoint-6"
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(str(incomplete))
    assert str(error.value) == (
        f"Cannot resume from {incomplete}: {incomplete / CHECKPOINT_MARKER} is missing: the save of this checkpoint "
        "did not finish (opefo-train writes it last, once every other file is saved). Resume from the previous "
        f"checkpoint with --resume_from_checkpoint {run / 'checkpoint-4'}."
    )
    assert get_last_checkpoint(str(run)) == str(incomplete)  # what Trainer would resume from
    with caplog.at_level("WARNING", logger="opefo_trl.runs"):
        assert resume_checkpoint(True, str(run), "opefo") == str(run / "checkpoint-4")
    assert f"Skipping {incomplete}: {incomplete / CHECKPOINT_MARKER} is missing" in caplog.text
    # Nothing whole left: said, with the reason.
    for step in (2, 4):
        (run / f"checkpoint-{step}" / CHECKPOINT_MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* is whole: the last, .*checkpoint-6, cannot be"):
        resume_checkpoint(True, str(run))
    with pytest.raises(CheckpointError, match="has no checkpoint-<step> folder"):
        resume_checkpoint(True, str(run / "eval"))


def test_method_state_and_missing_files(run):
    (run / "checkpoint-4" / METHOD_STATE_NAME).write_text('{"method": "par"')
    with pytest.raises(CheckpointError, match=rf"{METHOD_STATE_NAME} is cut short"):
        check_checkpoint(str(run / "checkpoint-4"))
    # Both broken: nothing whole before checkpoint-4 any more.
    _truncate(run / "checkpoint-2" / "model.safetensors")
    with pytest.raises(CheckpointError, match="No earlier whole checkpoint is left next to it: start afresh"):
        check_checkpoint(str(run / "checkpoint-4"))
    (run / "checkpoint-4" / METHOD_STATE_NAME).write_text('{"method": "opefo", "state": {}}')  # the same size
    os.remove(run / "checkpoint-4" / "optimizer.pt")  # deleted after the save
    with pytest.raises(CheckpointError, match=r"optimizer.pt is missing \(the checkpoint was saved with it\)"):
        check_checkpoint(str(run / "checkpoint-4"))
    empty = run / "checkpoint-6"
    empty.mkdir()
    mark_checkpoint_complete(str(empty))
    with pytest.raises(CheckpointError, match=r"trainer_state.json is missing \(without it training would restart"):
        check_checkpoint(str(empty))
    (empty / "trainer_state.json").write_text('{"global_step": 6}')
    mark_checkpoint_complete(str(empty))
    with pytest.raises(CheckpointError, match="holds no model weights"):
        check_checkpoint(str(empty))


def test_a_checkpoint_of_another_method_is_refused_with_the_fix(run):
    check_checkpoint(str(run / "checkpoint-4"), method="opefo")
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(str(run / "checkpoint-4"), method="par")
    assert "was trained with method='opefo', but this run uses method='par'. Resume with --method opefo" in str(
        error.value
    )


def test_a_stateful_methods_checkpoint_without_its_state_is_refused(tmp_path, write_checkpoint):
    folder = tmp_path / "run"
    write_checkpoint(folder, 2, method="par")
    checkpoint = write_checkpoint(folder, 4, method="par")
    os.remove(checkpoint / METHOD_STATE_NAME)
    mark_checkpoint_complete(str(checkpoint))  # whole otherwise: only the state is missing
    for refuse in (lambda: check_checkpoint(str(checkpoint), "par"), lambda: load_method_state(str(checkpoint), "par")):
        with pytest.raises(CheckpointError) as error:
            refuse()
        assert str(error.value) == (
            f"Cannot resume from {checkpoint}: it has no {METHOD_STATE_NAME}, which holds the state of method='par'; "
            "resuming would restart that state from its initial value. Resume from the previous checkpoint with "
            f"--resume_from_checkpoint {folder / 'checkpoint-2'}, or start from its weights without "
            f"resume_from_checkpoint (--model_name_or_path {checkpoint})."
        )
    # A method without state resumes such a checkpoint (its state is empty).
    check_checkpoint(str(checkpoint), "opefo")
    assert load_method_state(str(checkpoint), "opefo") is None


def test_a_whole_checkpoint_passes(run):
    check_checkpoint(str(run / "checkpoint-2"))
    check_checkpoint(str(run / "checkpoint-4"), method="opefo")


# ----------------------------------------------------------------------------------------------------------------------
# Saving: whole, or removed
# ----------------------------------------------------------------------------------------------------------------------


def _trainer_save(run_dir, step, fail_after=None, error=None):
    """What Trainer._save_checkpoint writes, in its order; raises ``error`` after the file ``fail_after``."""

    def save():
        folder = os.path.join(run_dir, f"checkpoint-{step}")
        os.makedirs(folder, exist_ok=True)
        for name, write in (
            ("model.safetensors", lambda p: save_file({"a": torch.ones(4)}, p)),
            ("optimizer.pt", lambda p: torch.save({"state": {}}, p)),
            ("trainer_state.json", lambda p: open(p, "w").write(json.dumps({"global_step": step}))),
        ):
            if name == fail_after:
                with open(os.path.join(folder, name), "wb") as f:
                    f.write(b"PK\x03\x04 half written")  # what a full disk leaves
                raise error
            write(os.path.join(folder, name))

    return save


def _args(limit=None):
    return SimpleNamespace(should_save=True, save_total_limit=limit)


def _save(run_dir, step, method="par", limit=None, **failure):
    args, state = _args(limit), SimpleNamespace(global_step=step, best_model_checkpoint=None)
    with saving_checkpoint(str(run_dir), args, state, lambda: (method, {"coef": 0.1 * step}), lambda: None):
        _trainer_save(str(run_dir), step, **failure)()
    assert args.save_total_limit == limit  # held back during the save only


def test_a_saved_checkpoint_has_the_method_state_and_the_marker_last(tmp_path):
    _save(tmp_path, 1)
    checkpoint = tmp_path / "checkpoint-1"
    marker = json.loads((checkpoint / CHECKPOINT_MARKER).read_text())
    assert marker["step"] == 1 and sorted(marker["files"]) == sorted(
        ["model.safetensors", "optimizer.pt", "trainer_state.json", METHOD_STATE_NAME, "opefo_run_options.json"]
    )
    assert marker["files"]["optimizer.pt"] == os.path.getsize(checkpoint / "optimizer.pt")
    assert load_method_state(str(checkpoint), "par") == {"coef": 0.1}
    check_checkpoint(str(checkpoint), "par")


@pytest.mark.parametrize(
    "error, reported",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "OSError: [Errno 28] No space left on device"),
        (OSError(errno.EROFS, "Read-only file system"), "OSError: [Errno 30] Read-only file system"),
    ],
)
def test_a_failed_write_is_one_line_naming_the_folder_and_leaves_no_partial_checkpoint(tmp_path, error, reported):
    _save(tmp_path, 1, limit=1)
    with pytest.raises(CheckpointSaveError) as raised:
        _save(tmp_path, 2, limit=1, fail_after="optimizer.pt", error=error)
    message = str(raised.value)
    assert "\n" not in message
    assert message == (
        f"Cannot save the checkpoint {tmp_path / 'checkpoint-2'}: {reported}. The unfinished checkpoint was removed. "
        "Free space on that disk (or make the folder writable), then resume from the last whole checkpoint with "
        "--resume_from_checkpoint true."
    )
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]  # kept: the rotation waits for a whole checkpoint
    assert resume_checkpoint(True, str(tmp_path), "par") == str(tmp_path / "checkpoint-1")


def test_a_failed_first_checkpoint_does_not_advise_a_resume_with_nothing_to_resume(tmp_path):
    """Issue 32: a full disk at a fresh run's first checkpoint advised --resume_from_checkpoint true, which then
    failed ("no checkpoint-<step> folder")."""
    with pytest.raises(CheckpointSaveError) as raised:
        _save(tmp_path, 1, fail_after="optimizer.pt", error=OSError(errno.ENOSPC, "No space left on device"))
    assert str(raised.value).endswith(
        "then run the command again (no whole checkpoint of this run is left to resume from)."
    )
    assert "--resume_from_checkpoint" not in str(raised.value)


def test_a_same_step_folder_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch):
    """Issue 32, D10: a PermissionError traceback from the removal of a same-step folder before the save."""
    import opefo_trl.runs.checkpoint as checkpoint_module

    (tmp_path / "checkpoint-1").mkdir()

    def refused(path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(checkpoint_module, "remove_entry", refused)
    with pytest.raises(CheckpointSaveError) as raised:
        _save(tmp_path, 1)
    assert str(raised.value) == (
        f"Cannot save the checkpoint {tmp_path / 'checkpoint-1'}: a folder of that step is there (an unfinished save, "
        "or a step replayed after a resume) and cannot be removed (PermissionError: [Errno 13] Permission denied: "
        f"'{tmp_path / 'checkpoint-1'}'). Make it removable, or remove it, then run the command again."
    )


def test_an_unreadable_checkpoint_file_is_named(run, monkeypatch):
    """Issue 32, D10: a PermissionError traceback. (Made unreadable through ``open``: chmod does not stop root.)"""
    import builtins

    import opefo_trl.runs.checkpoint as checkpoint_module

    checkpoint = run / "checkpoint-4"
    unreadable = str(checkpoint / "optimizer.pt")

    def guarded_open(path, *args, **kwargs):
        if os.fspath(path) == unreadable:
            raise PermissionError(errno.EACCES, "Permission denied", unreadable)
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "open", guarded_open, raising=False)
    with pytest.raises(CheckpointError) as raised:
        check_checkpoint(str(checkpoint), "opefo")
    assert str(raised.value).startswith(
        f"Cannot resume from {checkpoint}: {unreadable} cannot be read (PermissionError: Permission denied). Resume "
        f"from the previous checkpoint with --resume_from_checkpoint {run / 'checkpoint-2'}."
    )


def test_a_run_folder_or_a_model_folder_is_not_a_checkpoint(run, tmp_path):
    """Issue 32: they were "the save of this checkpoint did not finish"."""
    with pytest.raises(CheckpointError) as raised:
        check_checkpoint(str(run), "opefo")
    assert str(raised.value) == (
        f"resume_from_checkpoint {run} is not a checkpoint (no checkpoint-<step> name, no trainer_state.json); it "
        f"holds checkpoints: give one, e.g. {run / 'checkpoint-4'}, or `true` with --output_dir {run}."
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is not a checkpoint .*; it is a model: start from its weights with"):
        check_checkpoint(str(model), "opefo")


def test_another_error_is_raised_as_it_is_and_leaves_no_partial_checkpoint(tmp_path):
    with pytest.raises(RuntimeError, match="a bug"):
        _save(tmp_path, 1, fail_after="optimizer.pt", error=RuntimeError("a bug"))
    assert os.listdir(tmp_path) == []


def test_the_rotation_deletes_old_checkpoints_only_after_the_new_one_is_whole(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, limit=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-3"]
    # A step saved again (resumed from an older checkpoint) replaces the folder, it does not write into it.
    (tmp_path / "checkpoint-3" / "stale.bin").write_bytes(b"x")
    _save(tmp_path, 3, limit=2)
    assert "stale.bin" not in os.listdir(tmp_path / "checkpoint-3")
    check_checkpoint(str(tmp_path / "checkpoint-3"), "par")


# ----------------------------------------------------------------------------------------------------------------------
# One run per folder
# ----------------------------------------------------------------------------------------------------------------------

HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from opefo_trl.runs import RunLock
    RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def lock_in_another_process(tmp_path):
    """``start(folder) -> Popen``: a process holding the run lock of ``folder`` until it is killed."""
    processes = []

    def start(folder):
        process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True)
        processes.append(process)
        assert process.stdout.readline().strip() == "locked"
        return process

    yield start
    for process in processes:
        process.kill()
        process.wait()


def test_a_second_process_is_refused_at_once_and_a_killed_holder_blocks_nobody(tmp_path, lock_in_another_process):
    folder = tmp_path / "run"
    holder = lock_in_another_process(folder)
    assert lock_holder(str(folder))["pid"] == holder.pid
    with pytest.raises(RunFolderBusy) as error:
        RunLock(str(folder)).acquire()
    message = str(error.value)
    assert message.startswith(
        f"output_dir '{folder}' is in use by another run: pid {holder.pid} on host {socket.gethostname()} (since "
    )
    assert f"holds its lock {folder / LOCK_NAME}. Two runs in one folder would mix" in message
    holder.send_signal(signal.SIGKILL)  # kill -9: no clean-up runs
    holder.wait()
    assert (folder / LOCK_NAME).exists()  # the lock file is left behind, its lock released by the kernel
    assert lock_holder(str(folder)) is None
    with RunLock(str(folder)) as lock:
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}"):  # one holder, even within a process
            RunLock(str(folder)).acquire()
    assert lock.path and not (folder / LOCK_NAME).exists()


def test_an_unwritable_folder_is_named(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "makedirs", read_only)
    with pytest.raises(RunFolderError, match=rf"Cannot write into output_dir '{tmp_path / 'run'}' \(\[Errno 13\]"):
        RunLock(str(tmp_path / "run")).acquire()


# ----------------------------------------------------------------------------------------------------------------------
# Overwrite: set aside, deleted once the new run has saved something, or moved back
# ----------------------------------------------------------------------------------------------------------------------


EARLIER = ["checkpoint-2", "checkpoint-4", "config.json", "metrics.jsonl", "metrics.rank1.jsonl", "model.safetensors"]


def _new_run_writes(folder, run_folder):
    """The new run's first writes: a metrics line and a checkpoint without its marker yet."""
    run_folder.declare(["checkpoint-1"])
    (folder / "metrics.jsonl").write_text('{"step": 1, "new": true}\n')
    (folder / "checkpoint-1").mkdir()
    (folder / "checkpoint-1" / "model.safetensors").write_bytes(b"partial")


def test_an_overwrite_that_fails_before_saving_moves_the_earlier_run_back(run, snapshot):
    before = snapshot(run)
    folder = RunFolder(str(run), overwrite=True, declared=["metrics.jsonl"]).open()
    assert folder.set_aside == EARLIER
    assert sorted(os.listdir(run)) == sorted([".keep", LOCK_NAME, SET_ASIDE_DIR, "eval", MANIFEST_NAME])
    _new_run_writes(run, folder)
    folder.close(failed=True)
    assert snapshot(run) == before  # byte for byte, the eval folder and the hidden file never touched


def test_an_overwrite_deletes_the_earlier_run_once_the_new_one_has_saved_and_nothing_else(run, snapshot):
    kept = {k: v for k, v in snapshot(run).items() if k.startswith(("eval", ".keep"))}
    folder = RunFolder(str(run), overwrite=True, declared=["metrics.jsonl"]).open()
    _new_run_writes(run, folder)
    mark_checkpoint_complete(str(run / "checkpoint-1"))
    folder.saved()
    assert not (run / SET_ASIDE_DIR).exists()
    folder.close(failed=True)  # a failure after the first checkpoint keeps the new run
    after = snapshot(run)
    assert {k: after[k] for k in kept} == kept
    assert run_files(str(run)) == ["checkpoint-1", "metrics.jsonl"]
    assert sorted(os.listdir(run)) == [".keep", "checkpoint-1", "eval", "metrics.jsonl", MANIFEST_NAME]


def test_an_overwrite_killed_before_saving_is_undone_by_the_next_run(run, snapshot):
    before = snapshot(run)
    folder = RunFolder(str(run), overwrite=True, declared=["metrics.jsonl"]).open()
    _new_run_writes(run, folder)
    folder.lock.release()  # killed: no close(); the kernel releases the lock
    assert recover_interrupted_run(str(run)) == sorted(EARLIER)
    assert snapshot(run) == before


def test_a_run_that_writes_nothing_leaves_the_folder_as_it_found_it(tmp_path, snapshot):
    RunFolder(str(tmp_path / "new"), declared=["metrics.jsonl"]).open().close(failed=True)
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / ".keep").write_text("x")
    before = snapshot(tmp_path)
    RunFolder(str(tmp_path / "kept"), declared=["metrics.jsonl"]).open().close(failed=False)
    assert snapshot(tmp_path) == before


def test_the_final_model_is_named_in_the_manifest_before_it_lands(tmp_path):
    folder = RunFolder(str(tmp_path / "run"), declared=["metrics.jsonl"]).open()
    staging = tmp_path / "run" / ".opefo_final_model"
    staging.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        (staging / name).write_text(name)
    assert folder.publish_final_model(str(staging)) == ["config.json", "model.safetensors", "tokenizer.json"]
    folder.close(failed=False)
    assert run_files(str(tmp_path / "run")) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path / "run")) == sorted(
        ["config.json", MANIFEST_NAME, "model.safetensors", "tokenizer.json"]
    )


# ----------------------------------------------------------------------------------------------------------------------
# Metrics files
# ----------------------------------------------------------------------------------------------------------------------


def test_a_cut_off_last_metrics_line_is_dropped_and_a_corrupt_one_before_it_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert read_metrics_lines(str(path)) == (['{"step": 1}\n', '{"step": 2}\n'], True)
    path.write_text('{"step": 1}\n{"step": 2}')  # whole, without its newline
    assert read_metrics_lines(str(path)) == (['{"step": 1}\n', '{"step": 2}\n'], False)
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(MetricsFileError) as error:
        read_metrics_lines(str(path))
    assert str(error.value) == (
        f"{path}, line 2, is not a metrics record: '{{\"st'. Resuming appends to this file and opefo-plot reads it: "
        "fix or delete that line (every logged step is also in the checkpoints' trainer_state.json), or start "
        "afresh with --overwrite_output_dir true."
    )


def test_a_full_disk_that_torch_reports_as_its_own_error_is_named(tmp_path, monkeypatch):
    """torch.save and safetensors raise their own errors on a full disk (a torch inline_container RuntimeError)."""
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=1 << 30, free=4096))
    torch_error = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0\nframes: ...")
    with pytest.raises(CheckpointSaveError) as raised:
        _save(tmp_path, 1, fail_after="optimizer.pt", error=torch_error)
    assert str(raised.value).startswith(
        f"Cannot save the checkpoint {tmp_path / 'checkpoint-1'}: the disk is full (4096 bytes free; RuntimeError: "
        "[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0). The unfinished checkpoint was removed."
    )
    assert os.listdir(tmp_path) == []


def test_overwriting_a_run_whose_files_are_all_gone_sets_nothing_aside(tmp_path, snapshot):
    folder = tmp_path / "run"
    record_in_manifest(str(folder), ["checkpoint-1", "metrics.jsonl"])  # a run killed before it wrote anything
    run = RunFolder(str(folder), overwrite=True, declared=["metrics.jsonl"]).open()
    assert run.set_aside == [] and not (folder / SET_ASIDE_DIR).exists()
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    run.close(failed=False)
    before = snapshot(folder)
    assert recover_interrupted_run(str(folder)) == [] and snapshot(folder) == before  # the next run deletes nothing
