"""opefo_trl.runs.checkpoint: whole, damaged and incomplete checkpoints, and saves that end whole or removed."""

import errno
import json
import os
import pathlib
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers.trainer
from safetensors.torch import save_file
from transformers.trainer_utils import get_last_checkpoint

from opefo_trl.runs import (
    CHECKPOINT_MARKER,
    METHOD_STATE_NAME,
    CheckpointError,
    CheckpointSaveError,
    at_rollout_boundary,
    check_checkpoint,
    check_rollout_boundary,
    load_method_state,
    mark_checkpoint_complete,
    resume_checkpoint,
    rollout_boundary_period,
    saving_checkpoint,
)


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _empty(path):
    open(path, "wb").close()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"])
@pytest.mark.parametrize("damage", [_truncate, _empty])
def test_a_broken_checkpoint_file_is_named_with_the_previous_whole_checkpoint(saved_run, snapshot, name, damage):
    damage(saved_run / "checkpoint-4" / name)
    before = snapshot(saved_run)
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(str(saved_run / "checkpoint-4"))
    message = str(error.value)
    assert f"Cannot resume from {saved_run / 'checkpoint-4'}: {saved_run / 'checkpoint-4' / name} " in message
    saved = os.path.getsize(saved_run / "checkpoint-2" / name)  # both checkpoints hold the same files
    assert ("is empty" if damage is _empty else f"is cut short: it has {saved // 2} bytes where its save wrote") in (
        message
    )
    assert message.endswith(f"with --resume_from_checkpoint {saved_run / 'checkpoint-2'}.")
    assert snapshot(saved_run) == before  # read, never written


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
def test_damage_that_keeps_the_size_is_found_by_reading_the_file(saved_run, name, offset, reason):
    path = saved_run / "checkpoint-4" / name
    _overwrite_in_place(path, offset % os.path.getsize(path), b"\xff" * 8)
    with pytest.raises(CheckpointError, match=rf"{name} {__import__('re').escape(reason)}"):
        check_checkpoint(str(saved_run / "checkpoint-4"))


@pytest.mark.parametrize(
    "state, reason",
    [
        ({"global_step": 4, "trained_by": "a later release"}, "unexpected keyword argument 'trained_by'"),
        ([4], "must be a mapping"),
        ({"log_history": []}, "has no global_step"),
    ],
)
def test_a_trainer_state_that_transformers_cannot_resume_from_is_refused(tmp_path, write_checkpoint, state, reason):
    """Read as transformers' resume reads it (TrainerState.load_from_json), before any weights load."""
    checkpoint = write_checkpoint(tmp_path / "run", 3)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    mark_checkpoint_complete(str(checkpoint))
    with pytest.raises(CheckpointError, match=rf"trainer_state.json (cannot be read by .*{reason}|{reason})"):
        check_checkpoint(str(checkpoint))


def test_a_truncated_safetensors_file_is_found_without_a_marker(tmp_path, write_checkpoint):
    """safe_open checks that the data the header announces covers the file: no size record is needed."""
    checkpoint = write_checkpoint(tmp_path / "run", 3)
    _truncate(checkpoint / "model.safetensors")
    mark_checkpoint_complete(str(checkpoint))  # a marker that records the truncated size
    with pytest.raises(CheckpointError, match=r"model.safetensors cannot be read by safetensors \(cut short"):
        check_checkpoint(str(checkpoint))


def test_a_checkpoint_without_its_marker_is_incomplete_and_resume_true_takes_the_last_whole_one(
    saved_run, write_checkpoint, caplog
):
    """A save interrupted after every Trainer file and the method state, before the marker: not a checkpoint."""
    write_checkpoint(saved_run, 6, complete=False)
    incomplete = saved_run / "checkpoint-6"
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(str(incomplete))
    assert str(error.value) == (
        f"Cannot resume from {incomplete}: {incomplete / CHECKPOINT_MARKER} is missing: the save of this checkpoint "
        "did not finish (opefo-train writes it last, once every other file is saved). Resume from the previous "
        f"checkpoint with --resume_from_checkpoint {saved_run / 'checkpoint-4'}."
    )
    assert get_last_checkpoint(str(saved_run)) == str(incomplete)  # what Trainer would resume from
    with caplog.at_level("WARNING", logger="opefo_trl.runs"):
        assert resume_checkpoint(True, str(saved_run), "opefo") == str(saved_run / "checkpoint-4")
    assert f"Skipping {incomplete}: {incomplete / CHECKPOINT_MARKER} is missing" in caplog.text
    # Nothing whole left: said, with the reason.
    for step in (2, 4):
        (saved_run / f"checkpoint-{step}" / CHECKPOINT_MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* is whole: the last, .*checkpoint-6, cannot be"):
        resume_checkpoint(True, str(saved_run))
    with pytest.raises(CheckpointError, match="has no checkpoint-<step> folder"):
        resume_checkpoint(True, str(saved_run / "eval"))


def test_method_state_and_missing_files(saved_run):
    (saved_run / "checkpoint-4" / METHOD_STATE_NAME).write_text('{"method": "par"')
    with pytest.raises(CheckpointError, match=rf"{METHOD_STATE_NAME} is cut short"):
        check_checkpoint(str(saved_run / "checkpoint-4"))
    # Both broken: nothing whole before checkpoint-4 any more.
    _truncate(saved_run / "checkpoint-2" / "model.safetensors")
    with pytest.raises(CheckpointError, match="No earlier whole checkpoint is left next to it: start afresh"):
        check_checkpoint(str(saved_run / "checkpoint-4"))
    (saved_run / "checkpoint-4" / METHOD_STATE_NAME).write_text('{"method": "opefo", "state": {}}')  # the same size
    os.remove(saved_run / "checkpoint-4" / "optimizer.pt")  # deleted after the save
    with pytest.raises(CheckpointError, match=r"optimizer.pt is missing \(the checkpoint was saved with it\)"):
        check_checkpoint(str(saved_run / "checkpoint-4"))
    empty = saved_run / "checkpoint-6"
    empty.mkdir()
    mark_checkpoint_complete(str(empty))
    with pytest.raises(CheckpointError, match=r"trainer_state.json is missing \(without it training would restart"):
        check_checkpoint(str(empty))
    (empty / "trainer_state.json").write_text('{"global_step": 6}')
    mark_checkpoint_complete(str(empty))
    with pytest.raises(CheckpointError, match="holds no model weights"):
        check_checkpoint(str(empty))


def test_a_checkpoint_of_another_method_is_refused_with_the_fix(saved_run):
    check_checkpoint(str(saved_run / "checkpoint-4"), method="opefo")
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(str(saved_run / "checkpoint-4"), method="par")
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


def test_a_whole_checkpoint_passes(saved_run):
    check_checkpoint(str(saved_run / "checkpoint-2"))
    check_checkpoint(str(saved_run / "checkpoint-4"), method="opefo")


def _trainer_save(run_dir, step, args=None, fail_after=None, error=None):
    """What Trainer._save_checkpoint writes, in its order, then its rotation (``transformers.trainer``'s
    ``rotate_checkpoints``, looked up when called, with ``args.save_total_limit`` as it is then, as the Trainer does);
    raises ``error`` after the file ``fail_after``."""

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
        transformers.trainer.rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=None if args is None else args.save_total_limit,
            best_model_checkpoint=None,
            use_mtime=True,
        )

    return save


def _args(limit=None):
    return SimpleNamespace(should_save=True, save_total_limit=limit)


def _save(run_dir, step, method="par", limit=None, **failure):
    args, state = _args(limit), SimpleNamespace(global_step=step, best_model_checkpoint=None)
    with saving_checkpoint(str(run_dir), args, state, lambda: (method, {"coef": 0.1 * step}), lambda: None):
        _trainer_save(str(run_dir), step, args, **failure)()
    assert args.save_total_limit == limit


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


def _trls_boundaries(generate_every: int, accumulation: int, micro_batches_per_epoch: int, epochs: int) -> list[int]:
    """The optimizer steps after which TRL 1.16 samples a new rollout, simulated: transformers' Trainer gives each
    step `accumulation` micro-batches (the last of an epoch the remainder), TRL counts them over the run (`_step`)
    and samples at every multiple of `generate_every` (GRPOTrainer._prepare_inputs)."""
    boundaries, step, micro_batches = [], 0, 0
    for _ in range(epochs):
        left = micro_batches_per_epoch
        while left:
            taken = min(accumulation, left)
            left, micro_batches, step = left - taken, micro_batches + taken, step + 1
            if micro_batches % generate_every == 0:
                boundaries.append(step)
    return boundaries


@pytest.mark.parametrize(
    "steps_per_generation, num_iterations, accumulation, period",
    [(2, 1, 2, 1), (2, 1, 4, 1), (16, 1, 2, 8), (4, 2, 2, 4), (2, 1, 3, 2), (4, 2, 3, 8), (3, 1, 2, 3), (2, 1, 6, 1)],
)
def test_the_rollout_boundaries_are_trls(steps_per_generation, num_iterations, accumulation, period):
    """TRL 1.16 samples a rollout every steps_per_generation x num_iterations micro-batches, counted over the run;
    within an epoch the steps that end on one are the multiples of the period, and every epoch ends on one (an
    epoch's micro-batches are a multiple of the rollout's, the last step of an epoch takes the remainder)."""
    args = SimpleNamespace(
        steps_per_generation=steps_per_generation,
        num_iterations=num_iterations,
        gradient_accumulation_steps=accumulation,
    )
    assert rollout_boundary_period(args) == period
    generate_every = steps_per_generation * num_iterations
    for rollouts_per_epoch in (1, 2, 5):
        micro_batches = rollouts_per_epoch * generate_every
        steps_per_epoch = -(-micro_batches // accumulation)
        steps = range(1, 3 * steps_per_epoch + 1)
        expected = _trls_boundaries(generate_every, accumulation, micro_batches, epochs=3)
        assert [step for step in steps if at_rollout_boundary(step, args, steps_per_epoch)] == expected


def test_a_checkpoint_between_the_updates_of_a_rollout_is_refused_naming_the_last_one_at_a_boundary(
    tmp_path, write_checkpoint
):
    args = SimpleNamespace(steps_per_generation=8, num_iterations=1, gradient_accumulation_steps=2)  # 4 per rollout
    for step in (3, 4, 6, 7, 8):
        write_checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-8" / CHECKPOINT_MARKER).unlink()  # not whole: not named
    for step in (4, 8):
        check_rollout_boundary(str(tmp_path / f"checkpoint-{step}"), args)
    with pytest.raises(CheckpointError) as raised:
        check_rollout_boundary(str(tmp_path / "checkpoint-7"), args)
    assert str(raised.value).startswith(
        f"Cannot resume {tmp_path / 'checkpoint-7'}: it was saved at step 7, between the updates of one rollout. TRL "
        "samples a rollout every 8 micro-batches (steps_per_generation 8 x num_iterations 1) and an optimizer step "
        "takes 2 (gradient_accumulation_steps), so a rollout spans 4 optimizer steps. TRL keeps the rollout in "
        "memory, not in the checkpoint: the resume would sample a new rollout and train step 8 on other completions"
    )
    assert f"Resume from {tmp_path / 'checkpoint-4'}, the latest checkpoint at a rollout boundary" in str(raised.value)
    with pytest.raises(CheckpointError, match="No checkpoint before it is at a rollout boundary: start afresh"):
        check_rollout_boundary(str(tmp_path / "checkpoint-3"), args)
    # With epochs of 6 steps, step 6 ends an epoch (a boundary) and step 7 is the first of the next rollout's 4.
    check_rollout_boundary(str(tmp_path / "checkpoint-6"), args, steps_per_epoch=6)
    with pytest.raises(CheckpointError, match="train steps 8-10 on other completions"):
        check_rollout_boundary(str(tmp_path / "checkpoint-7"), args, steps_per_epoch=6)


def test_grpo_resumes_between_the_updates_of_a_rollout_as_grpo_trainer_does_with_a_warning(
    tmp_path, write_checkpoint, caplog
):
    """Issue 53: method="grpo" refused what GRPOTrainer resumes. Without ``refuse`` the resume goes on, and says that
    the rest of the rollout's updates train on a new rollout (what an uninterrupted run would not)."""
    args = SimpleNamespace(steps_per_generation=4, num_iterations=2, gradient_accumulation_steps=3)  # TRL's test's
    checkpoint = write_checkpoint(tmp_path, 4)
    with caplog.at_level("WARNING", logger="opefo_trl.runs"):
        check_rollout_boundary(str(checkpoint), args, refuse=False)
    assert caplog.messages == [
        f"Resuming {checkpoint}: it was saved at step 4, between the updates of one rollout. TRL samples a rollout "
        "every 8 micro-batches (steps_per_generation 4 x num_iterations 2) and an optimizer step takes 3 "
        "(gradient_accumulation_steps), so a rollout spans 8/3 optimizer steps and ends where a step ends only every "
        "8 steps (3 rollouts). TRL keeps the rollout in memory, not in the checkpoint, so, as GRPOTrainer does, the "
        "resume samples a new rollout and trains steps 5-8 on other completions than the uninterrupted run would."
    ]


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


def test_an_unreadable_checkpoint_file_is_named(saved_run, monkeypatch):
    """Issue 32, D10: a PermissionError traceback. (Made unreadable through ``open``: chmod does not stop root.)"""
    import builtins

    import opefo_trl.runs.files as files_module  # where checkpoint files are read (file_problem)

    checkpoint = saved_run / "checkpoint-4"
    unreadable = str(checkpoint / "optimizer.pt")

    def guarded_open(path, *args, **kwargs):
        if os.fspath(path) == unreadable:
            raise PermissionError(errno.EACCES, "Permission denied", unreadable)
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(files_module, "open", guarded_open, raising=False)
    with pytest.raises(CheckpointError) as raised:
        check_checkpoint(str(checkpoint), "opefo")
    assert str(raised.value).startswith(
        f"Cannot resume from {checkpoint}: {unreadable} cannot be read (PermissionError: Permission denied). Resume "
        f"from the previous checkpoint with --resume_from_checkpoint {saved_run / 'checkpoint-2'}."
    )


def test_a_run_folder_or_a_model_folder_is_not_a_checkpoint(saved_run, tmp_path):
    """Issue 32: they were "the save of this checkpoint did not finish"."""
    with pytest.raises(CheckpointError) as raised:
        check_checkpoint(str(saved_run), "opefo")
    assert str(raised.value) == (
        f"resume_from_checkpoint {saved_run} is not a checkpoint (no checkpoint-<step> name, no trainer_state.json); "
        f"it holds checkpoints: give one, e.g. {saved_run / 'checkpoint-4'}, or `true` with --output_dir {saved_run}."
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


def test_the_users_save_total_limit_is_left_as_it_is_and_the_trainers_rotation_waits_for_the_marker(tmp_path):
    """Issue 33: the rotation was held back by setting the user's ``args.save_total_limit`` to None during a save."""
    _save(tmp_path, 1, limit=1)
    args, state = _args(limit=1), SimpleNamespace(global_step=2, best_model_checkpoint=None)
    seen = []

    def method_state():  # after the Trainer's files and its rotation call, before the marker
        seen.append((args.save_total_limit, sorted(os.listdir(tmp_path))))
        return "par", {}

    with saving_checkpoint(str(tmp_path), args, state, method_state, lambda: None):
        assert args.save_total_limit == 1
        _trainer_save(str(tmp_path), 2, args)()
    assert seen == [(1, ["checkpoint-1", "checkpoint-2"])]  # the whole checkpoint-1 kept while 2 was not whole
    assert args.save_total_limit == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]  # rotated once checkpoint-2 is whole


def test_a_save_that_fails_after_the_trainers_files_keeps_the_last_whole_checkpoint(tmp_path):
    _save(tmp_path, 1, limit=1)
    state = SimpleNamespace(global_step=2, best_model_checkpoint=None)

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointSaveError, match="The unfinished checkpoint was removed"):
        args = _args(limit=1)
        with saving_checkpoint(str(tmp_path), args, state, full_disk, lambda: None):
            _trainer_save(str(tmp_path), 2, args)()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]
    assert resume_checkpoint(True, str(tmp_path), "par") == str(tmp_path / "checkpoint-1")


def test_only_the_saving_runs_rotation_is_held_back(tmp_path):
    """Another folder's rotation during the save (another Trainer in the process) goes through, and transformers'
    function is back in place after the save."""
    rotate = transformers.trainer.rotate_checkpoints
    other = tmp_path / "other"
    for step in (1, 2):
        _save(other, step)
    state = SimpleNamespace(global_step=1, best_model_checkpoint=None)
    with saving_checkpoint(str(tmp_path / "run"), _args(), state, lambda: ("par", {}), lambda: None):
        transformers.trainer.rotate_checkpoints(output_dir=str(other), save_total_limit=1, use_mtime=True)
        assert sorted(os.listdir(other)) == ["checkpoint-2"]
        _trainer_save(str(tmp_path / "run"), 1)()
    assert transformers.trainer.rotate_checkpoints is rotate


def test_a_real_save_keeps_the_arguments_and_rotates_after_the_marker(
    tiny_model_path, tiny_dataset, length_reward, tmp_path
):
    """OPEFOTrainer's save through transformers' real Trainer._save_checkpoint: the arguments the user gave are the
    trainer's, unchanged, during every save (and in each checkpoint's training_args.bin); checkpoint-1 is deleted only
    after checkpoint-2 is whole."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "trainer"))
    from trainer_setup import make_config, make_trainer

    args = make_config(tmp_path, method="par", save_strategy="steps", save_steps=1, save_total_limit=1, max_steps=2)
    trainer = make_trainer(tiny_model_path, tiny_dataset, length_reward, args)
    out = pathlib.Path(args.output_dir)
    seen = []
    state_dict = trainer.token_method.state_dict

    def recording_state_dict():  # called by the save after the Trainer's files, before the marker
        seen.append((trainer.args is args, args.save_total_limit, sorted(p.name for p in out.glob("checkpoint-*"))))
        return state_dict()

    trainer.token_method.state_dict = recording_state_dict
    trainer.train()
    assert seen == [(True, 1, ["checkpoint-1"]), (True, 1, ["checkpoint-1", "checkpoint-2"])]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    saved_args = torch.load(out / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved_args.save_total_limit == 1
    check_checkpoint(str(out / "checkpoint-2"), "par")


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


def test_the_rotation_keeps_a_checkpoint_holding_a_users_files_and_does_not_count_it(tmp_path, caplog):
    """A: save_total_limit deleted a checkpoint with the user's files in it (an opefo-eval store, a note), unsaid."""
    for step in (1, 2):
        _save(tmp_path, step, limit=2)
    (tmp_path / "checkpoint-1" / "eval").mkdir()
    (tmp_path / "checkpoint-1" / "eval" / "samples.jsonl").write_text("{}\n")
    with caplog.at_level("WARNING"):
        _save(tmp_path, 3, limit=2)
        _save(tmp_path, 4, limit=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
    assert (tmp_path / "checkpoint-1" / "eval" / "samples.jsonl").read_text() == "{}\n"
    assert caplog.text.count(f"save_total_limit: {tmp_path / 'checkpoint-1'} is kept, not rotated out") == 1
    assert "no run of opefo-train wrote (eval/samples.jsonl)" in caplog.text
    from opefo_trl.runs import foreign_checkpoint_files

    assert foreign_checkpoint_files(str(tmp_path / "checkpoint-1")) == [os.path.join("eval", "samples.jsonl")]
    assert foreign_checkpoint_files(str(tmp_path / "checkpoint-4")) == []


def test_a_step_saved_again_over_a_checkpoint_holding_a_users_files_keeps_them(tmp_path, caplog):
    _save(tmp_path, 1)
    (tmp_path / "checkpoint-1" / "notes.txt").write_text("mine")
    with caplog.at_level("WARNING"):
        _save(tmp_path, 1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "replaced-checkpoint-1"]
    assert (tmp_path / "replaced-checkpoint-1" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "checkpoint-1" / "notes.txt").exists()
    assert f"the earlier folder, with those files, is kept as {tmp_path / 'replaced-checkpoint-1'}" in caplog.text
