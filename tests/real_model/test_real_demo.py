"""`make demo-real` on a tiny budget: `python -m opefo_trl.demo --task word_problems` end to end on the pretrained
SmolLM2-135M-Instruct (one seed, one RL step per method, 2 held-out samples per problem), checking that the report
holds the base model's and every trained policy's pass@k, the runs' flow figures and the registered readings a-d."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

REPO = Path(__file__).parents[2]


def test_demo_real_reports_pass_at_k_flows_and_the_registered_readings(real_model_path, tmp_path):
    out = tmp_path / "demo-real"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "opefo_trl.demo", "--task", "word_problems", "--methods", "grpo", "opefo",
         "--seeds", "0", "--steps", "1", "--pass_at_k_samples", "2", "--pass_at_k", "1", "2",
         "--output_dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["task"] == "word_problems"
    # The recipe's rollouts: 8 prompts x 4 completions of <= 40 tokens at temperature 0.7, lr 5e-6.
    settings = summary["settings"]
    assert (settings["prompts_per_step"], settings["num_generations"], settings["max_completion_length"]) == (8, 4, 40)
    assert (settings["temperature"], settings["learning_rate"]) == (0.7, 5e-6)
    held_out = summary["held_out_targets"]
    assert len(held_out) == 16 and held_out[:2] == [2, 7]
    base = summary["warm_start"]["threads1"]
    assert base["targets"] == held_out and base["samples_per_target"] == 2
    assert set(base["pass_at_k"]) == {"pass@1", "pass@2"} and 0 <= base["pass_at_k"]["pass@1"] <= 1
    runs = {r["method"]: r for r in summary["runs"]}
    assert set(runs) == {"grpo", "opefo"}
    for run in runs.values():
        assert run["steps"] == 1 and 0 <= run["reward_start"] <= 1 and math.isfinite(run["entropy_start"])
        assert set(run["held_out"]["pass_at_k"]) == {"pass@1", "pass@2"}
        assert run["increase_mean"] >= 0 and run["decrease_mean"] >= 0 and 0 <= run["lambda_abs_mean"] <= 1
    readings = {r["reading"][:2]: r for r in summary["readings"]}
    assert {"a.", "b.", "c.", "d."} <= set(readings) and "1." not in readings
    grpo = runs["grpo"]
    verdict = readings["a."]["verdicts"]["threads1"]
    assert verdict.startswith("yes" if grpo["lambda_abs_mean"] <= 0.05 else "no")
    verdict = readings["b."]["verdicts"]["threads1"]
    assert verdict.startswith("yes" if grpo["decrease_mean"] > grpo["increase_mean"] else "no")
    assert readings["d."]["verdicts"]["threads1"].startswith("too few runs")  # one seed each
    report = (out / "summary.md").read_text()
    assert "SmolLM2-135M-Instruct" in report and "| base model (before RL) |" in report
    assert (out / "curves.png").is_file()
