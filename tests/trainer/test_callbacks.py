"""opefo_trl.trainer.callbacks: the metrics file a run writes (opefo-train's runs write it too:
tests/cli/test_train.py)."""

import json
from types import SimpleNamespace

import pytest

from opefo_trl.trainer.callbacks import MetricsJsonlCallback


def _log(callback, step, rank=0, **logs):
    args, state = (
        SimpleNamespace(process_index=rank),
        SimpleNamespace(global_step=step, is_world_process_zero=rank == 0),
    )
    callback.on_step_begin(args, state, None)
    callback.on_log(args, state, None, logs=logs)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_logged_dict_is_a_line_with_its_step_on_the_main_process_only(tmp_path):
    callback = MetricsJsonlCallback(str(tmp_path / "run"))
    _log(callback, 1, loss=0.5)
    _log(callback, 2, **{"entropy_flow/lambda": 0.25})
    _log(callback, 2, rank=1, loss=9.0)  # another process: nothing written
    assert _lines(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "loss": 0.5},
        {"step": 2, "entropy_flow/lambda": 0.25},
    ]


def test_every_process_writes_its_own_file(tmp_path):
    callbacks = [MetricsJsonlCallback(str(tmp_path), mode="every_process") for _ in range(2)]
    for rank, callback in enumerate(callbacks):
        _log(callback, 1, rank=rank, loss=float(rank))
    assert _lines(tmp_path / "metrics.rank1.jsonl") == [{"step": 1, "loss": 1.0}]
    assert _lines(tmp_path / "metrics.rank0.jsonl") == [{"step": 1, "loss": 0.0}]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_resumed_run_drops_the_lines_after_its_checkpoint_once(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    callback = MetricsJsonlCallback(str(tmp_path))
    args = SimpleNamespace(process_index=0)
    resumed = SimpleNamespace(global_step=1, is_world_process_zero=True)  # from checkpoint-1: steps 2, 3 replayed
    callback.on_step_begin(args, resumed, None)
    resumed.global_step = 2
    callback.on_log(args, resumed, None, logs={"loss": 0.5})
    _log(callback, 3, loss=0.25)  # no second trim
    assert [(row["step"], row["loss"]) for row in _lines(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 0.5), (3, 0.25)]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"mode must be one of \('main_process', 'every_process'\), got 'off'"):
        MetricsJsonlCallback("out", mode="off")


def test_a_cut_off_last_line_is_dropped_with_a_warning_and_a_corrupt_one_before_it_refused(tmp_path, caplog):
    """What a kill mid-write leaves does not crash the first step of the resumed run with a JSONDecodeError."""
    from opefo_trl.runs import MetricsFileError

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    with caplog.at_level("WARNING", logger="opefo_trl.trainer.callbacks"):
        _log(MetricsJsonlCallback(str(tmp_path)), 2, loss=0.5)
    assert f"{path}: dropped its last line, cut off" in caplog.text
    assert _lines(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    path.write_text('{"step": 1, "loss": 1.0}')  # whole, without its newline: the next line is not glued on
    _log(MetricsJsonlCallback(str(tmp_path)), 2, loss=0.5)
    assert _lines(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    path.write_text('{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl, line 1, is not a metrics record"):
        _log(MetricsJsonlCallback(str(tmp_path)), 2, loss=0.5)


def test_the_run_folder_hears_of_each_checkpoint_before_and_after_it_is_saved(tmp_path):
    from opefo_trl.runs import RunFolder, read_manifest
    from opefo_trl.trainer.callbacks import RunFolderCallback

    run = RunFolder(str(tmp_path / "run")).open()
    callback = RunFolderCallback(run)
    state, control = SimpleNamespace(global_step=3), SimpleNamespace(should_save=False)
    callback.on_step_end(None, state, control)
    assert read_manifest(run.output_dir) == []
    control.should_save = True
    callback.on_step_end(None, state, control)  # named before Trainer writes it
    assert read_manifest(run.output_dir) == ["README.md", "checkpoint-3"]
    (tmp_path / "run" / "checkpoint-3").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("a user's")
    callback.on_save(None, state, control)  # what the run declared, never what appeared beside it
    assert read_manifest(run.output_dir) == ["README.md", "checkpoint-3"]
    run.close(failed=False)
