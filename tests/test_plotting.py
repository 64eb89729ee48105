"""Plotting training curves from hand-written trainer_state.json files (the opefo-plot CLI: tests/cli/test_plot.py)."""

import json
import math

import numpy as np
import pytest
from conftest import png_size, trainer_state_rows, write_trainer_state

from opefo_trl.cli.plot import main as plot_main
from opefo_trl.cli.plot import seed_group
from opefo_trl.plotting import DEFAULT_PANELS, Panel, RunNotFoundError, find_state_file, load_run, load_runs, plot_runs


def test_series_reads_only_logged_training_steps(tmp_path):
    path = write_trainer_state(tmp_path / "opefo", trainer_state_rows(4, entropy0=2.0))
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
    write_trainer_state(tmp_path / "runA" / "checkpoint-5", trainer_state_rows(5, 1.0))
    latest = write_trainer_state(tmp_path / "runA" / "checkpoint-20", trainer_state_rows(20, 1.0))
    write_trainer_state(tmp_path / "runA" / "checkpoint-10", trainer_state_rows(10, 1.0))
    # a run dir without its own state file resolves to its latest checkpoint (by step, not by name)
    assert find_state_file(tmp_path / "runA") == str(latest)
    assert load_run(tmp_path / "runA" / "checkpoint-10").label == "runA"
    assert load_run(latest).label == "runA"
    # a run dir with its own trainer_state.json prefers it
    own = write_trainer_state(tmp_path / "runA", trainer_state_rows(3, 1.0))
    assert find_state_file(tmp_path / "runA") == str(own)


def test_repeated_labels_are_made_unique(tmp_path):
    a = write_trainer_state(tmp_path / "exp1" / "opefo", trainer_state_rows(3, 1.0))
    b = write_trainer_state(tmp_path / "exp2" / "opefo", trainer_state_rows(3, 1.0))
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
    runs = load_runs(
        [
            write_trainer_state(tmp_path / "grpo", trainer_state_rows(6, 2.0)),
            write_trainer_state(tmp_path / "opefo", trainer_state_rows(6, 3.0)),
        ]
    )
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
    width, height = png_size(out)
    assert width > 600 and height > 400  # a 2 x 2 grid of panels


def test_metrics_missing_from_every_run_are_skipped_and_reported(tmp_path):
    # plain TRL GRPO runs log no entropy_flow/* keys
    runs = load_runs([write_trainer_state(tmp_path / "grpo", trainer_state_rows(5, 2.0, flows=False))])
    out = tmp_path / "grpo.png"
    result = plot_runs(runs, out)
    assert result.plotted == ["entropy", "reward"]
    assert result.missing == ["entropy_flow/lambda", "entropy_flow/increase", "entropy_flow/decrease"]
    _, height_two_panels = png_size(out)
    # a metric logged by only one of the runs is still drawn
    both = load_runs([tmp_path / "grpo", write_trainer_state(tmp_path / "opefo", trainer_state_rows(5, 2.0))])
    result = plot_runs(both, tmp_path / "both.png")
    assert result.missing == [] and "entropy_flow/lambda" in result.plotted
    _, height_four_panels = png_size(tmp_path / "both.png")
    assert height_four_panels > height_two_panels


def test_measured_entropy_change_is_drawn_when_audited(tmp_path):
    # entropy_flow_audit_steps logs the measured change (every run) and, for `param`, the predicted one
    audited = trainer_state_rows(6, 2.0)
    for row in audited[:-1]:
        row["entropy_flow/measured_delta"] = -0.01 * row["step"]
        row["entropy_flow/predicted_delta"] = -0.009 * row["step"]
    plain = load_runs([write_trainer_state(tmp_path / "plain", trainer_state_rows(6, 2.0))])
    without = plot_runs(plain, tmp_path / "plain.png")
    assert without.missing == [], "an optional panel nobody logged is not reported missing"
    assert "entropy_flow/measured_delta" not in without.plotted
    with_audit = plot_runs(load_runs([write_trainer_state(tmp_path / "audited", audited)]), tmp_path / "audited.png")
    assert {"entropy_flow/measured_delta", "entropy_flow/predicted_delta"} <= set(with_audit.plotted)
    assert png_size(tmp_path / "audited.png")[1] > png_size(tmp_path / "plain.png")[1]  # a third row of panels


def test_plot_refuses_runs_without_any_known_metric(tmp_path):
    runs = load_runs([write_trainer_state(tmp_path / "x", [{"step": 1, "loss": 0.3}])])
    with pytest.raises(ValueError, match="None of the metrics"):
        plot_runs(runs, tmp_path / "x.png")
    with pytest.raises(ValueError, match="smoothing"):
        plot_runs(runs, tmp_path / "x.png", smoothing=1.0)


def test_grouped_runs_are_averaged(tmp_path):
    import opefo_trl.plotting as plotting

    runs = load_runs(
        [write_trainer_state(tmp_path / f"opefo-seed{i}", trainer_state_rows(4, entropy0=1.0 + i)) for i in range(3)]
    )
    stats = plotting._group_series(runs, "entropy", smoothing=0.0)
    steps, mean, std, n = stats
    assert n == 3 and steps.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(mean, [2.0 / s for s in (1, 2, 3, 4)])
    np.testing.assert_allclose(std, [np.std([1.0, 2.0, 3.0]) / s for s in (1, 2, 3, 4)])
    groups = {r.label: seed_group(r.label) for r in runs}
    assert set(groups.values()) == {"opefo"}
    result = plot_runs(runs, tmp_path / "g.png", groups=groups, smoothing=0.5)
    assert png_size(tmp_path / "g.png")[0] > 0 and result.missing == []


def test_pass_at_k_panel_is_added_and_checked(tmp_path):
    runs = load_runs([write_trainer_state(tmp_path / f"grpo-seed{i}", trainer_state_rows(4, 2.0)) for i in range(2)])
    groups = {r.label: "grpo" for r in runs}
    plain = plot_runs(runs, tmp_path / "plain.png", groups=groups)
    curves = {"warm start": [{1: 0.1, 4: 0.3, 16: 0.6}], "grpo": [{1: 0.2, 4: 0.4, 16: 0.5}, {1: 0.3, 4: 0.5, 16: 0.7}]}
    with_panel = plot_runs(runs, tmp_path / "pass.png", groups=groups, pass_at_k=curves)
    assert "pass@k" in with_panel.plotted and "pass@k" not in plain.plotted
    # four panels fill a 2 x 2 grid: the pass@k panel opens a third row
    assert png_size(tmp_path / "pass.png")[1] > png_size(tmp_path / "plain.png")[1]
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
    rows = trainer_state_rows(5, entropy0=2.0)
    # A run killed mid-write leaves a partial last line: left out, as opefo-eval's store does.
    _write_metrics(tmp_path / "opefo", rows, tail='{"step": 6, "entro')
    _write_metrics(tmp_path / "par", trainer_state_rows(3, entropy0=1.0), name="metrics.rank0.jsonl")  # every_process
    out = tmp_path / "curves.png"
    assert plot_main([str(tmp_path / "opefo"), str(tmp_path / "par"), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"opefo: {tmp_path / 'opefo' / 'metrics.jsonl'}" in printed and png_size(out)[0] > 0
    run = load_run(tmp_path / "opefo")
    assert run.series("entropy")[0].tolist() == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(run.series("entropy")[1], [row["entropy"] for row in rows[:5]])
    assert load_run(tmp_path / "par").series("entropy")[0].tolist() == [1, 2, 3]


def test_metrics_jsonl_is_preferred_to_a_checkpoint_and_trainer_state_to_both(tmp_path):
    """A checkpoint's state stops at its step; metrics.jsonl has every logged step; a saved state is the run's."""
    write_trainer_state(tmp_path / "run" / "checkpoint-2", trainer_state_rows(2, 2.0))
    _write_metrics(tmp_path / "run", trainer_state_rows(4, 2.0))
    assert find_state_file(tmp_path / "run") == str(tmp_path / "run" / "metrics.jsonl")
    assert load_run(tmp_path / "run").series("entropy")[0].tolist() == [1, 2, 3, 4]
    write_trainer_state(tmp_path / "run", trainer_state_rows(4, 2.0))
    assert find_state_file(tmp_path / "run") == str(tmp_path / "run" / "trainer_state.json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 1, is not a metrics record: '{\"step\": 1'"):
        load_run(tmp_path / "bad")


def _drawn_figure(monkeypatch):
    """Keep the Figure `plot_runs` saves, to measure what it drew."""
    from matplotlib.figure import Figure

    saved = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), original(fig, *a, **k))[1])
    return saved


def test_the_title_overlaps_no_panel_title(tmp_path, monkeypatch):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    saved = _drawn_figure(monkeypatch)
    runs = load_runs([write_trainer_state(tmp_path / name, trainer_state_rows(6, 2.0)) for name in ("grpo", "opefo")])
    title = "digit_sum task, tiny Qwen2, 16 seed(s), numerics threads1 and mkl_compatible (EMA-smoothed 0.6)"
    more = tuple(Panel(f"Panel {i}", "value", ("reward",)) for i in range(4))  # 9 panels in 5 rows, as the demo
    pass_at_k = {"grpo": [{1: 0.1, 4: 0.3}]}
    plot_runs(runs, tmp_path / "curves.png", title=title, pass_at_k=pass_at_k, panels=(*DEFAULT_PANELS, *more))
    (fig,) = saved
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    title_box = fig.get_suptitle() and fig._suptitle.get_window_extent(renderer)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 9 and title_box
    for ax in panels:
        top = max(ax.title.get_window_extent(renderer).y1, ax.get_window_extent(renderer).y1)
        assert title_box.y0 > top, f"the figure title overlaps the panel {ax.get_title()!r}"
    assert fig.bbox.y1 >= title_box.y1  # and is inside the figure


def test_flows_of_different_estimates_share_one_axis_relative_to_their_first_step(tmp_path, monkeypatch):
    saved = _drawn_figure(monkeypatch)
    tabular = trainer_state_rows(6, 2.0)
    param = [
        {k: v * 1e4 if k.startswith("entropy_flow/") and "lambda" not in k else v for k, v in row.items()}
        for row in tabular
    ]  # the `param` flow's units: the same shape, 1e4 times the size
    runs = load_runs([write_trainer_state(tmp_path / "opefo", tabular), write_trainer_state(tmp_path / "param", param)])
    plot_runs(runs, tmp_path / "curves.png")
    (fig,) = saved
    flow_ax = next(ax for ax in fig.axes if ax.get_title().startswith("Entropy flow"))
    lines = {(line.get_color(), line.get_linestyle()): line.get_ydata() for line in flow_ax.get_lines()}
    assert len(lines) == 4  # increase and decrease of both runs
    increase = [y for (_, style), y in lines.items() if style == "-"]
    # Each run's P_t / (P_1 + N_1), with P_t = 1 + t, N_t = 2 + t: the same line for both estimates.
    expected = np.array([(1.0 + t) / 5.0 for t in range(1, 7)])
    for y in increase:
        np.testing.assert_allclose(y, expected, rtol=1e-12)  # one float64 division apart: ~1e-16
    low, high = flow_ax.get_ylim()
    assert high / low < 10  # not the 1e4 a shared absolute axis would span


def test_runs_with_fewer_than_two_logged_steps_are_drawn_as_points_and_reported(tmp_path, monkeypatch):
    """A single logged step is a lone point, which a line leaves invisible: empty axes, no word why (issue 53)."""
    saved = _drawn_figure(monkeypatch)
    write_trainer_state(tmp_path / "a", trainer_state_rows(1, 2.0))
    write_trainer_state(tmp_path / "b", [{"step": 1, "loss": 0.0}])  # logged, but none of the drawn metrics
    write_trainer_state(tmp_path / "c", trainer_state_rows(3, 2.0))
    runs = load_runs([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert plot_runs(runs, tmp_path / "x.png").too_short == ["'a' (1 logged step: step 1)", "'b' (0 logged steps)"]
    (fig,) = saved
    reward_ax = next(ax for ax in fig.axes if ax.get_title() == "Reward")
    markers = {line.get_label(): (line.get_marker(), len(line.get_xdata())) for line in reward_ax.get_lines()}
    assert markers == {"a": ("o", 1), "c": ("None", 3)}
    assert "Too few logged steps for a curve (drawn as points): 'a' (1 logged step: step 1)" in fig.texts[0].get_text()
