"""opefo_trl.runs: an earlier run's files, whole and broken checkpoints, and the data order of a resumed run."""

import os

import pytest
import torch
from safetensors.torch import save_file

from opefo_trl.runs import METHOD_STATE_NAME, CheckpointError, check_checkpoint, remove_run_files, run_files


@pytest.fixture
def run(tmp_path, write_checkpoint):
    """A run folder with checkpoints 2 and 4, metrics, a final model, and an opefo-eval folder of its own."""
    folder = tmp_path / "run"
    for step in (2, 4):
        write_checkpoint(folder, step)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "metrics.rank1.jsonl").write_text('{"step": 1}\n')
    save_file({"a": torch.zeros(2)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    (folder / "eval").mkdir()
    (folder / "eval" / "samples.jsonl").write_text("{}\n")
    (folder / "notes.txt").write_text("mine")
    return folder


def test_run_files_lists_what_training_wrote_and_removal_keeps_the_rest(run):
    expected = ["checkpoint-2", "checkpoint-4", "metrics.jsonl", "metrics.rank1.jsonl", "model.safetensors"]
    assert run_files(str(run)) == expected
    assert run_files(str(run / "missing")) == [] and run_files(str(run / "eval")) == []
    assert remove_run_files(str(run)) == expected
    assert sorted(os.listdir(run)) == ["config.json", "eval", "notes.txt"]
    assert (run / "eval" / "samples.jsonl").read_text() == "{}\n"


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
    assert ("is empty" if damage is _empty else "cut short" if name != "trainer_state.json" else "not valid JSON") in (
        message
    )
    assert message.endswith(f"with --resume_from_checkpoint {run / 'checkpoint-2'}.")
    assert snapshot(run) == before  # read, never written


def test_method_state_and_missing_files(run):
    (run / "checkpoint-4" / METHOD_STATE_NAME).write_text('{"method": "par"')
    with pytest.raises(CheckpointError, match=rf"{METHOD_STATE_NAME} is not valid JSON"):
        check_checkpoint(str(run / "checkpoint-4"))
    # Both broken: nothing whole before checkpoint-4 any more.
    _truncate(run / "checkpoint-2" / "model.safetensors")
    with pytest.raises(CheckpointError, match="No earlier whole checkpoint is left next to it: start afresh"):
        check_checkpoint(str(run / "checkpoint-4"))
    empty = run / "checkpoint-6"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"trainer_state.json is missing \(without it training would restart"):
        check_checkpoint(str(empty))
    (empty / "trainer_state.json").write_text('{"global_step": 6}')
    with pytest.raises(CheckpointError, match="holds no model weights"):
        check_checkpoint(str(empty))


def test_a_checkpoint_of_another_method_is_refused_with_the_fix(run):
    check_checkpoint(str(run / "checkpoint-4"), method="opefo")
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(str(run / "checkpoint-4"), method="par")
    assert "was trained with method='opefo', but this run uses method='par'. Resume with --method opefo" in str(
        error.value
    )


def test_a_whole_checkpoint_passes(run):
    check_checkpoint(str(run / "checkpoint-2"))
    check_checkpoint(str(run / "checkpoint-4"), method="opefo")
