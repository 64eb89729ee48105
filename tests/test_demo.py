"""The CPU demo: end to end on a tiny budget (real OPEFOTrainer runs), plus its summary maths and argument checks."""

import json
import math

import pytest

from opefo_trl import demo
from opefo_trl.demo import (
    REQUIRED_METRICS,
    DemoSettings,
    RunResult,
    SampleStats,
    main,
    summarize_history,
    summary_markdown,
    warm_start,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The smallest budget that still runs every stage: tiny model, a few warm-start steps, 2 RL steps per run.
TINY = [
    "--warm-start-steps",
    "3",
    "--steps",
    "2",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--eval-samples",
    "2",
]


def _tiny_settings(**overrides):
    values = dict(hidden_size=32, num_layers=1, warm_start_steps=3, warm_start_batch_size=8)
    values.update(overrides)
    return DemoSettings(**values)


def test_quick_demo_end_to_end(tmp_path, monkeypatch, capsys):
    # A smaller model than the demo's, so that the test takes seconds; everything else is the real code path.
    monkeypatch.setattr(demo.DemoSettings, "quick", classmethod(lambda cls, **kw: _tiny_settings(seeds=[0], **kw)))
    out = tmp_path / "demo"
    assert main(["--quick", "--output-dir", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    for name in ("grpo", "opefo", "entropy_reg"):
        assert f"{name} seed 0 done" in printed  # per-run progress line
    assert str(out / "curves.png") in printed and str(out / "summary.md") in printed

    assert (out / "curves.png").read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["method"], r["seed"]) for r in summary["runs"]] == [("grpo", 0), ("opefo", 0), ("entropy_reg", 0)]
    for name in ("grpo", "opefo", "entropy_reg"):
        state = json.loads((out / "runs" / f"{name}-seed0" / "trainer_state.json").read_text())
        rows = [row for row in state["log_history"] if "entropy" in row]
        assert len(rows) == 2, f"{name}: logging_steps=1 should log every one of the 2 steps"
        for row in rows:
            for key in REQUIRED_METRICS + ("entropy_flow/increase_token_frac", "entropy_flow/decrease_token_frac"):
                assert key in row and math.isfinite(row[key]), f"{name} did not log {key}"
            assert row["entropy"] > 0 and 0.0 <= row["reward"] <= 1.0
            assert -1.0 <= row["entropy_flow/lambda"] <= 1.0
            assert row["entropy_flow/increase"] >= 0 and row["entropy_flow/decrease"] >= 0
        # identical seeds and start weights: every method sees the same first rollout batch
        if name != "grpo":
            grpo_first = json.loads((out / "runs" / "grpo-seed0" / "trainer_state.json").read_text())["log_history"][0]
            assert rows[0]["reward"] == grpo_first["reward"]
            assert rows[0]["entropy"] == pytest.approx(grpo_first["entropy"], rel=1e-5)
    assert [row for row in state["log_history"] if "entropy_coef" in row], "entropy_reg must use TRL's entropy bonus"

    table = (out / "summary.md").read_text()
    for name in ("grpo", "opefo", "entropy_reg", "warm start (before RL)"):
        assert f"| {name}" in table
    assert summary["settings"]["steps"] == 2 and summary["settings"]["seeds"] == [0]


def test_warm_start_is_cached_and_shared(tmp_path):
    settings = _tiny_settings()
    messages = []
    path = warm_start(str(tmp_path), settings, log=messages.append)
    marker = json.loads((tmp_path / "models" / "warm_start" / demo.WARM_START_MARKER).read_text())
    assert marker["settings"]["warm_start_steps"] == 3 and math.isfinite(marker["final_loss"])
    assert not any("reusing" in m for m in messages)
    messages.clear()
    assert warm_start(str(tmp_path), settings, log=messages.append) == path
    assert messages == [f"warm start: reusing {path}"]
    # a different warm-start setting retrains instead of reusing stale weights
    messages.clear()
    warm_start(str(tmp_path), _tiny_settings(warm_start_steps=4), log=messages.append)
    assert not any("reusing" in m for m in messages)


def _history(entropies, rewards, lambdas):
    rows = [
        {
            "step": i + 1,
            "entropy": h,
            "reward": r,
            "entropy_flow/lambda": lam,
            "entropy_flow/increase": 1.0,
            "entropy_flow/decrease": 1.0 + lam,
            "entropy_flow/net": -lam,
        }
        for i, (h, r, lam) in enumerate(zip(entropies, rewards, lambdas, strict=True))
    ]
    return rows + [{"step": len(rows), "train_runtime": 3.0}]


def test_summarize_history_numbers():
    entropies = [0.9, 0.8, 0.7, 0.2, 0.3, 0.4, 0.5, 0.6]
    rewards = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    stats = summarize_history(_history(entropies, rewards, [0.5] * 4 + [0.1] * 4))
    assert stats["entropy_start"] == 0.9
    assert stats["entropy_min"] == 0.2
    assert stats["entropy_final"] == pytest.approx(sum(entropies[-demo.FINAL_WINDOW :]) / demo.FINAL_WINDOW)
    assert stats["reward_final"] == pytest.approx(sum(rewards[-demo.FINAL_WINDOW :]) / demo.FINAL_WINDOW)
    assert stats["lambda_mean"] == pytest.approx(0.3)
    assert stats["net_flow_mean"] == pytest.approx(-0.3)


def test_summarize_history_refuses_runs_without_flow_metrics():
    rows = [{"step": 1, "entropy": 0.5, "reward": 0.3}]
    with pytest.raises(RuntimeError, match="entropy_flow/lambda"):
        summarize_history(rows)


def _result(method, seed, entropy_final, seconds=10.0):
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
        net_flow_mean=-1.0,
        accuracy=0.5,
        distinct_correct_per_prompt=3.0,
    )


def test_summary_table_reports_mean_and_std_over_seeds():
    results = [_result("grpo", 0, 0.2), _result("grpo", 1, 0.4), _result("opefo", 0, 0.8)]
    table = summary_markdown(results, DemoSettings(seeds=[0, 1]), SampleStats(0.25, 4.5, 16))
    grpo_row = next(line for line in table.splitlines() if line.startswith("| grpo"))
    opefo_row = next(line for line in table.splitlines() if line.startswith("| opefo"))
    assert "0.300 ± 0.141" in grpo_row  # mean and sample std of 0.2 and 0.4
    assert "0.800" in opefo_row and "±" not in opefo_row.split("|")[3]  # one seed: no spread
    assert "| warm start (before RL) |" in table and "0.250" in table and "4.50" in table


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(methods=["grpo", "nope"]), "Unknown method"),
        (dict(methods=[]), "No methods"),
        (dict(seeds=[0, 0]), "duplicates"),
        (dict(steps=0), "steps must be >= 1"),
        (dict(num_generations=1), "num_generations must be >= 2"),
        (dict(min_target=1), "min_target"),
        (dict(min_target=9, max_target=8), "max_target"),
    ],
)
def test_settings_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        DemoSettings(**overrides).validate()


def test_bad_arguments_fail_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["--output-dir", str(out), "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):
        main(["--output-dir", str(out), "--methods", "sft"])  # argparse rejects unknown methods
    assert not out.exists()


def test_quick_and_default_budgets():
    quick, default = DemoSettings.quick(), DemoSettings()
    assert quick.seeds == [0] and len(default.seeds) >= 3
    assert quick.steps < default.steps and quick.warm_start_steps <= default.warm_start_steps
    assert {"grpo", "opefo"} <= set(default.methods) and len(default.methods) >= 3
    assert DemoSettings.quick(steps=7).steps == 7
