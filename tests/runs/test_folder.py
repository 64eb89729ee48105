"""opefo_trl.runs.folder: what a run owns in its folder (the manifest), one run per folder (the lock), and an
overwrite that deletes the earlier run only once the new one has saved something."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from opefo_trl.runs import (
    FINAL_MODEL_STAGING,
    LOCK_NAME,
    MANIFEST_NAME,
    SET_ASIDE_DIR,
    RunFolder,
    RunFolderBusy,
    RunFolderError,
    RunLock,
    foreign_entries,
    lock_holder,
    mark_checkpoint_complete,
    record_in_manifest,
    recover_interrupted_run,
    run_files,
)
from opefo_trl.runs.files import FINAL_MODEL_SAVED


def test_run_files_are_what_the_manifest_lists_and_foreign_entries_the_rest(saved_run):
    expected = ["checkpoint-2", "checkpoint-4", "config.json", "metrics.jsonl", "metrics.rank1.jsonl"]
    assert run_files(str(saved_run)) == [*expected, "model.safetensors"]
    assert foreign_entries(str(saved_run)) == []  # the eval folder and the hidden file are not the run's, nor foreign
    (saved_run / "notes.txt").write_text("mine")
    (saved_run / "checkpoint-7").mkdir()  # a folder of the user's, named like a checkpoint
    (saved_run / "checkpoint-7" / "paper.tex").write_text("mine")
    (saved_run / "figures").mkdir()
    assert foreign_entries(str(saved_run)) == ["checkpoint-7", "figures", "notes.txt"]
    assert run_files(str(saved_run / "missing")) == [] and run_files(str(saved_run / "eval")) == []
    (saved_run / MANIFEST_NAME).write_text("{")
    with pytest.raises(RunFolderError, match=rf"{MANIFEST_NAME} is not valid JSON .*: opefo-train cannot tell"):
        run_files(str(saved_run))


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
    assert not (folder / LOCK_NAME).exists()  # found free by that probe, and removed
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


EARLIER = ["checkpoint-2", "checkpoint-4", "config.json", "metrics.jsonl", "metrics.rank1.jsonl", "model.safetensors"]


def _new_run_writes(folder, run_folder):
    """The new run's first writes: a metrics line and a checkpoint without its marker yet."""
    run_folder.declare(["checkpoint-1"])
    (folder / "metrics.jsonl").write_text('{"step": 1, "new": true}\n')
    (folder / "checkpoint-1").mkdir()
    (folder / "checkpoint-1" / "model.safetensors").write_bytes(b"partial")


def test_an_overwrite_that_fails_before_saving_moves_the_earlier_run_back(saved_run, snapshot):
    before = snapshot(saved_run)
    folder = RunFolder(str(saved_run), overwrite=True, declared=["metrics.jsonl"]).open()
    assert folder.set_aside == EARLIER
    assert sorted(os.listdir(saved_run)) == sorted([".keep", LOCK_NAME, SET_ASIDE_DIR, "eval", MANIFEST_NAME])
    _new_run_writes(saved_run, folder)
    folder.close(failed=True)
    assert snapshot(saved_run) == before  # byte for byte, the eval folder and the hidden file never touched


def test_an_overwrite_deletes_the_earlier_run_once_the_new_one_has_saved_and_nothing_else(saved_run, snapshot):
    kept = {k: v for k, v in snapshot(saved_run).items() if k.startswith(("eval", ".keep"))}
    folder = RunFolder(str(saved_run), overwrite=True, declared=["metrics.jsonl"]).open()
    _new_run_writes(saved_run, folder)
    mark_checkpoint_complete(str(saved_run / "checkpoint-1"))
    folder.saved()
    assert not (saved_run / SET_ASIDE_DIR).exists()
    folder.close(failed=True)  # a failure after the first checkpoint keeps the new run
    after = snapshot(saved_run)
    assert {k: after[k] for k in kept} == kept
    assert run_files(str(saved_run)) == ["checkpoint-1", "metrics.jsonl"]
    assert sorted(os.listdir(saved_run)) == [".keep", "checkpoint-1", "eval", "metrics.jsonl", MANIFEST_NAME]


def test_an_overwrite_killed_before_saving_is_undone_by_the_next_run(saved_run, snapshot):
    before = snapshot(saved_run)
    folder = RunFolder(str(saved_run), overwrite=True, declared=["metrics.jsonl"]).open()
    _new_run_writes(saved_run, folder)
    folder.lock.release()  # killed: no close(); the kernel releases the lock
    assert recover_interrupted_run(str(saved_run)) == sorted(EARLIER)
    assert snapshot(saved_run) == before


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


def test_overwriting_a_run_whose_files_are_all_gone_sets_nothing_aside(tmp_path, snapshot):
    folder = tmp_path / "run"
    record_in_manifest(str(folder), ["checkpoint-1", "metrics.jsonl"])  # a run killed before it wrote anything
    run = RunFolder(str(folder), overwrite=True, declared=["metrics.jsonl"]).open()
    assert run.set_aside == [] and not (folder / SET_ASIDE_DIR).exists()
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    run.close(failed=False)
    before = snapshot(folder)
    assert recover_interrupted_run(str(folder)) == [] and snapshot(folder) == before  # the next run deletes nothing


def _stage_final_model(folder, saved: bool):
    """What a run killed while saving (``saved`` False) or moving (True) its final model leaves in its staging."""
    staging = folder / FINAL_MODEL_STAGING
    staging.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (staging / name).write_text(f"new {name}")
    if saved:
        (staging / FINAL_MODEL_SAVED).write_text("")
    return staging


def test_an_overwrite_killed_while_moving_its_final_model_finishes_the_move_and_the_overwrite(saved_run, caplog):
    """B: the next run deleted the staged final model (the only copy of a run without checkpoints) and moved the
    earlier run back; the overwrite had finished: its final model goes into place, the earlier run is deleted."""
    kept = {"eval", ".keep"}
    folder = RunFolder(str(saved_run), overwrite=True, declared=["metrics.jsonl"]).open()
    (saved_run / "metrics.jsonl").write_text('{"step": 1, "new": true}\n')
    _stage_final_model(saved_run, saved=True)
    folder.declare(["config.json", "model.safetensors", "tokenizer.json"])
    os.replace(saved_run / FINAL_MODEL_STAGING / "config.json", saved_run / "config.json")  # one file moved: killed
    folder.lock.release()
    with caplog.at_level("WARNING"):
        assert recover_interrupted_run(str(saved_run)) == []
    assert f"its whole final model (model.safetensors, tokenizer.json) is now in {saved_run}" in caplog.text
    assert {n: (saved_run / n).read_text() for n in ("config.json", "model.safetensors", "tokenizer.json")} == {
        n: f"new {n}" for n in ("config.json", "model.safetensors", "tokenizer.json")
    }
    assert run_files(str(saved_run)) == ["config.json", "metrics.jsonl", "model.safetensors", "tokenizer.json"]
    assert set(os.listdir(saved_run)) == {*run_files(str(saved_run)), *kept, MANIFEST_NAME}


def test_a_staged_final_model_in_the_way_of_a_users_file_is_kept_and_said_where(tmp_path, caplog):
    folder = tmp_path / "run"
    record_in_manifest(str(folder), ["metrics.jsonl"])
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    staging = _stage_final_model(folder, saved=True)
    (folder / "tokenizer.json").write_text("the user's")
    with caplog.at_level("WARNING"):
        recover_interrupted_run(str(folder))
    assert (
        f"The final model has tokenizer.json, which {folder} already holds and no run of ours wrote; the whole final "
        f"model is kept in {staging}"
    ) in caplog.text
    staged = [FINAL_MODEL_SAVED, "config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(staging)) == sorted(staged)
    assert (folder / "tokenizer.json").read_text() == "the user's"
    os.remove(folder / "tokenizer.json")  # the user moves it out: the next run moves the model into place
    RunFolder(str(folder)).open().close(failed=True)
    assert (folder / "tokenizer.json").read_text() == "new tokenizer.json" and not staging.exists()


def test_a_final_model_whose_save_did_not_finish_is_kept_under_its_own_name_and_said_so(saved_run, snapshot, caplog):
    """The next run deleted a staged final model without its mark, the only copy of a run without checkpoints: now it
    is kept, under a name of its own, every byte, and each command into the folder says where and how to take it."""
    from opefo_trl.runs import UNFINISHED_FINAL_MODEL

    before = snapshot(saved_run)
    staged = snapshot(_stage_final_model(saved_run, saved=False))
    with caplog.at_level("WARNING"):
        assert recover_interrupted_run(str(saved_run)) == []
    kept = saved_run / UNFINISHED_FINAL_MODEL
    assert snapshot(kept) == staged and not (saved_run / FINAL_MODEL_STAGING).exists()
    assert {n: v for n, v in snapshot(saved_run).items() if not n.startswith(UNFINISHED_FINAL_MODEL)} == before
    assert (
        f"holds the final model of a run killed while saving it, kept in {kept}; it may lack files: "
        f"{kept / 'training_args.bin'} is missing"
    ) in caplog.text
    assert f"or discard it (`rm -r {kept}`)" in caplog.text
    _stage_final_model(saved_run, saved=False)  # a second one keeps the first
    recover_interrupted_run(str(saved_run))
    assert snapshot(kept) == staged and snapshot(saved_run / f"{UNFINISHED_FINAL_MODEL}.2") == staged
