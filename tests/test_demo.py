"""The CPU demo: end to end on a tiny budget (real OPEFOTrainer runs), plus its summary maths and argument checks."""

import json
import math

import pytest

from opefo_trl import demo
from opefo_trl.demo import (
    METHOD_NAMES,
    REQUIRED_METRICS,
    TASKS,
    DemoMethod,
    DemoSettings,
    RunResult,
    SampleStats,
    main,
    summarize_history,
    summary_markdown,
    train_one,
    warm_start,
)
from opefo_trl.methods import OPEFO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The smallest budget that still runs every stage of the real code path and learns something: a tiny model warm-started
# until it writes digits (so rewards, advantages and flows are not all zero), 2 RL steps per run at the full learning
# rate (`--quick true` halves the warm start and keeps at least 2 RL steps).
TINY = dict(
    hidden_size=32,
    num_layers=1,
    warm_start_steps=120,
    warm_start_batch_size=16,
    warmup_steps=0,
    steps=2,
    prompts_per_step=2,
    num_generations=4,
    eval_samples_per_prompt=2,
)
TINY_FLAGS = [token for name, value in TINY.items() for token in (f"--{name}", str(value))]


def test_quick_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["--quick", "true", "--output_dir", str(out), *TINY_FLAGS]) == 0
    printed = capsys.readouterr().out
    default_methods = DemoSettings().methods
    assert default_methods == ["grpo", "opefo", "opefo_param", "entropy_reg"]
    for name in default_methods:
        assert f"{name} seed 0 done" in printed  # per-run progress line
    assert str(out / "curves.png") in printed and str(out / "summary.md") in printed

    assert (out / "curves.png").read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["method"], r["seed"]) for r in summary["runs"]] == [(name, 0) for name in default_methods]
    assert summary["settings"]["task"] == "digit_sum" and summary["settings"]["seeds"] == [0]
    assert summary["settings"]["quick"] and summary["settings"]["warm_start_steps"] == 120  # explicit values kept
    grpo_first = json.loads((out / "runs" / "grpo-seed0" / "trainer_state.json").read_text())["log_history"][0]
    for run in summary["runs"]:
        name = run["method"]
        state = json.loads((out / "runs" / f"{name}-seed0" / "trainer_state.json").read_text())
        rows = [row for row in state["log_history"] if "entropy" in row]
        assert len(rows) == 2, f"{name}: logging_steps=1 should log every one of the 2 steps"
        for row in rows:
            for key in REQUIRED_METRICS:
                assert key in row and math.isfinite(row[key]), f"{name} did not log {key}"
            assert row["entropy"] > 0 and 0.0 <= row["reward"] <= 1.0
            assert -1.0 <= row["entropy_flow/lambda"] <= 1.0
        # the regime figures of summary.json come from the logged rows
        lambdas = [row["entropy_flow/lambda"] for row in rows]
        assert run["lambda_abs_mean"] == pytest.approx(sum(abs(x) for x in lambdas) / len(lambdas))
        assert run["measured_delta_mean"] == pytest.approx(
            sum(row["entropy_flow/measured_delta"] for row in rows) / len(rows)
        )
        assert 0.0 < run["net_over_gross_mean"] <= 1.0 and run["measured_delta_mean"] != 0.0
        # only the `param` estimate carries a scale, hence a prediction of the entropy change
        assert (run["predicted_delta_mean"] is not None) == (name == "opefo_param")
        if name == "opefo_param":
            assert run["predicted_delta_mean"] != 0.0
        # identical seeds and start weights: every method sees the same first rollout batch
        assert rows[0]["reward"] == grpo_first["reward"]
        assert rows[0]["entropy"] == pytest.approx(grpo_first["entropy"], rel=1e-5)
    entropy_reg = json.loads((out / "runs" / "entropy_reg-seed0" / "trainer_state.json").read_text())
    assert [row for row in entropy_reg["log_history"] if "entropy_coef" in row], "entropy_reg uses TRL's bonus"

    table = (out / "summary.md").read_text()
    for name in (*default_methods, "warm start (before RL)"):
        assert f"| {name}" in table
    assert "Regime guard" in table


def test_warm_start_is_cached_per_task_and_settings(tmp_path):
    settings = DemoSettings(**{**TINY, "warm_start_steps": 4})
    messages = []
    path = warm_start(str(tmp_path), settings, log=messages.append)
    assert path.endswith("warm_start-digit_sum")
    marker = json.loads((tmp_path / "models" / "warm_start-digit_sum" / demo.WARM_START_MARKER).read_text())
    assert marker["settings"]["warm_start_steps"] == 4 and math.isfinite(marker["final_loss"])
    assert not any("reusing" in m for m in messages)
    messages.clear()
    assert warm_start(str(tmp_path), settings, log=messages.append) == path
    assert messages == [f"warm start: reusing {path}"]
    # a different warm-start setting retrains instead of reusing stale weights
    messages.clear()
    warm_start(str(tmp_path), DemoSettings(**{**TINY, "warm_start_steps": 3}), log=messages.append)
    assert not any("reusing" in m for m in messages)
    # another task has its own warm start
    other = warm_start(
        str(tmp_path), DemoSettings(**{**TINY, "warm_start_steps": 4, "task": "sum"}), log=messages.append
    )
    assert other.endswith("warm_start-sum") and other != path


def test_regime_guard_is_recorded_per_run(tmp_path, monkeypatch):
    # A threshold every lambda* exceeds and a 2-step window: the guard must fire, and the run must record its text.
    monkeypatch.setattr(OPEFO, "REGIME_WINDOW", 2)
    settings = DemoSettings(**{**TINY, "eval_samples_per_prompt": 0})
    model_path = warm_start(str(tmp_path), settings, log=lambda _: None)
    method = DemoMethod("opefo", "OPEFO", {"method": "opefo", "opefo_lambda_warn": 1e-9})
    messages = []
    result = train_one(method, 0, model_path, str(tmp_path / "run"), settings, log=messages.append)
    assert result.regime_warning is not None and "averaged over the last 2 optimizer steps" in result.regime_warning
    assert any("regime guard" in m for m in messages)
    assert result.accuracy is None  # eval_samples_per_prompt=0 skips sampling
    table = summary_markdown([result], settings, None)
    assert "fired for: opefo." in table


def _history(entropies, rewards, lambdas, measured):
    rows = [
        {
            "step": i + 1,
            "entropy": h,
            "reward": r,
            "entropy_flow/lambda": lam,
            "entropy_flow/increase": 1.0,
            "entropy_flow/decrease": 1.0 + 2 * lam,
            "entropy_flow/net": -2 * lam,
            "entropy_flow/measured_delta": d,
        }
        for i, (h, r, lam, d) in enumerate(zip(entropies, rewards, lambdas, measured, strict=True))
    ]
    return rows + [{"step": len(rows), "train_runtime": 3.0}]


def test_summarize_history_numbers():
    entropies = [0.9, 0.8, 0.7, 0.2, 0.3, 0.4, 0.5, 0.6]
    rewards = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    lambdas = [0.5] * 4 + [-0.1] * 4
    stats = summarize_history(_history(entropies, rewards, lambdas, [-0.01] * 4 + [0.03] * 4))
    assert stats["entropy_start"] == 0.9
    assert stats["entropy_min"] == 0.2
    assert stats["entropy_final"] == pytest.approx(sum(entropies[-demo.FINAL_WINDOW :]) / demo.FINAL_WINDOW)
    assert stats["reward_final"] == pytest.approx(sum(rewards[-demo.FINAL_WINDOW :]) / demo.FINAL_WINDOW)
    assert stats["lambda_mean"] == pytest.approx(0.2)
    assert stats["lambda_abs_mean"] == pytest.approx(0.3)
    # |net| / gross = 2|lam| / (2 + 2 lam): 1/3 for 0.5, 0.2/1.8 for -0.1
    assert stats["net_over_gross_mean"] == pytest.approx((1 / 3 + 0.2 / 1.8) / 2)
    assert stats["measured_delta_mean"] == pytest.approx(0.01)
    assert stats["predicted_delta_mean"] is None


def test_summarize_history_refuses_runs_without_flow_metrics():
    rows = [{"step": 1, "entropy": 0.5, "reward": 0.3, "entropy_flow/lambda": 0.1}]
    with pytest.raises(RuntimeError, match="entropy_flow/measured_delta"):
        summarize_history(rows)


def _result(method, seed, entropy_final, measured=-1e-3, seconds=10.0):
    return RunResult(
        method=method,
        seed=seed,
        run_dir=f"runs/{method}-seed{seed}",
        steps=8,
        seconds=seconds,
        entropy_start=0.9,
        entropy_final=entropy_final,
        entropy_min=entropy_final,
        reward_start=0.5,
        reward_final=0.75,
        lambda_mean=0.25,
        lambda_abs_mean=0.25,
        net_over_gross_mean=0.2,
        measured_delta_mean=measured,
        accuracy=0.5,
        distinct_correct_per_prompt=3.0,
    )


def test_summary_table_reports_mean_and_std_over_seeds():
    results = [_result("grpo", 0, 0.2, -1e-3), _result("grpo", 1, 0.4, -3e-3), _result("opefo", 0, 0.8)]
    table = summary_markdown(results, DemoSettings(seeds=[0, 1]), SampleStats(0.25, 4.5, 16))
    grpo_row = next(line for line in table.splitlines() if line.startswith("| grpo"))
    opefo_row = next(line for line in table.splitlines() if line.startswith("| opefo"))
    assert "0.300 ± 0.141" in grpo_row  # mean and sample std of 0.2 and 0.4
    assert "-2.00e-03 ± 1.41e-03" in grpo_row  # measured entropy change per step
    assert "0.800" in opefo_row and "±" not in opefo_row.split("|")[2]  # one seed: no spread
    assert "| warm start (before RL) |" in table and "0.250" in table and "4.50" in table
    assert "fired for: no run" in table


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(methods=["grpo", "nope"]), "Unknown method"),
        (dict(methods=[]), "No methods"),
        (dict(seeds=[0, 0]), "duplicates"),
        (dict(steps=0), "steps must be >= 1"),
        (dict(num_generations=1), "num_generations must be >= 2"),
        (dict(task="product"), "Unknown task"),
        (dict(prompts_per_step=10_000), "exceeds"),
    ],
)
def test_settings_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        DemoSettings(**overrides)


def test_bad_arguments_fail_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["--output_dir", str(out), "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
    assert main(["--output_dir", str(out), "--methods", "sft"]) == 2
    assert "Unknown method" in capsys.readouterr().err
    assert main(["--output_dir", str(out), "--step", "3"]) == 2  # a misspelt flag gets a hint, not a traceback
    assert "did you mean 'steps'" in capsys.readouterr().err
    assert not out.exists()


def test_task_defaults_and_quick_budget():
    default, summed = DemoSettings(), DemoSettings(task="sum")
    assert default.task == "digit_sum" and default.seeds == [0, 1, 2]
    for settings in (default, summed):
        for name, value in TASKS[settings.task].defaults.items():
            assert getattr(settings, name) == value
    assert DemoSettings(steps=7).steps == 7  # an explicit value wins over the task's
    quick = DemoSettings(quick=True)
    assert quick.seeds == [0] and quick.methods == default.methods
    assert quick.steps == default.steps // 3 and quick.warm_start_steps == default.warm_start_steps // 2
    # with --quick, values given explicitly are kept
    explicit = DemoSettings(quick=True, seeds=[0, 1, 2], steps=30, warm_start_steps=50)
    assert (explicit.seeds, explicit.steps, explicit.warm_start_steps) == ([0, 1, 2], 30, 50)
    assert set(METHOD_NAMES) >= {"grpo", "opefo", "opefo_param", "entropy_reg", "opefo_full", "clip_cov", "par"}
    assert "opefo_param_step" in METHOD_NAMES
