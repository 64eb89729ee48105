"""One demo run: the figures summarize_history takes from a log, and the regime guard recorded per run."""

import math

import pytest

from opefo_trl.demo import DemoMethod, summarize_history, train_one, warm_start
from opefo_trl.demo.training import FINAL_WINDOW
from opefo_trl.methods.opefo_regime import RegimeWatch

pytestmark = pytest.mark.slow


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
    assert stats["entropy_final"] == pytest.approx(sum(entropies[-FINAL_WINDOW:]) / FINAL_WINDOW)
    assert stats["reward_final"] == pytest.approx(sum(rewards[-FINAL_WINDOW:]) / FINAL_WINDOW)
    assert stats["lambda_mean"] == pytest.approx(0.2)
    assert stats["lambda_abs_mean"] == pytest.approx(0.3)
    # |net| / gross = 2|lam| / (2 + 2 lam): 1/3 for 0.5, 0.2/1.8 for -0.1
    assert stats["net_over_gross_mean"] == pytest.approx((1 / 3 + 0.2 / 1.8) / 2)
    assert stats["measured_delta_mean"] == pytest.approx(0.01)  # signed: -0.01 and +0.03 partly cancel
    assert stats["measured_abs_delta_mean"] == pytest.approx(0.02)
    assert stats["predicted_delta_mean"] is None and stats["step_first_order_mean"] is None


def test_a_run_that_diverged_to_nan_reads_nan():
    history = _history([0.9, 0.8, float("nan")], [0.5, 0.0, float("nan")], [0.1] * 3, [0.0] * 3)
    stats = summarize_history(history)
    assert math.isnan(stats["entropy_final"]) and math.isnan(stats["reward_final"])
    assert stats["entropy_min"] == 0.8  # from the finite values


def test_summarize_history_refuses_runs_without_flow_metrics():
    rows = [{"step": 1, "entropy": 0.5, "reward": 0.3, "entropy_flow/lambda": 0.1}]
    with pytest.raises(RuntimeError, match="entropy_flow/measured_delta"):
        summarize_history(rows)


def test_regime_guard_is_recorded_per_run(tmp_path, monkeypatch, tiny_settings):
    # A threshold every lambda* exceeds and a 2-step window: the guard must fire, and the run must record its text.
    monkeypatch.setattr(RegimeWatch, "WINDOW", 2)
    settings = tiny_settings(pass_at_k_samples=0)
    model_path = warm_start(str(tmp_path), settings, "threads1", log=lambda _: None)
    method = DemoMethod("opefo", "OPEFO", {"method": "opefo", "opefo_lambda_warn": 1e-9})
    messages = []
    result = train_one(method, 0, "threads1", model_path, str(tmp_path / "run"), settings, log=messages.append)
    assert result.regime_warning is not None and "averaged over the last 2 optimizer steps" in result.regime_warning
    assert any("regime guard" in m for m in messages)
    assert result.held_out is None  # pass_at_k_samples=0 skips the evaluation
    assert result.numerics == "threads1" and result.flow_estimate == "opefo" and len(result.log_fingerprint) == 64
