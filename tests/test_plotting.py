"""Plotting training curves from hand-written trainer_state.json files, and the opefo-plot CLI."""

import json
import math

import numpy as np
import pytest

from opefo_trl.cli.plot import main as plot_main
from opefo_trl.cli.plot import seed_group
from opefo_trl.plotting import RunNotFoundError, find_state_file, load_run, load_runs, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_state(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "trainer_state.json"
    path.write_text(json.dumps({"global_step": len(rows), "log_history": rows}))
    return path


def _rows(n, entropy0, flows=True):
    rows = []
    for step in range(1, n + 1):
        row = {"step": step, "epoch": step / n, "entropy": entropy0 / step, "reward": 0.1 * step, "loss": 0.0}
        if flows:
            row.update(
                {
                    "entropy_flow/lambda": 0.01 * (-1) ** step,
                    "entropy_flow/increase": 1.0 + step,
                    "entropy_flow/decrease": 2.0 + step,
                }
            )
        rows.append(row)
    # the Trainer's closing row has a step but no training metrics
    rows.append({"step": n, "train_runtime": 1.5, "train_loss": 0.0, "total_flos": 0.0})
    return rows


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, "not a PNG file"
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    return width, height


def test_series_reads_only_logged_training_steps(tmp_path):
    path = _write_state(tmp_path / "opefo", _rows(4, entropy0=2.0))
    run = load_run(path)
    assert run.label == "opefo"
    steps, values = run.series("entropy")
    assert steps.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(values, [2.0, 1.0, 2.0 / 3, 0.5])
    assert "entropy_flow/lambda" in run.keys()
    assert run.series("not_logged")[0].size == 0


def test_series_drops_non_finite_values(tmp_path):
    rows = [{"step": 1, "entropy": 1.0}, {"step": 2, "entropy": float("nan")}, {"step": 3, "entropy": 0.5}]
    path = tmp_path / "r" / "trainer_state.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"log_history": rows}))  # json writes NaN, as the Trainer does
    steps, values = load_run(path).series("entropy")
    assert steps.tolist() == [1, 3] and all(math.isfinite(v) for v in values)


def test_run_dir_checkpoint_dir_and_json_path_all_resolve(tmp_path):
    _write_state(tmp_path / "runA" / "checkpoint-5", _rows(5, 1.0))
    latest = _write_state(tmp_path / "runA" / "checkpoint-20", _rows(20, 1.0))
    _write_state(tmp_path / "runA" / "checkpoint-10", _rows(10, 1.0))
    # a run dir without its own state file resolves to its latest checkpoint (by step, not by name)
    assert find_state_file(tmp_path / "runA") == str(latest)
    assert load_run(tmp_path / "runA" / "checkpoint-10").label == "runA"
    assert load_run(latest).label == "runA"
    # a run dir with its own trainer_state.json prefers it
    own = _write_state(tmp_path / "runA", _rows(3, 1.0))
    assert find_state_file(tmp_path / "runA") == str(own)


def test_repeated_labels_are_made_unique(tmp_path):
    a = _write_state(tmp_path / "exp1" / "opefo", _rows(3, 1.0))
    b = _write_state(tmp_path / "exp2" / "opefo", _rows(3, 1.0))
    assert [r.label for r in load_runs([a, b])] == ["exp1/opefo", "exp2/opefo"]


def test_bad_paths_raise_clear_errors(tmp_path):
    with pytest.raises(RunNotFoundError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunNotFoundError, match="No trainer_state.json nor metrics.jsonl in"):
        load_run(tmp_path / "empty")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_run(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"foo": 1}))
    with pytest.raises(ValueError, match="no `log_history`"):
        load_run(other)
    with pytest.raises(ValueError, match="No runs given"):
        load_runs([])


def test_plot_writes_a_png_with_every_panel(tmp_path):
    runs = load_runs([_write_state(tmp_path / "grpo", _rows(6, 2.0)), _write_state(tmp_path / "opefo", _rows(6, 3.0))])
    out = tmp_path / "figs" / "curves.png"
    result = plot_runs(runs, out, title="test")
    assert result.missing == []
    assert set(result.plotted) == {
        "entropy",
        "reward",
        "entropy_flow/lambda",
        "entropy_flow/increase",
        "entropy_flow/decrease",
    }
    width, height = _png_size(out)
    assert width > 600 and height > 400  # a 2 x 2 grid of panels


def test_metrics_missing_from_every_run_are_skipped_and_reported(tmp_path):
    # plain TRL GRPO runs log no entropy_flow/* keys
    runs = load_runs([_write_state(tmp_path / "grpo", _rows(5, 2.0, flows=False))])
    out = tmp_path / "grpo.png"
    result = plot_runs(runs, out)
    assert result.plotted == ["entropy", "reward"]
    assert result.missing == ["entropy_flow/lambda", "entropy_flow/increase", "entropy_flow/decrease"]
    _, height_two_panels = _png_size(out)
    # a metric logged by only one of the runs is still drawn
    both = load_runs([tmp_path / "grpo", _write_state(tmp_path / "opefo", _rows(5, 2.0))])
    result = plot_runs(both, tmp_path / "both.png")
    assert result.missing == [] and "entropy_flow/lambda" in result.plotted
    _, height_four_panels = _png_size(tmp_path / "both.png")
    assert height_four_panels > height_two_panels


def test_measured_entropy_change_is_drawn_when_audited(tmp_path):
    # entropy_flow_audit_steps logs the measured change (every run) and, for `param`, the predicted one
    audited = _rows(6, 2.0)
    for row in audited[:-1]:
        row["entropy_flow/measured_delta"] = -0.01 * row["step"]
        row["entropy_flow/predicted_delta"] = -0.009 * row["step"]
    plain = load_runs([_write_state(tmp_path / "plain", _rows(6, 2.0))])
    without = plot_runs(plain, tmp_path / "plain.png")
    assert without.missing == [], "an optional panel nobody logged is not reported missing"
    assert "entropy_flow/measured_delta" not in without.plotted
    with_audit = plot_runs(load_runs([_write_state(tmp_path / "audited", audited)]), tmp_path / "audited.png")
    assert {"entropy_flow/measured_delta", "entropy_flow/predicted_delta"} <= set(with_audit.plotted)
    assert _png_size(tmp_path / "audited.png")[1] > _png_size(tmp_path / "plain.png")[1]  # a third row of panels


def test_plot_refuses_runs_without_any_known_metric(tmp_path):
    runs = load_runs([_write_state(tmp_path / "x", [{"step": 1, "loss": 0.3}])])
    with pytest.raises(ValueError, match="None of the metrics"):
        plot_runs(runs, tmp_path / "x.png")
    with pytest.raises(ValueError, match="smoothing"):
        plot_runs(runs, tmp_path / "x.png", smoothing=1.0)


def test_grouped_runs_are_averaged(tmp_path):
    import opefo_trl.plotting as plotting

    runs = load_runs([_write_state(tmp_path / f"opefo-seed{i}", _rows(4, entropy0=1.0 + i)) for i in range(3)])
    stats = plotting._group_series(runs, "entropy", smoothing=0.0)
    steps, mean, std, n = stats
    assert n == 3 and steps.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(mean, [2.0 / s for s in (1, 2, 3, 4)])
    np.testing.assert_allclose(std, [np.std([1.0, 2.0, 3.0]) / s for s in (1, 2, 3, 4)])
    groups = {r.label: seed_group(r.label) for r in runs}
    assert set(groups.values()) == {"opefo"}
    result = plot_runs(runs, tmp_path / "g.png", groups=groups, smoothing=0.5)
    assert _png_size(tmp_path / "g.png")[0] > 0 and result.missing == []


def test_seed_group_names():
    assert seed_group("opefo-seed1") == "opefo"
    assert seed_group("entropy_reg_2") == "entropy_reg"
    assert seed_group("clip_cov") == "clip_cov"
    # Numbers that are settings, not seeds, keep runs apart.
    assert seed_group("opefo-lr-1e-6") != seed_group("opefo-lr-1e-5")
    assert seed_group("beta_0.1") != seed_group("beta_0.2")
    assert seed_group("opefo-lr-1e-6-seed2") == "opefo-lr-1e-6"


def test_cli_writes_png_and_reports_missing_metrics(tmp_path, capsys):
    _write_state(tmp_path / "grpo-seed0", _rows(4, 2.0, flows=False))
    _write_state(tmp_path / "grpo-seed1", _rows(4, 2.5, flows=False))
    out = tmp_path / "cli.png"
    code = plot_main([str(tmp_path / "grpo-seed0"), str(tmp_path / "grpo-seed1"), "--output", str(out), "--group"])
    captured = capsys.readouterr().out
    assert code == 0
    assert _png_size(out)[0] > 0
    assert "not logged by any run" in captured and "entropy_flow/lambda" in captured
    assert f"wrote {out}" in captured


def test_cli_error_for_a_path_without_trainer_state(tmp_path, capsys):
    (tmp_path / "empty_run").mkdir()
    code = plot_main([str(tmp_path / "empty_run"), "--output", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2
    assert "No trainer_state.json" in err and "empty_run" in err
    assert not (tmp_path / "x.png").exists()


def test_cli_refuses_abbreviated_flags(tmp_path, capsys):
    _write_state(tmp_path / "run", _rows(4, 2.0))
    with pytest.raises(SystemExit) as exit_info:
        plot_main([str(tmp_path / "run"), "--output", str(tmp_path / "x.png"), "--smooth", "0.5"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --smooth 0.5" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_pass_at_k_panel_is_added_and_checked(tmp_path):
    runs = load_runs([_write_state(tmp_path / f"grpo-seed{i}", _rows(4, 2.0)) for i in range(2)])
    groups = {r.label: "grpo" for r in runs}
    plain = plot_runs(runs, tmp_path / "plain.png", groups=groups)
    curves = {"warm start": [{1: 0.1, 4: 0.3, 16: 0.6}], "grpo": [{1: 0.2, 4: 0.4, 16: 0.5}, {1: 0.3, 4: 0.5, 16: 0.7}]}
    with_panel = plot_runs(runs, tmp_path / "pass.png", groups=groups, pass_at_k=curves)
    assert "pass@k" in with_panel.plotted and "pass@k" not in plain.plotted
    # four panels fill a 2 x 2 grid: the pass@k panel opens a third row
    assert _png_size(tmp_path / "pass.png")[1] > _png_size(tmp_path / "plain.png")[1]
    # an empty mapping draws no panel
    assert "pass@k" not in plot_runs(runs, tmp_path / "none.png", pass_at_k={"grpo": []}).plotted
    with pytest.raises(ValueError, match="same k values"):
        plot_runs(runs, tmp_path / "bad.png", pass_at_k={"grpo": [{1: 0.2, 4: 0.4}, {1: 0.3}]})
    with pytest.raises(ValueError, match=">= 1"):
        plot_runs(runs, tmp_path / "bad.png", pass_at_k={"grpo": [{0: 0.2}]})


def _write_metrics(folder, rows, name="metrics.jsonl", tail=""):
    """A run folder as opefo-train leaves it with save_strategy: "no": metrics lines, no trainer_state.json."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    return path


def test_a_run_without_trainer_state_is_drawn_from_its_metrics_jsonl(tmp_path, capsys):
    rows = _rows(5, entropy0=2.0)
    # A run killed mid-write leaves a partial last line: left out, as opefo-eval's store does.
    _write_metrics(tmp_path / "opefo", rows, tail='{"step": 6, "entro')
    _write_metrics(tmp_path / "par", _rows(3, entropy0=1.0), name="metrics.rank0.jsonl")  # every_process
    out = tmp_path / "curves.png"
    assert plot_main([str(tmp_path / "opefo"), str(tmp_path / "par"), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"opefo: {tmp_path / 'opefo' / 'metrics.jsonl'}" in printed and _png_size(out)[0] > 0
    run = load_run(tmp_path / "opefo")
    assert run.series("entropy")[0].tolist() == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(run.series("entropy")[1], [row["entropy"] for row in rows[:5]])
    assert load_run(tmp_path / "par").series("entropy")[0].tolist() == [1, 2, 3]


def test_metrics_jsonl_is_preferred_to_a_checkpoint_and_trainer_state_to_both(tmp_path):
    """A checkpoint's state stops at its step; metrics.jsonl has every logged step; a saved state is the run's."""
    _write_state(tmp_path / "run" / "checkpoint-2", _rows(2, 2.0))
    _write_metrics(tmp_path / "run", _rows(4, 2.0))
    assert find_state_file(tmp_path / "run") == str(tmp_path / "run" / "metrics.jsonl")
    assert load_run(tmp_path / "run").series("entropy")[0].tolist() == [1, 2, 3, 4]
    _write_state(tmp_path / "run", _rows(4, 2.0))
    assert find_state_file(tmp_path / "run") == str(tmp_path / "run" / "trainer_state.json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl', line 1, is not valid JSON"):
        load_run(tmp_path / "bad")
