"""`opefo-train` with a shipped recipe overridden to the real model, then `opefo-eval` on the model it saved: both as
a user runs them (separate processes), with their exit status, the files they write and the scores' shape."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import flat_recipe_text

pytestmark = pytest.mark.real_model

REPO = Path(__file__).parents[2]
#: The shipped recipe trained here: everything as written except the model, data, vLLM, precision and size keys.
RECIPE = REPO / "recipes" / "qwen2.5-math-7b" / "opefo.yaml"
MAX_COMPLETION, PER_DEVICE, ACCUMULATION, GENERATIONS = 12, 2, 2, 2
SAMPLES, PROBLEMS = 2, 2

#: A second reward beside the recipe's math reward, by dotted path (written into the run's working directory): the
#: base model rarely answers a sum right in 12 tokens, and a step whose rewards are all equal has no gradient.
LENGTH_REWARD = """
def characters_reward(completions, **kwargs):
    return [len(c[0]["content"]) / 10 for c in completions]
"""


def run(module, *argv, cwd):
    """``python -m module argv`` in a fresh process importing this checkout, offline; its exit status and output."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, *map(str, argv)], cwd=cwd, env=env, capture_output=True, text=True
    )
    return done.returncode, done.stdout + done.stderr


def max_weight_change(trained, base):
    """Largest |trained - base| over the tensors of two safetensors folders (the same names)."""
    from safetensors import safe_open

    with safe_open(trained / "model.safetensors", "pt") as new, safe_open(base / "model.safetensors", "pt") as old:
        assert set(new.keys()) == set(old.keys())
        return max((new.get_tensor(k) - old.get_tensor(k)).abs().max().item() for k in new.keys())


def test_opefo_train_with_a_shipped_recipe_then_opefo_eval_on_what_it_saved(
    real_model_path, problems_file, bench_file, tmp_path
):
    import yaml

    recipe = yaml.safe_load(flat_recipe_text(RECIPE))  # the recipe merged onto its base.yaml
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    trained = tmp_path / "run"
    status, output = run(
        "opefo_trl.cli.train",
        "--config", RECIPE, "--model_name_or_path", real_model_path, "--dataset_files", problems_file,
        "--reward_funcs", recipe["reward_funcs"][0], "length_reward.characters_reward", "--output_dir", trained,
        "--use_vllm", "false", "--bf16", "false", "--use_cpu", "true", "--num_generations", GENERATIONS,
        "--per_device_train_batch_size", PER_DEVICE, "--gradient_accumulation_steps", ACCUMULATION,
        "--max_completion_length", MAX_COMPLETION, "--max_steps", 2, "--report_to", "none",
        cwd=tmp_path,
    )  # fmt: skip
    assert status == 0, output[-3000:]
    assert {"model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl"} <= set(os.listdir(trained))
    with open(trained / "metrics.jsonl") as f:
        steps = [m for m in map(json.loads, f) if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert math.isfinite(m["loss"]) and m["learning_rate"] == pytest.approx(recipe["learning_rate"])
        assert -1 <= m["entropy_flow/lambda"] <= 1
        assert 0 <= m["rewards/math_accuracy_reward/mean"] <= 1
        # The recipe's OPEFO applies lambda*: the reweighted flow is zero (float32 rounding of the flow sums).
        flows = m["entropy_flow/increase"] + m["entropy_flow/decrease"]
        assert abs(m["opefo/weighted_net"]) <= 1e-5 * flows
    # The saved model is the trained one: AdamW moved the float32 weights (the recipe's dtype) by about the
    # learning rate per step.
    moved = max_weight_change(trained, Path(real_model_path))
    assert 0.5 * recipe["learning_rate"] < moved < 3 * recipe["learning_rate"], moved

    scores = tmp_path / "eval"
    status, output = run(
        "opefo_trl.cli.evaluate",
        "--model_name_or_path", trained, "--benchmarks", bench_file, "--num_samples", SAMPLES,
        "--max_problems", PROBLEMS, "--max_new_tokens", MAX_COMPLETION, "--backend", "transformers", "--dtype",
        "float32", "--no_progress", "--output_dir", scores,
        cwd=tmp_path,
    )  # fmt: skip
    assert status == 0, output[-3000:]
    assert {"samples.jsonl", "run_config.json", "results.json", "results.md"} <= set(os.listdir(scores))
    with open(scores / "samples.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert sorted((r["problem_id"], r["sample_index"]) for r in records) == [
        (p, i) for p in range(PROBLEMS) for i in range(SAMPLES)
    ]
    assert all(1 <= r["num_tokens"] <= MAX_COMPLETION for r in records)
    results = json.loads((scores / "results.json").read_text())
    (benchmark,) = results["benchmarks"]
    metrics, rows = results["benchmarks"][benchmark]["metrics"], results["benchmarks"][benchmark]["problems"]
    assert len(rows) == PROBLEMS and all(row["n"] == SAMPLES and len(row["scores"]) == SAMPLES for row in rows)
    assert all(score in (0, 1) for row in rows for score in row["scores"])
    assert metrics["n"] == SAMPLES and {"avg@n", "maj@n", "pass@1", "pass@2"} <= set(metrics)
    assert metrics["avg@n"] == pytest.approx(sum(sum(row["scores"]) for row in rows) / (PROBLEMS * SAMPLES))
    assert all(0 <= metrics[name] <= 1 for name in ("avg@n", "maj@n", "pass@1", "pass@2"))
    assert f"| {benchmark} | {PROBLEMS} | {SAMPLES} |" in output
    print(
        f"opefo-train: lambda* {[m['entropy_flow/lambda'] for m in steps]}, math reward "
        f"{[m['rewards/math_accuracy_reward/mean'] for m in steps]}, max |delta weight| {moved:.3g}; opefo-eval: "
        f"{metrics}"
    )
