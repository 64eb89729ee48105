"""opefo_trl.runs.policy: which output_dir a run may have (checked before the weights load, and again under the lock),
and the run folder held while it trains. End to end through `opefo-train`: tests/cli/test_train.py."""

import os
from types import SimpleNamespace

import pytest

from opefo_trl.runs import (
    LOCK_NAME,
    MANIFEST_NAME,
    SET_ASIDE_DIR,
    OutputDirPolicy,
    RunFolderBusy,
    RunFolderError,
    RunLock,
    read_manifest,
)

EARLIER = ["checkpoint-2", "checkpoint-4", "config.json", "metrics.jsonl", "metrics.rank1.jsonl", "model.safetensors"]


def _args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir),
        resume_from_checkpoint=None,
        method="opefo",
        save_on_each_node=False,
        report_to=[],
        log_completions=False,
        push_to_hub=False,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def _policy(output_dir, model=None, overwrite=False, **overrides):
    return OutputDirPolicy(_args(output_dir, **overrides), model_name_or_path=model, overwrite=overwrite)


def test_an_earlier_run_is_refused_unless_resumed_or_overwritten(saved_run):
    with pytest.raises(ValueError) as raised:
        _policy(saved_run).check()
    assert str(raised.value) == (
        f"output_dir {str(saved_run)!r} holds an earlier run (checkpoint-2, checkpoint-4, config.json, metrics.jsonl, "
        "metrics.rank1.jsonl and 1 more); training into it would mix the two runs. Resume it with "
        "--resume_from_checkpoint true, start afresh in it with --overwrite_output_dir true (deletes those files once "
        "the new run has saved its first checkpoint), or give another --output_dir."
    )
    _policy(saved_run, resume_from_checkpoint=True).check()
    _policy(saved_run, overwrite=True).check()
    with pytest.raises(ValueError, match="overwrite_output_dir would delete the checkpoint .*checkpoint-4 this run"):
        _policy(saved_run, overwrite=True, resume_from_checkpoint=True).check()


def test_foreign_files_the_models_folder_and_an_overwrite_of_the_model_are_refused(saved_run, tmp_path):
    (saved_run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files that no run of opefo-train wrote .*: notes.txt\. opefo-train"):
        _policy(saved_run, overwrite=True).check()
    os.remove(saved_run / "notes.txt")
    with pytest.raises(ValueError, match="is the folder of the model this run starts from"):
        _policy(saved_run, model=str(saved_run)).check()
    model = str(saved_run / "checkpoint-2")
    with pytest.raises(ValueError) as raised:
        _policy(saved_run, model=model, overwrite=True).check()
    assert str(raised.value) == (
        f"overwrite_output_dir would delete {model}, which holds {model}, the model this run starts from; copy it "
        "elsewhere first, or give another --output_dir."
    )
    _policy(saved_run, model=str(tmp_path / "elsewhere"), overwrite=True).check()


def test_a_folder_another_run_holds_is_refused_and_a_process_that_does_not_write_checks_only_the_checkpoint(
    saved_run, monkeypatch
):
    with RunLock(str(saved_run)):
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}"):
            _policy(saved_run, resume_from_checkpoint=True).check()
        monkeypatch.setenv("RANK", "1")  # not the process that writes: neither the lock nor the earlier run matter
        policy = _policy(saved_run)
        assert not policy.writes_output_dir
        policy.check()
        with pytest.raises(FileNotFoundError, match="resume_from_checkpoint '.*missing' is not a directory"):
            _policy(saved_run, resume_from_checkpoint=str(saved_run / "missing")).check()
        with policy.held() as run:
            assert run is None


def test_the_files_a_run_writes_are_declared_before_it_writes_them(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    args = _args(tmp_path, report_to=["tensorboard"], log_completions=True, push_to_hub=True)
    policy = OutputDirPolicy(args, metrics_jsonl="every_process")
    assert policy.declared_names() == ["metrics.rank0.jsonl", "metrics.rank1.jsonl", "runs", "completions", "README.md"]
    assert OutputDirPolicy(_args(tmp_path), metrics_jsonl="off").declared_names() == []


def test_held_sets_the_earlier_run_aside_and_moves_it_back_if_training_fails(saved_run, snapshot):
    before = snapshot(saved_run)
    policy = _policy(saved_run, overwrite=True)
    with pytest.raises(RuntimeError, match="training failed"):
        with policy.held() as run:
            assert run.set_aside == EARLIER
            assert (saved_run / LOCK_NAME).exists() and (saved_run / SET_ASIDE_DIR).is_dir()
            assert read_manifest(str(saved_run)) == ["metrics.jsonl"]  # the new run's manifest
            raise RuntimeError("training failed")
    assert snapshot(saved_run) == before
    with policy.held() as run:
        (saved_run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not (saved_run / LOCK_NAME).exists()
    # The earlier run stays set aside until the new one saves something (the next run into the folder restores it).
    assert sorted(os.listdir(saved_run)) == sorted([".keep", SET_ASIDE_DIR, "eval", MANIFEST_NAME, "metrics.jsonl"])


def test_a_folder_that_changed_after_its_check_is_refused_under_the_lock(tmp_path):
    policy = _policy(tmp_path / "run")
    policy.check()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("written meanwhile")
    with pytest.raises(RunFolderError, match="holds files that no run of opefo-train wrote"):
        with policy.held():
            pytest.fail("trained in a folder holding another's files")
    assert sorted(os.listdir(tmp_path / "run")) == ["notes.txt"]  # no lock, no manifest left behind
