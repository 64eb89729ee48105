"""`python -m opefo_trl.demo` end to end on a tiny budget (real OPEFOTrainer runs, both thread settings), and its
argument checks."""

import json
import math

import pytest

from opefo_trl.demo import REQUIRED_METRICS, TASKS, DemoSettings, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_demo_end_to_end_in_two_thread_settings(tmp_path, capsys, tiny_flags):
    out = tmp_path / "demo"
    assert main(["--quick", "true", "--output_dir", str(out), "--threads", "1", "2", *tiny_flags]) == 0
    printed = capsys.readouterr().out
    methods = ["grpo", "opefo", "opefo_param_step", "entropy_reg"]
    assert DemoSettings().methods == methods
    for name in methods:
        assert f"{name} seed 0 done" in printed  # per-run progress line
    assert str(out / "curves.png") in printed and str(out / "summary.md") in printed
    for figure in ("curves.png", "curves-threads1.png", "curves-threads2.png"):
        assert (out / figure).read_bytes()[:8] == PNG_MAGIC
    assert (out / "models" / "warm_start-digit_sum-threads1").is_dir()
    assert (out / "models" / "warm_start-digit_sum-threads2").is_dir()

    summary = json.loads((out / "summary.json").read_text())
    assert [(r["method"], r["seed"], r["threads"]) for r in summary["runs"]] == [
        (name, 0, threads) for threads in (1, 2) for name in methods
    ]
    assert summary["settings"]["task"] == "digit_sum" and summary["settings"]["seeds"] == [0]
    assert summary["settings"]["quick"] and summary["settings"]["warm_start_steps"] == 120  # explicit values kept
    assert summary["settings"]["entropy_coef"] == 1e-3
    assert summary["held_out_targets"] == TASKS["digit_sum"].held_out_targets
    for threads in ("1", "2"):
        warm = summary["warm_start"][threads]
        assert warm["targets"] == TASKS["digit_sum"].held_out_targets and warm["samples_per_target"] == 4
        assert set(warm["pass_at_k"]) == {"pass@1", "pass@4"}
        assert set(summary["summary"][threads]) == set(methods)
    grpo_dir = out / "runs" / "threads1" / "grpo-seed0"
    grpo_first = json.loads((grpo_dir / "trainer_state.json").read_text())["log_history"][0]
    for run in summary["runs"]:
        name, threads = run["method"], run["threads"]
        state = json.loads((out / "runs" / f"threads{threads}" / f"{name}-seed0" / "trainer_state.json").read_text())
        rows = [row for row in state["log_history"] if "entropy" in row]
        assert len(rows) == 2, f"{name}: logging_steps=1 should log every one of the 2 steps"
        for row in rows:
            for key in REQUIRED_METRICS:
                assert key in row and math.isfinite(row[key]), f"{name} did not log {key}"
            assert row["entropy"] > 0 and 0.0 <= row["reward"] <= 1.0
            assert -1.0 <= row["entropy_flow/lambda"] <= 1.0
        # the figures of summary.json come from the logged rows
        lambdas = [row["entropy_flow/lambda"] for row in rows]
        measured = [row["entropy_flow/measured_delta"] for row in rows]
        assert run["lambda_abs_mean"] == pytest.approx(sum(abs(x) for x in lambdas) / len(lambdas))
        assert run["measured_delta_mean"] == pytest.approx(sum(measured) / len(rows))
        assert run["measured_abs_delta_mean"] == pytest.approx(sum(abs(x) for x in measured) / len(rows))
        assert 0.0 < run["net_over_gross_mean"] <= 1.0 and run["measured_abs_delta_mean"] > 0.0
        # which estimate the lambda* is; only the `param` estimate predicts the entropy change
        param = name == "opefo_param_step"
        assert run["flow_estimate"] == ("param" if param else "opefo")
        assert (run["predicted_delta_mean"] is not None) == param
        # the held-out evaluation: 4 samples for each held-out target, pass@k from the counts
        held_out = run["held_out"]
        assert held_out["samples_per_target"] == 4 and len(held_out["correct"]) == 6
        assert held_out["pass_at_k"]["pass@1"] == pytest.approx(sum(held_out["correct"]) / 24)
        assert held_out["pass_at_k"]["pass@4"] == pytest.approx(sum(c > 0 for c in held_out["correct"]) / 6)
        assert run["failure"] is None or "final" in run["failure"]
        if threads == 1:  # identical seeds and start weights: every method sees the same first rollout batch
            assert rows[0]["reward"] == grpo_first["reward"]
            assert rows[0]["entropy"] == pytest.approx(grpo_first["entropy"], rel=1e-5)
    entropy_reg = json.loads((out / "runs" / "threads1" / "entropy_reg-seed0" / "trainer_state.json").read_text())
    assert [row for row in entropy_reg["log_history"] if "entropy_coef" in row], "entropy_reg uses TRL's bonus"

    table = (out / "summary.md").read_text()
    assert "## torch threads = 1" in table and "## torch threads = 2" in table
    for name in (*methods, "warm start (before RL)"):
        assert f"| {name}" in table
    assert "(`param`)" in table and "(`opefo`)" in table  # the |lambda*| column names its estimate
    assert "Failed runs:" in table and "Regime guard" in table
    readings = {r["reading"]: r for r in summary["readings"]}
    assert any(text.startswith("1. regime") for text in readings)
    assert all(set(r["verdicts"]) == {"1", "2"} for r in readings.values())


def test_bad_arguments_fail_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["--output_dir", str(out), "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
    assert main(["--output_dir", str(out), "--methods", "sft"]) == 2
    assert "Unknown method" in capsys.readouterr().err
    assert main(["--output_dir", str(out), "--pass_at_k", "1", "128"]) == 2
    assert "pass@128 needs at least 128 samples" in capsys.readouterr().err
    assert main(["--output_dir", str(out), "--step", "3"]) == 2  # a misspelt flag gets a hint, not a traceback
    assert "did you mean 'steps'" in capsys.readouterr().err
    assert not out.exists()
