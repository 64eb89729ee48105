"""benchmarks/step_balance.py runs end to end and reports what the real AdamW step did (a reduced run)."""

import importlib.util
import json
import os
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


def _load(name):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


step_balance = _load("step_balance")


def test_the_step_balance_benchmark_reports_the_real_steps(tmp_path, capsys):
    output = tmp_path / "step_balance.json"
    argv = ["--steps", "2", "--learning_rates", "1e-5", "--dtype", "float64", "--output_json", str(output)]
    assert step_balance.main([*argv, "--probe_rollouts", "2", "--probe_prompts", "2", "--held_out", "8"]) == 0
    result = json.loads(output.read_text())
    runs = result["runs"]["1e-05"]
    assert len(runs["grpo"]["measured"]) == len(runs["step_balance"]["first_order"]) == 2
    assert sorted(runs) == ["fixed_probe_balance", "grpo", "probe_balance", "step_balance"]
    assert all(len(r["held_out"]) == 2 and r["held_out"][0] != 0.0 for r in runs.values())
    assert runs["grpo"]["held_out"][0] != runs["step_balance"]["held_out"][0]
    summary = result["summary"]["1e-05"]
    # float64: the balanced step's first order is the root search's residual, far below GRPO's on the same batch.
    assert summary["max_first_order_over_grpo_same_batch"] <= 1e-3
    assert summary["step1_measured_grpo"] == pytest.approx(runs["grpo"]["first_order"][0], rel=0.05)
    out = capsys.readouterr().out
    assert (
        "| step | GRPO measured |" in out
        and "| step | grpo | step_balance | probe_balance | fixed_probe_balance |" in out
    )


def test_bad_settings_are_refused_before_any_work(capsys):
    assert step_balance.main(["--dtype", "bfloat16"]) == 2
    assert "dtype must be 'float32' or 'float64'" in capsys.readouterr().err
    assert step_balance.main(["--probe_rollouts", "1"]) == 2
    assert "probe_rollouts must be 0 or >= 2" in capsys.readouterr().err
