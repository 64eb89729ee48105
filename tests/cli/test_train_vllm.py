"""opefo-train on a recipe as written (vLLM colocate, `use_vllm: true`), on vLLM's CPU build (`make test-vllm`):
recipes/qwen2.5-math-7b/opefo.yaml overridden to a tiny model and a CPU, in one process and under
`accelerate launch --config_file recipes/accelerate/zero3.yaml` with two processes, each with its own engine."""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TESTS = os.path.join(REPO, "tests")
RECIPE = os.path.join(REPO, "recipes", "qwen2.5-math-7b", "opefo.yaml")
ZERO3 = os.path.join(REPO, "recipes", "accelerate", "zero3.yaml")

# The entry point each process runs: the tier's vLLM CPU workaround (tests/vllm_cpu_gemm.py), then opefo-train.
# DeepSpeed's CPU backend would first JIT-compile an inference-only shared-memory all-reduce (~1 min): skipped, as in
# tests/trainer/test_zero3.py.
LAUNCHER = """
import sys

import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

import vllm_cpu_gemm

vllm_cpu_gemm.install()

from opefo_trl.cli.train import main

sys.exit(main(sys.argv[1:]))
"""


def cpu_overrides(model_path, data_file, output_dir):
    """What a dry run of a GPU recipe on a CPU changes (recipes/README.md): the model, data and sizes, no bf16, no
    sleep mode (vLLM's CPU platform has none), a context the tiny model has."""
    return [
        "--config",
        RECIPE,
        "--model_name_or_path",
        model_path,
        "--dataset_files",
        data_file,
        "--output_dir",
        output_dir,
        "--bf16",
        "false",
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        "--vllm_enable_sleep_mode",
        "false",
        "--vllm_max_model_length",
        "256",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--max_completion_length",
        "8",
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
    ]


def run(command, tmp_path):
    (tmp_path / "launch_opefo_train.py").write_text(LAUNCHER)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "DS_BUILD_OPS": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([TESTS, REPO, os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-8000:]


def steps_logged(metrics_file):
    with open(metrics_file) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


def check_steps(steps, processes):
    """Two optimizer steps, each with a finite lambda* that every process logged alike (its sums are all-reduced)."""
    assert sorted({m["step"] for m in steps}) == [1, 2] and len(steps) == 2 * processes
    for step in (1, 2):
        lambdas = {m["entropy_flow/lambda"] for m in steps if m["step"] == step}
        assert len(lambdas) == 1 and math.isfinite(lambdas.pop())
    assert all(m["sampling/sampling_logp_difference/mean"] > 0 for m in steps)  # vLLM sampled


def test_recipe_trains_with_vllm_colocate(vllm_model_path, problems_file, tmp_path, vllm_cpu_gemm):
    out = tmp_path / "run"
    overrides = cpu_overrides(vllm_model_path, problems_file, out)
    run([sys.executable, str(tmp_path / "launch_opefo_train.py"), *overrides], tmp_path)
    check_steps(steps_logged(out / "metrics.jsonl"), processes=1)
    assert (out / "model.safetensors").is_file()


def test_recipe_trains_with_vllm_colocate_under_zero3(vllm_model_path, problems_file, tmp_path, vllm_cpu_gemm):
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3, "--num_processes", "2"]
    launch += ["--mixed_precision", "no", str(tmp_path / "launch_opefo_train.py")]
    overrides = cpu_overrides(vllm_model_path, problems_file, out) + ["--metrics_jsonl", "every_process"]
    run([*launch, *overrides], tmp_path)
    steps = [m for rank in (0, 1) for m in steps_logged(out / f"metrics.rank{rank}.jsonl")]
    check_steps(steps, processes=2)
