"""opefo-plot (opefo_trl.cli.plot): options parsed as opefo-train and opefo-eval parse theirs, runs drawn or refused."""

import pytest
from conftest import png_size, trainer_state_rows, write_trainer_state

from opefo_trl.cli.plot import main as plot_main
from opefo_trl.cli.plot import seed_group


def test_seed_group_names():
    assert seed_group("opefo-seed1") == "opefo"
    assert seed_group("entropy_reg_2") == "entropy_reg"
    assert seed_group("clip_cov") == "clip_cov"
    # Numbers that are settings, not seeds, keep runs apart.
    assert seed_group("opefo-lr-1e-6") != seed_group("opefo-lr-1e-5")
    assert seed_group("beta_0.1") != seed_group("beta_0.2")
    assert seed_group("opefo-lr-1e-6-seed2") == "opefo-lr-1e-6"


def test_cli_writes_png_and_reports_missing_metrics(tmp_path, capsys):
    write_trainer_state(tmp_path / "grpo-seed0", trainer_state_rows(4, 2.0, flows=False))
    write_trainer_state(tmp_path / "grpo-seed1", trainer_state_rows(4, 2.5, flows=False))
    out = tmp_path / "cli.png"
    code = plot_main([str(tmp_path / "grpo-seed0"), str(tmp_path / "grpo-seed1"), "--output", str(out), "--group"])
    captured = capsys.readouterr().out
    assert code == 0
    assert png_size(out)[0] > 0
    assert "not logged by any run" in captured and "entropy_flow/lambda" in captured
    assert f"wrote {out}" in captured


def test_cli_error_for_a_path_without_trainer_state(tmp_path, capsys):
    (tmp_path / "empty_run").mkdir()
    code = plot_main([str(tmp_path / "empty_run"), "--output", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2
    assert "No trainer_state.json" in err and "empty_run" in err
    assert not (tmp_path / "x.png").exists()


def test_cli_refuses_abbreviated_and_unknown_flags_naming_the_option(tmp_path, capsys):
    write_trainer_state(tmp_path / "run", trainer_state_rows(4, 2.0))
    # argparse would read `--smooth` as `--smoothing`: refused, as opefo-train and opefo-eval refuse it.
    assert plot_main([str(tmp_path / "run"), "--output", str(tmp_path / "x.png"), "--smooth", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "opefo-plot: error: Unknown option(s) on the command line: 'smooth' (did you mean 'smoothing'?)" in err
    assert not (tmp_path / "x.png").exists()


def test_runs_as_arguments_with_runs_or_in_a_recipe_give_one_figure(tmp_path, capsys):
    for seed in (0, 1):
        write_trainer_state(tmp_path / f"opefo-seed{seed}", trainer_state_rows(4, 2.0 + seed))
    runs = [str(tmp_path / "opefo-seed0"), str(tmp_path / "opefo-seed1")]
    recipe = tmp_path / "plot.yaml"
    recipe.write_text(f"runs: {runs}\nsmoothing: 0.5\ngroup: true\n")
    calls = {
        "arguments": [*runs, "--smoothing", "0.5", "--group", "-o", str(tmp_path / "a.png")],
        "mixed": ["--group", "true", runs[0], "--smoothing", "0.5", runs[1], "--output", str(tmp_path / "b.png")],
        "flag": ["--runs", *runs, "--group", "--smoothing", "0.5", "--output", str(tmp_path / "c.png")],
        "recipe": ["--config", str(recipe), "--output", str(tmp_path / "d.png")],
    }
    for name, argv in calls.items():
        assert plot_main(argv) == 0, name
        printed = capsys.readouterr().out.splitlines()
        assert [line.split(":")[0] for line in printed[:2]] == ["opefo-seed0", "opefo-seed1"], name
    # the same options however given: the same figure, byte for byte (smoothed and grouped)
    figures = {(tmp_path / f"{name}.png").read_bytes() for name in "abcd"}
    assert len(figures) == 1
    plot_main([*runs, "--output", str(tmp_path / "raw.png")])
    assert (tmp_path / "raw.png").read_bytes() not in figures  # unsmoothed, ungrouped: another figure


def test_runs_given_twice_or_not_at_all_are_refused(tmp_path, capsys):
    write_trainer_state(tmp_path / "run", trainer_state_rows(4, 2.0))
    assert plot_main([str(tmp_path / "run"), "--runs", str(tmp_path / "run"), "--output", "x.png"]) == 2
    assert "runs given both as arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse's own report of a missing required option
        plot_main(["--output", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --runs" in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_one_line_before_any_run_is_read(tmp_path, read_only_dir, capsys):
    write_trainer_state(tmp_path / "grpo", trainer_state_rows(4, 2.0, flows=False))
    for output, message in (
        (read_only_dir / "curves.png", f"Cannot write the figure '{read_only_dir / 'curves.png'}' ("),
        (read_only_dir / "figures" / "curves.png", f"Cannot write the figure '{read_only_dir / 'figures'}"),
        (tmp_path / "grpo", f"--output '{tmp_path / 'grpo'}' is a folder; give the PNG file to write"),
    ):
        assert plot_main([str(tmp_path / "grpo"), "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"opefo-plot: error: {message}") and "Traceback" not in err
    assert list(read_only_dir.iterdir()) == []


def test_a_cut_off_last_metrics_line_is_left_out_with_a_warning(tmp_path):
    """A run killed while writing its metrics leaves a partial last line; the figure then ends a step early, which
    the user is told (opefo-plot in its own process, as run from a shell)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    metrics = tmp_path / "opefo" / "metrics.jsonl"
    metrics.parent.mkdir()
    rows = trainer_state_rows(3, entropy0=2.0)
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 4, "entro')
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    command = [sys.executable, "-m", "opefo_trl.cli.plot", str(metrics.parent), "--output", str(tmp_path / "c.png")]
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"WARNING opefo_trl.plotting: {metrics}: its last line is cut off (a write was interrupted); the step it "
        "logged is left out of the figure."
    ]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))  # whole: nothing to say
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == ""


def test_a_run_with_too_few_logged_steps_is_named_not_drawn_as_empty_axes(tmp_path, capsys):
    """Issue 53: a one-step run drew empty axes and said nothing."""
    write_trainer_state(tmp_path / "one-step", trainer_state_rows(1, 2.0))
    out = tmp_path / "x.png"
    assert plot_main([str(tmp_path / "one-step"), "--output", str(out)]) == 0
    assert (
        "note: too few logged steps for a curve, drawn as points: 'one-step' (1 logged step: step 1); a curve needs "
        "2 (train more steps, or log more often: logging_steps)\n"
    ) in capsys.readouterr().out
    assert png_size(out)[0] > 0
