"""The prepared GPU check runs end to end in its tiny mode on a CPU and reports what the README quotes."""

import importlib.util
import json
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_writes_its_report_in_tiny_mode(tmp_path):
    gpu_check = _load("gpu_check")
    argv = ["--tiny", "true", "--output_dir", str(tmp_path), "--accumulation", "2"]
    argv += ["--configs", "grpo_strict", "opefo_param", "--estimates", "opefo", "param"]
    assert gpu_check.main(argv) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]["accumulation_2"]
    assert steps["grpo_strict"]["time_ratio"] == 1.0 and steps["opefo_param"]["time_ratio"] > 0
    # grad pass (2 micro-batches) + two finite-difference forwards (2 each) on top of GRPO's passes
    assert steps["opefo_param"]["extra_backbone_passes"] >= 6
    lambdas = report["lambda_precision"]
    # The param estimate's passes run in float32 whatever the training precision: the same lambda*.
    assert lambdas["param"]["lambda_bf16"] == pytest.approx(lambdas["param"]["lambda_fp32"], abs=1e-6)
    assert -1 <= lambdas["opefo"]["lambda_bf16"] <= 1
    stats = report["vocab_stats_precision"]
    assert stats["fp32"]["sum_sq_probs"]["max_rel_error"] < 1e-5
    assert stats["bf16"]["sum_sq_probs"]["max_rel_error"] < 1e-2
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| opefo_param |" in markdown and "lambda* of one rollout batch" in markdown


def test_gpu_check_refuses_a_machine_without_a_gpu_unless_tiny(tmp_path, capsys):
    gpu_check = _load("gpu_check")
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_check.main(["--output_dir", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bench_step_refuses_unknown_configurations_with_the_valid_ones(capsys):
    bench_step = _load("bench_step")
    assert bench_step.main(["--configs", "opefo_parm"]) == 2
    assert "Unknown configuration(s) ['opefo_parm']; choose among" in capsys.readouterr().err
